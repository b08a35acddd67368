"""`embodied-rl pretrain task=lm/<name> steps=N`: supervised fine-tuning on the task's worked
examples.

Each step draws `batch_size` training problems (a fresh deterministic stream from the seed or,
with `lm.sft_problems=N`, epochs over a fixed set of N training problems in a new order each
epoch: the setting where labelled answers are scarce) and minimises the cross-entropy of the
answer tokens and the end-of-sequence token only (the prompt is context, not a target). With
`lm.sft_hints=p`, a share p of the examples shows its prompt with a hint of a random tier
(`lm.sft_hint_tier=N`: always tier N) before it (`LMTask.hinted_prompt`), so that the model
learns to read the hints Scaf-GRPO (`algo=scaf_grpo`) gives on problems it cannot solve: a
model trained from scratch has never seen a hint otherwise (an LLM reads one zero-shot). The
model is `model=PATH` (any local Hugging Face causal LM with its tokenizer) or, by default, the
tiny Llama of `lm.model` with the character tokenizer, trained from scratch. AdamW, linear
warmup then cosine decay. Every `eval_every` steps and at the end the model completes
`eval_episodes` held-out problems greedily (pass@1 with a Wilson interval).

Run directory: config.yaml, metrics.jsonl + tb/ (loss, lr, tokens/s, eval pass@1),
checkpoints/<step>/ and checkpoints/last/ (model.safetensors, config.json, tokenizer files,
lm_task.json), eval_info.json of the final evaluation, report.md.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from embodied_rl.algos.common import diverged, refuse_non_finite
from embodied_rl.errors import UserError
from embodied_rl.lm.sampling import encode_prompt

USED_KEYS = ("steps", "batch_size", "log_every", "eval_every", "eval_episodes", "seed", "device", "threads", "run_dir")


def _integer(cfg: DictConfig, key: str, low: int, allow_none: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise UserError(f"{key} must be an integer >= {low}, got {value!r}")


def validate(cfg: DictConfig) -> None:
    from embodied_rl.distributed import check_device
    from embodied_rl.lm import refuse_robot_keys
    from embodied_rl.lm.evaluate import check_sampling_keys

    refuse_robot_keys(cfg, "pretrain", USED_KEYS)
    for key in ("steps", "batch_size", "log_every"):
        _integer(cfg, key, 1)
    _integer(cfg, "eval_every", 1, allow_none=True)
    _integer(cfg, "eval_episodes", 0)
    _integer(cfg, "lm.warmup_steps", 0)
    _integer(cfg, "lm.sft_problems", 1, allow_none=True)
    hints = OmegaConf.select(cfg, "lm.sft_hints")
    if not isinstance(hints, (int, float)) or isinstance(hints, bool) or not 0 <= hints <= 1:
        raise UserError(f"lm.sft_hints must be a number in [0, 1], got {hints!r}")
    _integer(cfg, "lm.sft_hint_tier", 1, allow_none=True)
    for key in ("lm.lr", "lm.weight_decay"):
        value = OmegaConf.select(cfg, key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (key == "lm.lr" and value == 0):
            raise UserError(f"{key} must be a number {'> 0' if key == 'lm.lr' else '>= 0'}, got {value!r}")
    check_sampling_keys(cfg)
    check_device(cfg.device)
    if cfg.get("model") not in (None, "") and not Path(str(cfg.model)).expanduser().is_dir():
        raise UserError(f"model directory '{cfg.model}' does not exist")


def epochs(problems: list[Any], seed: int):
    """An endless stream over a fixed problem set: every problem once per epoch, a new order each."""
    rng = random.Random(f"sft-epochs/{seed}")
    order = list(problems)
    while True:
        rng.shuffle(order)
        yield from order


def training_batch(tokenizer: Any, problems: list[Any],
                   prompts: list[str] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) [B, T], right-padded; labels are -100 except on the
    answer tokens and the end-of-sequence token. `prompts`: the prompt text of each problem
    (default: its own; a hinted one)."""
    rows, targets = [], []
    for i, problem in enumerate(problems):
        prompt = encode_prompt(tokenizer, problem.prompt if prompts is None else prompts[i])
        answer = tokenizer.encode(problem.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        targets.append([-100] * len(prompt) + answer)
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, target) in enumerate(zip(rows, targets)):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
        labels[i, :len(row)] = torch.tensor(target)
    return ids, mask, labels


def answer_loss(model: Any, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled positions."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup to 1 over `warmup` steps, then cosine decay to 0.1 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def task_record(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg.task, resolve=True)


def save_checkpoints(run: Any, step: int, model: Any, tokenizer: Any, task: dict[str, Any]) -> None:
    """checkpoints/<step>/ and checkpoints/last/, each written whole or not at all."""
    from embodied_rl.lm.model import save_model
    from embodied_rl.runs import atomic_dir

    for name in (str(step), "last"):
        with atomic_dir(run.file("checkpoints", name)) as tmp:
            save_model(tmp, model, tokenizer, {**task, "step": step})


def main(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    validate(cfg)
    from embodied_rl.lm.evaluate import evaluate_model, format_overall, pass1_text
    from embodied_rl.lm.model import build_model, char_tokenizer, load_model, parameter_count
    from embodied_rl.lm.tasks import make_task
    from embodied_rl.runs import progress, start_run

    task = make_task(cfg.task)
    torch.manual_seed(int(cfg.seed))
    device = str(cfg.device)
    if cfg.get("model") not in (None, ""):
        model, tokenizer = load_model(Path(str(cfg.model)).expanduser(), device)
    else:
        tokenizer = char_tokenizer()
        model = build_model(cfg.lm.model, tokenizer).to(device)
    eval_problems = task.problems("test", int(cfg.eval_episodes), seed=int(cfg.seed)) if cfg.eval_episodes else []
    max_new_tokens = int(cfg.task.max_new_tokens)
    if eval_problems:  # a prompt that does not fit stops the run before it starts
        from embodied_rl.lm.model import context_length
        from embodied_rl.lm.sampling import check_fits

        check_fits([encode_prompt(tokenizer, p.prompt) for p in eval_problems], max_new_tokens,
                   context_length(model))

    steps, batch_size = int(cfg.steps), int(cfg.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(cfg.lm.lr), weight_decay=float(cfg.lm.weight_decay),
                                  betas=(0.9, 0.98))
    warmup = min(int(cfg.lm.warmup_steps), steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup, steps))
    sft_problems = cfg.lm.get("sft_problems")
    if sft_problems is None:
        stream = task.stream("train", int(cfg.seed))
        data = "a fresh problem every draw"
    else:
        fixed = task.problems("train", int(sft_problems), seed=int(cfg.seed))
        if len(fixed) < int(sft_problems):
            raise UserError(f"lm.sft_problems={sft_problems}: {task.name}'s training split has only {len(fixed)} problems")
        stream = epochs(fixed, int(cfg.seed))
        data = f"{len(fixed)} fixed problems, {steps * batch_size / len(fixed):.1f} epochs"
    hint_share = float(cfg.lm.sft_hints)
    if hint_share > 0 and task.hint_tiers == 0:
        raise UserError(f"lm.sft_hints={hint_share}: {task.name} has no hints")
    hint_tier = cfg.lm.get("sft_hint_tier")
    if hint_tier is not None and hint_tier > task.hint_tiers:
        raise UserError(f"lm.sft_hint_tier={hint_tier}: {task.name} has hint tiers 1..{task.hint_tiers}")
    hint_rng = random.Random(f"sft-hints/{int(cfg.seed)}")

    def prompt_of(problem: Any) -> str:  # a hint on a share hint_share of the examples
        if hint_share > 0 and hint_rng.random() < hint_share:
            return task.hinted_prompt(problem, hint_tier or hint_rng.randint(1, task.hint_tiers))
        return problem.prompt

    run = start_run(cfg, "pretrain")
    print(f"{task.name}: {parameter_count(model) / 1e6:.2f}M parameters, {steps} steps of {batch_size} problems ({data})")

    def evaluate(step: int) -> dict[str, Any]:
        info = evaluate_model(model, tokenizer, task, eval_problems, max_new_tokens=max_new_tokens,
                              batch_size=int(cfg.lm.batch_size), seed=int(cfg.seed), show=int(cfg.lm.show))
        low, high = info["overall"]["pass@1_ci95"]
        run.log(step, {"eval/pass@1": info["overall"]["pass@1"], "eval/pass@1_low": low, "eval/pass@1_high": high,
                       "eval/mean_length": info["overall"]["mean_length"]})
        return info

    model.train()
    start = time.perf_counter()
    window_loss, window_tokens, window_start = [], 0, time.perf_counter()
    final_loss = float("nan")
    info: dict[str, Any] = {}
    saved: str | None = None  # the step checkpoints/last holds, for the divergence message
    try:
        bar = progress(range(1, steps + 1), total=steps, desc="pretrain")
        for step in bar:
            problems = [next(stream) for _ in range(batch_size)]
            ids, mask, labels = training_batch(tokenizer, problems, [prompt_of(p) for p in problems])
            loss = answer_loss(model, ids.to(device), mask.to(device), labels.to(device))
            if not torch.isfinite(loss):
                raise diverged(f"step {step}", "train/loss", saved)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not torch.isfinite(grad_norm):
                raise diverged(f"step {step}", "train/grad_norm", saved)
            optimizer.step()
            scheduler.step()
            window_loss.append(loss.item())
            window_tokens += int(mask.sum())
            if step % cfg.log_every == 0 or step == steps:
                elapsed = time.perf_counter() - window_start
                final_loss = sum(window_loss) / len(window_loss)
                run.log(step, {"train/loss": final_loss, "train/lr": scheduler.get_last_lr()[0],
                               "train/grad_norm": float(grad_norm), "train/tokens_per_s": window_tokens / elapsed})
                bar.set_postfix(loss=f"{final_loss:.4f}")
                window_loss, window_tokens, window_start = [], 0, time.perf_counter()
            if step == steps or (cfg.eval_every and step % cfg.eval_every == 0):
                refuse_non_finite(f"step {step}", saved, weights=model.state_dict())
                if eval_problems:
                    info = evaluate(step)
                save_checkpoints(run, step, model, tokenizer, task_record(cfg))
                saved = f"step {step}"
        train_s = time.perf_counter() - start
        headline: dict[str, Any] = {"task": task.name, "steps": steps, "final_loss": final_loss, "train_s": train_s}
        sections = []
        if info:
            checkpoint = run.file("checkpoints", "last")
            run.write_json("eval_info.json", {"task": task.name, "checkpoint": str(checkpoint.resolve()),
                                              "seed": int(cfg.seed), "device": device, "step": steps, **info,
                                              "config": OmegaConf.to_container(cfg, resolve=True)})
            headline["pass@1"] = pass1_text(info["overall"])
            sections.append(("Held-out accuracy", format_overall(info["overall"])))
        write_sft_report(run, task.name, sections, info)
    finally:
        run.close()
    headline["checkpoint"] = str(run.file("checkpoints", "last"))
    return headline, run.path


def write_sft_report(run: Any, task_name: str, sections: list[tuple[str, str]], info: dict[str, Any]) -> None:
    from embodied_rl.eval.report import image_link, plot_curve, write_report
    from embodied_rl.lm.evaluate import completions_markdown

    rows = run.read_metrics()
    try:
        plot_curve(rows, "step", ["train/loss"], run.file("plots", "loss.png"), title="SFT loss")
        sections.append(("Loss", image_link(run.file("plots", "loss.png"), run.path)))
        plot_curve(rows, "step", ["eval/pass@1"], run.file("plots", "pass1.png"), title="held-out pass@1",
                   bands={"eval/pass@1": ("eval/pass@1_low", "eval/pass@1_high")})
        sections.append(("Held-out pass@1", image_link(run.file("plots", "pass1.png"), run.path)))
    except ValueError:  # nothing logged yet for a curve
        pass
    if info:
        sections.append(("Sample completions", completions_markdown(info["completions"])))
    write_report(run.path, f"SFT: {task_name}", sections)

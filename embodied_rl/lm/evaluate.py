"""`embodied-rl eval task=lm/<name> checkpoint=DIR`: pass@1 with a Wilson interval, pass@k,
mean completion length, per-problem records (eval_info.json) and a sample of completions.

`evaluate_model` is also what `pretrain` and `finetune` call for their held-out numbers.
pass@k is the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k), averaged over
problems, for k = 1, 2, 4, ... <= n (n = lm.samples completions per problem). The Wilson
interval of pass@1 treats the problems as the trials (successes = pass@1 * problems, rounded),
since completions of one problem are not independent.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from embodied_rl.errors import UserError
from embodied_rl.lm.model import context_length
from embodied_rl.lm.sampling import check_fits, decode_completions, encode_prompt, left_pad, sample
from embodied_rl.lm.tasks import LMTask, Problem

USED_KEYS = ("checkpoint", "seed", "device", "threads", "run_dir")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n completions of which c are correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def evaluate_model(model: Any, tokenizer: Any, task: LMTask, problems: list[Problem], *, samples: int = 1,
                   temperature: float = 0.0, max_new_tokens: int, batch_size: int = 256, seed: int = 0,
                   show: int = 10) -> dict[str, Any]:
    """Complete every problem `samples` times; {"overall", "per_problem", "completions"}."""
    from embodied_rl.eval.stats import wilson_interval

    if temperature <= 0 and samples > 1:
        raise UserError(f"lm.samples={samples} needs lm.temperature > 0 (greedy completions are all the same)")
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(int(seed))
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    check_fits(prompts, max_new_tokens, context_length(model))
    jobs = [(i, prompts[i]) for i in range(len(problems)) for _ in range(samples)]
    texts: list[list[str]] = [[] for _ in problems]
    lengths: list[list[int]] = [[] for _ in problems]
    tokens = 0
    for begin in range(0, len(jobs), batch_size):
        chunk = jobs[begin:begin + batch_size]
        ids, mask = left_pad([row for _, row in chunk], tokenizer.pad_token_id)
        out = sample(model, ids, mask, max_new_tokens=max_new_tokens, eos_id=tokenizer.eos_token_id,
                     pad_id=tokenizer.pad_token_id, temperature=temperature, generator=generator)
        row_lengths = out.completion_mask.sum(1).tolist()
        tokens += int(sum(row_lengths))
        for (index, _), text, length in zip(chunk, decode_completions(tokenizer, out), row_lengths):
            texts[index].append(text)
            lengths[index].append(int(length))
    model.train(was_training)
    eval_s = time.perf_counter() - start

    per_problem = []
    for problem, completions, problem_lengths in zip(problems, texts, lengths):
        rewards = [task.reward(problem, text) for text in completions]
        per_problem.append({"key": problem.key, "prompt": problem.prompt, "answer": problem.answer,
                            "completions": completions, "rewards": rewards, "correct": int(sum(r == 1.0 for r in rewards)),
                            "lengths": problem_lengths})
    count = len(per_problem)
    pass1 = sum(pass_at_k(samples, p["correct"], 1) for p in per_problem) / count
    low, high = wilson_interval(round(pass1 * count), count)
    overall: dict[str, Any] = {"n_problems": count, "samples": samples, "temperature": temperature,
                               "pass@1": pass1, "pass@1_ci95": [low, high]}
    k = 2
    while k <= samples:
        overall[f"pass@{k}"] = sum(pass_at_k(samples, p["correct"], k) for p in per_problem) / count
        k *= 2
    overall["mean_length"] = sum(sum(p["lengths"]) for p in per_problem) / (count * samples)
    overall["eval_s"] = eval_s
    overall["tokens_per_s"] = tokens / eval_s if eval_s > 0 else None
    shown = [{"prompt": p["prompt"], "completion": p["completions"][0], "reward": p["rewards"][0]}
             for p in per_problem[:show]]
    return {"overall": overall, "per_problem": per_problem, "completions": shown}


def pass1_text(overall: dict[str, Any]) -> str:
    """pass@1 as every headline prints it: '62.0% [48.2, 74.1]'."""
    from embodied_rl.eval.stats import rate_with_interval

    return rate_with_interval(overall["pass@1"], overall["pass@1_ci95"])


def format_overall(overall: dict[str, Any]) -> str:
    return f"pass@1 {pass1_text(overall)} over {overall['n_problems']} held-out problems"


def completions_markdown(shown: list[dict[str, Any]]) -> str:
    lines = ["| prompt | completion | reward |", "|---|---|---|"]
    for item in shown:
        completion = item["completion"].replace("|", "\\|").replace("\n", "\\n")
        lines.append(f"| `{item['prompt']}` | `{completion}` | {item['reward']:g} |")
    return "\n".join(lines)


def validate(cfg: DictConfig) -> None:
    from embodied_rl.distributed import check_device
    from embodied_rl.lm import refuse_robot_keys

    refuse_robot_keys(cfg, "eval", USED_KEYS)
    if cfg.get("checkpoint") in (None, ""):
        raise UserError("checkpoint=DIR is required (a language model checkpoint or a pretrain/finetune run directory)")
    check_sampling_keys(cfg)
    check_device(cfg.device)


def check_sampling_keys(cfg: DictConfig) -> None:
    """The lm.* evaluation keys."""
    for key, low in (("lm.problems", 1), ("lm.samples", 1), ("lm.batch_size", 1), ("lm.show", 0), ("seed", 0),
                     ("task.max_new_tokens", 1)):
        value = OmegaConf.select(cfg, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise UserError(f"{key} must be an integer >= {low}, got {value!r}")
    temperature = OmegaConf.select(cfg, "lm.temperature")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
        raise UserError(f"lm.temperature must be a number >= 0, got {temperature!r}")
    if temperature == 0 and cfg.lm.samples > 1:
        raise UserError(f"lm.samples={cfg.lm.samples} needs lm.temperature > 0 (greedy completions are all the same)")


def resolve_model_dir(path: Path) -> Path:
    """A run directory stands for its checkpoints/last."""
    if not path.exists():
        raise UserError(f"checkpoint '{path}' does not exist")
    if (path / "checkpoints" / "last").is_dir():
        return (path / "checkpoints" / "last").resolve()
    return path


def check_checkpoint_task(path: Path, task_name: str) -> None:
    from embodied_rl.lm.model import recorded_task

    recorded = recorded_task(path)
    if recorded is not None and recorded.get("name") not in (None, task_name):
        raise UserError(f"checkpoint '{path}' was trained on task '{recorded.get('name')}' but task={task_name}; "
                        f"pass task={recorded.get('name')}")


def main(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    validate(cfg)
    from embodied_rl.lm.model import load_model
    from embodied_rl.lm.tasks import make_task
    from embodied_rl.runs import start_run

    task = make_task(cfg.task)
    checkpoint = resolve_model_dir(Path(str(cfg.checkpoint)).expanduser())
    check_checkpoint_task(checkpoint, task.name)
    model, tokenizer = load_model(checkpoint, str(cfg.device))
    problems = task.problems("test", int(cfg.lm.problems), seed=int(cfg.seed))
    torch.manual_seed(int(cfg.seed))
    info = evaluate_model(model, tokenizer, task, problems, samples=int(cfg.lm.samples),
                          temperature=float(cfg.lm.temperature), max_new_tokens=int(cfg.task.max_new_tokens),
                          batch_size=int(cfg.lm.batch_size), seed=int(cfg.seed), show=int(cfg.lm.show))
    run = start_run(cfg, "eval")
    try:
        run.write_json("eval_info.json", {"task": task.name, "checkpoint": str(checkpoint.resolve()),
                                          "seed": int(cfg.seed), "device": str(cfg.device), **info,
                                          "config": OmegaConf.to_container(cfg, resolve=True)})
    finally:
        run.close()
    overall = info["overall"]
    for item in info["completions"][:3]:
        print(f"  {item['prompt']!r} -> {item['completion']!r} (reward {item['reward']:g})")
    headline: dict[str, Any] = {"task": task.name, "n_problems": overall["n_problems"], "pass@1": pass1_text(overall)}
    headline.update({key: value for key, value in overall.items()
                     if key.startswith("pass@") and key[5:].isdigit() and key != "pass@1"})
    headline["mean_length"] = overall["mean_length"]
    headline["eval_s"] = overall["eval_s"]
    return headline, run.path

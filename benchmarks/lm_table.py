"""GRPO on a language task, side by side: embodied_rl against TRL's GRPOTrainer.

    OMP_NUM_THREADS=1 python benchmarks/lm_table.py                       # lm/addition, defaults below
    python benchmarks/lm_table.py --checkpoint SFT_RUN_DIR --steps 200 --agg seq-mean-token-mean
    python benchmarks/lm_table.py --skip-trl                               # embodied_rl only

Both methods start from the same SFT checkpoint (a local Hugging Face model directory with its
tokenizer, written by `embodied-rl pretrain`; made here with --sft-steps when --checkpoint is not
given) and train on the same stream of training problems in the same order, with the same reward
function (`embodied_rl.lm.tasks`), and matched settings: prompts per step, group size
(num_generations), temperature, completion budget (max_completion_length), learning rate (AdamW,
betas 0.9/0.99, no weight decay, constant), gradient-norm clip, KL weight 0 (no reference model),
clip epsilons (low/high) and the dual clip (TRL's `delta`), std-normalised group advantages or not
(TRL's scale_rewards), one gradient step per batch of completions, and the loss aggregation:

    --agg token-mean              <-> loss_type="bnpo" (mean over the batch's valid tokens)
    --agg seq-mean-token-mean     <-> loss_type="grpo" (per completion mean, then mean)
    --agg seq-mean-token-sum-norm <-> loss_type="dr_grpo" (per completion sum over a constant;
                                      ours divides by the batch's longest completion, TRL by
                                      max_completion_length, so TRL's steps are smaller by that ratio)

Differences that remain: TRL adds 1e-4 to the group std (ours 1e-6) and samples with
`model.generate` (ours: its own KV-cache loop); with one gradient step per batch the ratio is 1 in
both, so the clip settings do not act. Both final models are evaluated by OUR eval
(`embodied-rl eval`: greedy pass@1 with a 95% Wilson interval over the same held-out problems).
Time per step is one iteration's sampling + reward + update (ours: `train/iteration_s`; TRL: from
step begin to step end); wall time is the whole training call (loading, ours' two small in-run
evaluations of --run-eval-problems problems, saving). The last line printed is one JSON object.

TRL is not a dependency of embodied_rl: `pip install trl` for this benchmark.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

# TRL's loss_type with the same aggregation as each of our loss_agg modes (see the docstring)
TRL_LOSS_TYPE = {"token-mean": "bnpo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="lm/addition", choices=["lm/addition", "lm/countdown"])
    parser.add_argument("--checkpoint", default=None, help="SFT checkpoint or pretrain run dir; none: pretrain one")
    parser.add_argument("--sft-steps", type=int, default=500, help="pretrain steps when --checkpoint is not given")
    parser.add_argument("--steps", type=int, default=200, help="GRPO iterations (optimizer steps)")
    parser.add_argument("--prompts", type=int, default=16, help="training problems per step")
    parser.add_argument("--group-size", type=int, default=8, help="completions per problem (TRL num_generations)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="completion budget; default the task's")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--clip-low", type=float, default=0.2)
    parser.add_argument("--clip-high", type=float, default=0.28)
    parser.add_argument("--dual-clip", type=float, default=3.0)
    parser.add_argument("--agg", default="token-mean", choices=sorted(TRL_LOSS_TYPE))
    parser.add_argument("--no-normalize-std", action="store_true", help="Dr.GRPO advantages (no std division)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--eval-problems", type=int, default=500, help="held-out problems of the final evaluation")
    parser.add_argument("--run-eval-problems", type=int, default=50,
                        help="held-out problems of embodied_rl's own start/end evaluation inside its run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/lm_table", help="directory of every run (must not hold earlier RL runs)")
    parser.add_argument("--skip-trl", action="store_true", help="run the embodied_rl side only")
    return parser.parse_args(argv)


def cli(args: list[str]) -> None:
    from embodied_rl.cli import main

    if main(args) != 0:
        raise SystemExit(f"embodied-rl {' '.join(args)} failed")


def sft_checkpoint(args: argparse.Namespace, out: Path) -> Path:
    """The SFT model directory both methods start from: --checkpoint, or a pretrain run (reused
    when it has finished)."""
    from embodied_rl.lm.evaluate import resolve_model_dir

    if args.checkpoint:
        return resolve_model_dir(Path(args.checkpoint).expanduser())
    run_dir = out / f"sft_{args.sft_steps}"
    if not (run_dir / "checkpoints" / "last").is_dir():
        cli(["pretrain", f"task={args.task}", f"steps={args.sft_steps}", "batch_size=64", "eval_episodes=0",
             f"seed={args.seed}", f"run_dir={run_dir}"])
    return resolve_model_dir(run_dir)


def evaluate(args: argparse.Namespace, checkpoint: Path, run_dir: Path) -> dict:
    """OUR eval of a model directory: greedy pass@1 over the first --eval-problems held-out problems."""
    cli(["eval", f"task={args.task}", f"checkpoint={checkpoint}", f"lm.problems={args.eval_problems}",
         f"seed={args.seed}", f"run_dir={run_dir}"] + budget_override(args))
    return json.loads((run_dir / "eval_info.json").read_text())["overall"]


def budget_override(args: argparse.Namespace) -> list[str]:
    return [f"task.max_new_tokens={args.max_new_tokens}"] if args.max_new_tokens else []


def run_embodied_rl(args: argparse.Namespace, sft: Path, run_dir: Path) -> dict:
    """`embodied-rl finetune algo=grpo` with the matched settings."""
    from embodied_rl.runs import read_metrics

    rl = {"steps": args.steps, "prompts": args.prompts, "group_size": args.group_size,
          "temperature": args.temperature, "lr": args.lr, "clip_low": args.clip_low, "clip_high": args.clip_high,
          "dual_clip": args.dual_clip, "loss_agg": args.agg, "normalize_std": not args.no_normalize_std,
          "kl_coef": 0.0, "max_grad_norm": args.max_grad_norm, "update_epochs": 1, "minibatches": 1,
          "eval_every": 0, "eval_problems": args.run_eval_problems, "checkpoint_every": 0}
    overrides = [f"lm.rl.{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in rl.items()]
    start = time.perf_counter()
    cli(["finetune", f"task={args.task}", f"checkpoint={sft}", "algo=grpo", f"seed={args.seed}",
         f"run_dir={run_dir}", *overrides, *budget_override(args)])
    wall = time.perf_counter() - start
    rows = [row for row in read_metrics(run_dir) if "train/iteration_s" in row]
    rewards = [row["train/reward"] for row in rows]
    return {"checkpoint": run_dir / "checkpoints" / "last", "wall_s": wall,
            "step_s": sum(row["train/iteration_s"] for row in rows) / len(rows),
            "reward_first": mean_of(rewards[:10]), "reward_last": mean_of(rewards[-10:])}


def mean_of(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def trl_prompt_text(tokenizer, prompt: str) -> str:
    """The prompt as text for TRL, which tokenizes it with the tokenizer's defaults: our encoding
    (BOS, then the prompt without special tokens) written out, checked to give the same ids."""
    from embodied_rl.lm.sampling import encode_prompt

    text = (tokenizer.bos_token or "") + prompt
    if tokenizer(text=text)["input_ids"] != encode_prompt(tokenizer, prompt):
        raise SystemExit(f"the tokenizer encodes {text!r} differently from embodied_rl's prompt encoding")
    return text


def run_trl(args: argparse.Namespace, sft: Path, run_dir: Path) -> dict:
    """TRL's GRPOTrainer on the same model, problems, reward and settings; the final model is
    saved as a checkpoint directory our eval reads."""
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from embodied_rl.cli import compose
    from embodied_rl.lm.model import load_model, recorded_task, save_model
    from embodied_rl.lm.tasks import make_task

    task_cfg = compose("finetune", [f"task={args.task}", *budget_override(args)]).task
    task = make_task(task_cfg)
    max_new_tokens = int(task_cfg.max_new_tokens)
    # our finetune draws `prompts` problems per iteration from this stream, in this order
    stream = task.stream("train", args.seed)
    problems = [next(stream) for _ in range(args.steps * args.prompts)]
    model, tokenizer = load_model(sft)
    dataset = Dataset.from_dict({"prompt": [trl_prompt_text(tokenizer, p.prompt) for p in problems],
                                 "problem_index": list(range(len(problems)))})

    def reward(completions: list[str], problem_index: list[int], **_) -> list[float]:
        return [task.reward(problems[i], text) for text, i in zip(completions, problem_index)]

    step_times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_args, **_kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, *_args, **_kwargs):
            step_times.append(time.perf_counter() - self.begin)

    config = GRPOConfig(
        output_dir=str(run_dir), max_steps=args.steps, seed=args.seed, use_cpu=True, bf16=False,
        per_device_train_batch_size=args.prompts * args.group_size, gradient_accumulation_steps=1,
        num_generations=args.group_size, num_iterations=1, shuffle_dataset=False,
        temperature=args.temperature, top_p=1.0, top_k=0, max_completion_length=max_new_tokens,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.99, optim="adamw_torch", max_grad_norm=args.max_grad_norm,
        beta=0.0, epsilon=args.clip_low, epsilon_high=args.clip_high, delta=args.dual_clip,
        loss_type=TRL_LOSS_TYPE[args.agg], scale_rewards="none" if args.no_normalize_std else "group",
        mask_truncated_completions=False, disable_dropout=True, gradient_checkpointing=False,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, log_completions=False,
    )
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.remove_callback(PrinterCallback)  # no metrics dict printed per step; log_history.json keeps them
    trainer.train()
    final = run_dir / "final"
    save_model(final, trainer.model, tokenizer, {**(recorded_task(sft) or {}), "base": str(sft),
                                                  "trained_by": "trl.GRPOTrainer"})
    wall = time.perf_counter() - start
    (run_dir / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1) + "\n")
    rewards = [float(row["reward"]) for row in trainer.state.log_history if "reward" in row]
    return {"checkpoint": final, "wall_s": wall, "step_s": mean_of(step_times),
            "reward_first": mean_of(rewards[:10]), "reward_last": mean_of(rewards[-10:])}


def percent(value: float) -> str:
    return f"{100 * value:.1f}%"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.skip_trl and importlib.util.find_spec("trl") is None:
        print("TRL is not installed: pip install trl (or pass --skip-trl)", file=sys.stderr)
        raise SystemExit(2)
    # tiny models on shared cores: one thread is much faster (torch's threads spin otherwise)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    out = Path(args.out)
    methods = ["embodied_rl"] + ([] if args.skip_trl else ["trl"])
    for name in methods:
        if (out / name).exists():
            raise SystemExit(f"{out / name} exists: choose another --out (finished RL runs are not reused)")
    sft = sft_checkpoint(args, out)
    results = {"sft": {"checkpoint": sft, "wall_s": None, "step_s": None, "reward_first": None, "reward_last": None}}
    results["embodied_rl"] = run_embodied_rl(args, sft, out / "embodied_rl")
    if not args.skip_trl:
        results["trl"] = run_trl(args, sft, out / "trl")
    for name, result in results.items():
        result["eval"] = evaluate(args, result["checkpoint"], out / f"eval_{name}")

    settings = {"task": args.task, "sft_checkpoint": str(sft), "steps": args.steps, "prompts_per_step": args.prompts,
                "group_size": args.group_size, "temperature": args.temperature,
                "max_new_tokens": args.max_new_tokens or "task default", "lr": args.lr, "kl": 0.0,
                "clip": [args.clip_low, args.clip_high], "dual_clip": args.dual_clip, "loss_agg": args.agg,
                "trl_loss_type": TRL_LOSS_TYPE[args.agg], "normalize_std": not args.no_normalize_std,
                "max_grad_norm": args.max_grad_norm, "eval_problems": args.eval_problems, "seed": args.seed,
                "threads": 1}
    print("\nsettings: " + ", ".join(f"{key}={value}" for key, value in settings.items()))
    labels = {"sft": "SFT checkpoint (start)", "embodied_rl": "embodied_rl grpo", "trl": "TRL GRPOTrainer"}
    print(f"\n{'method':<24} {'pass@1 [95% CI]':<26} {'wall s':>8} {'s / step':>9} {'train reward first->last 10':>28}")
    rows = {}
    for name, result in results.items():
        overall = result["eval"]
        low, high = overall["pass@1_ci95"]
        shown = f"{percent(overall['pass@1'])} [{percent(low)}, {percent(high)}]"
        wall = "" if result["wall_s"] is None else f"{result['wall_s']:.1f}"
        step = "" if result["step_s"] is None else f"{result['step_s']:.3f}"
        reward = "" if result["reward_first"] is None else f"{result['reward_first']:.3f} -> {result['reward_last']:.3f}"
        print(f"{labels[name]:<24} {shown:<26} {wall:>8} {step:>9} {reward:>28}")
        rows[name] = {"pass@1": overall["pass@1"], "pass@1_ci95": [low, high], "n_problems": overall["n_problems"],
                      "wall_s": result["wall_s"], "step_s": result["step_s"], "reward_first10": result["reward_first"],
                      "reward_last10": result["reward_last"], "checkpoint": str(result["checkpoint"])}
    summary = {"settings": settings, "rows": rows}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()

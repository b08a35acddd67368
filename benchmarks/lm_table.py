"""Every RL algorithm of embodied_rl on the language tasks, and GRPO against TRL's GRPOTrainer.

    OMP_NUM_THREADS=1 python benchmarks/lm_table.py                       # both tasks, every algorithm, TRL
    python benchmarks/lm_table.py --task lm/countdown --algos grpo ppo --steps 200 --countdown-steps 200
    python benchmarks/lm_table.py --task lm/addition --algos grpo --checkpoint SFT_RUN_DIR --agg seq-mean-token-mean
    python benchmarks/lm_table.py --skip-trl                               # embodied_rl only
    python benchmarks/lm_table.py --task lm/addition --algos grpo --checkpoint SFT --task-set digits=2   # task options

On each task (--tasks, default lm/addition and lm/countdown) one SFT checkpoint (a local Hugging
Face model directory with its tokenizer, written by `embodied-rl pretrain`; made here with
--sft-steps when --checkpoint is not given) is the start of every run: `embodied-rl finetune
algo=A` for each A of --algos, and TRL's GRPOTrainer, all for --steps steps (--countdown-steps on
lm/countdown). Every run trains on the same stream of training problems in the same order, with
the same reward function (`embodied_rl.lm.tasks`), and the same settings: prompts per step, group
size (num_generations), temperature, completion budget (max_completion_length), learning rate
(AdamW, betas 0.9/0.99, no weight decay, constant), gradient-norm clip, KL weight 0 (no reference
model), clip epsilons (low/high) and the dual clip (TRL's `delta`), std-normalised group
advantages or not (TRL's scale_rewards), one gradient step per batch of completions, and the loss
aggregation:

    --agg token-mean              <-> loss_type="bnpo" (mean over the batch's valid tokens)
    --agg seq-mean-token-mean     <-> loss_type="grpo" (per completion mean, then mean)
    --agg seq-mean-token-sum-norm <-> loss_type="dr_grpo" (per completion sum over a constant;
                                      ours divides by the batch's longest completion, TRL by
                                      max_completion_length, so TRL's steps are smaller by that ratio)

Differences that remain: TRL adds 1e-4 to the group std (ours 1e-6) and samples with
`model.generate` (ours: its own KV-cache loop); with one gradient step per batch the ratio is 1 in
both, so the clip settings do not act.

Every run saves its model every --curve-every steps and at the end; OUR eval (`embodied-rl
eval`: greedy pass@1 with a 95% Wilson interval over the same --eval-problems held-out problems)
scores each of them and the SFT start, which gives pass@1 against steps and against training
seconds. Training seconds are the sum of the step times (one iteration's sampling + reward +
update; ours: `train/iteration_s`, TRL: from step begin to step end), so loading, saving and
evaluating count on neither side. GRPO against TRL: pass@1 after equal steps, and at equal
training time: when the faster side finished, the last checkpoint each side had reached by then.
Wall time is the whole training call (loading, ours' small start/end evaluations of
--run-eval-problems problems, the checkpoints); tokens/s is generated completion tokens (EOS
included) per training second. The last line printed is one JSON object.

TRL is not a dependency of embodied_rl: `pip install trl` for this benchmark.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
import time
from pathlib import Path

TASKS = ["lm/addition", "lm/countdown"]
ALGOS = ["grpo", "rloo", "reinforce_pp", "ppo"]
# TRL's loss_type with the same aggregation as each of our loss_agg modes (see the docstring)
TRL_LOSS_TYPE = {"token-mean": "bnpo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS)
    parser.add_argument("--task", default=None, choices=TASKS, help="one task: the same as --tasks TASK")
    parser.add_argument("--algos", nargs="+", default=ALGOS, choices=ALGOS, help="our algorithms, each one run")
    parser.add_argument("--checkpoint", default=None, help="SFT checkpoint or pretrain run dir (one task only); "
                                                           "none: pretrain one per task")
    parser.add_argument("--sft-steps", type=int, default=500, help="pretrain steps when --checkpoint is not given")
    parser.add_argument("--steps", type=int, default=200, help="RL iterations (optimizer steps) of every run")
    parser.add_argument("--countdown-steps", type=int, default=100,
                        help="--steps on lm/countdown, whose steps cost about 4x addition's (24-token budget, not 8)")
    parser.add_argument("--curve-every", type=int, default=50, help="save and evaluate every run every K steps "
                                                                    "(0: the end only)")
    parser.add_argument("--prompts", type=int, default=16, help="training problems per step")
    parser.add_argument("--group-size", type=int, default=8, help="completions per problem (TRL num_generations)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="completion budget; default the task's")
    parser.add_argument("--task-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a task option for every run and the TRL side, e.g. digits=2 (task.digits=2)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--clip-low", type=float, default=0.2)
    parser.add_argument("--clip-high", type=float, default=0.28)
    parser.add_argument("--dual-clip", type=float, default=3.0)
    parser.add_argument("--agg", default="token-mean", choices=sorted(TRL_LOSS_TYPE))
    parser.add_argument("--no-normalize-std", action="store_true", help="Dr.GRPO advantages (no std division)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--eval-problems", type=int, default=500, help="held-out problems of every evaluation")
    parser.add_argument("--run-eval-problems", type=int, default=50,
                        help="held-out problems of embodied_rl's own start/end evaluation inside its run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/lm_table", help="directory of every run (must not hold earlier RL runs)")
    parser.add_argument("--skip-trl", action="store_true", help="run the embodied_rl side only")
    args = parser.parse_args(argv)
    if args.task:
        args.tasks = [args.task]
    if args.checkpoint and len(args.tasks) > 1:
        parser.error("--checkpoint is one task's SFT model: pass --task too")
    if args.curve_every < 0:
        parser.error("--curve-every must be >= 0")
    return args


def cli(args: list[str]) -> None:
    from embodied_rl.cli import main

    if main(args) != 0:
        raise SystemExit(f"embodied-rl {' '.join(args)} failed")


def sft_checkpoint(args: argparse.Namespace, task: str, out: Path) -> Path:
    """The SFT model directory every run of the task starts from: --checkpoint, or a pretrain run
    (reused when it has finished)."""
    from embodied_rl.lm.evaluate import resolve_model_dir

    if args.checkpoint:
        return resolve_model_dir(Path(args.checkpoint).expanduser())
    run_dir = out / f"sft_{args.sft_steps}"
    if not (run_dir / "checkpoints" / "last").is_dir():
        cli(["pretrain", f"task={task}", f"steps={args.sft_steps}", "batch_size=64", "eval_episodes=0",
             f"seed={args.seed}", f"run_dir={run_dir}", *task_overrides(args)])
    return resolve_model_dir(run_dir)


def evaluate(args: argparse.Namespace, task: str, checkpoint: Path, run_dir: Path) -> dict:
    """OUR eval of a model directory: greedy pass@1 over the first --eval-problems held-out problems."""
    cli(["eval", f"task={task}", f"checkpoint={checkpoint}", f"lm.problems={args.eval_problems}",
         f"seed={args.seed}", f"run_dir={run_dir}"] + task_overrides(args))
    return json.loads((run_dir / "eval_info.json").read_text())["overall"]


def task_overrides(args: argparse.Namespace) -> list[str]:
    """The task options every command and the TRL side take: --max-new-tokens and each --task-set."""
    budget = [f"task.max_new_tokens={args.max_new_tokens}"] if args.max_new_tokens else []
    return budget + [f"task.{option}" for option in args.task_set]


def run_embodied_rl(args: argparse.Namespace, task: str, algo: str, sft: Path, run_dir: Path) -> dict:
    """`embodied-rl finetune algo=ALGO` with the matched settings, a checkpoint every --curve-every steps."""
    import embodied_rl.algos.common as common
    from embodied_rl.runs import read_metrics

    rl = {"steps": args.steps, "prompts": args.prompts, "group_size": args.group_size,
          "temperature": args.temperature, "lr": args.lr, "clip_low": args.clip_low, "clip_high": args.clip_high,
          "dual_clip": args.dual_clip, "loss_agg": args.agg, "normalize_std": not args.no_normalize_std,
          "kl_coef": 0.0, "max_grad_norm": args.max_grad_norm, "update_epochs": 1, "minibatches": 1,
          "eval_every": 0, "eval_problems": args.run_eval_problems, "checkpoint_every": args.curve_every,
          "log_every": 1}
    overrides = [f"lm.rl.{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in rl.items()]
    keep = common.KEEP_CHECKPOINTS
    common.KEEP_CHECKPOINTS = args.steps + 1  # finetune keeps its newest 3 checkpoints; the curve needs them all
    start = time.perf_counter()
    try:
        cli(["finetune", f"task={task}", f"checkpoint={sft}", f"algo={algo}", f"seed={args.seed}",
             f"run_dir={run_dir}", *overrides, *task_overrides(args)])
    finally:
        common.KEEP_CHECKPOINTS = keep
    wall = time.perf_counter() - start
    rows = [row for row in read_metrics(run_dir) if "train/iteration_s" in row]  # one row per step (log_every=1)
    train_s = dict(zip([row["step"] for row in rows], itertools.accumulate(row["train/iteration_s"] for row in rows)))
    checkpoints = {int(path.name): (path, train_s[int(path.name)])
                   for path in (run_dir / "checkpoints").iterdir() if path.name.isdigit()}
    tokens = sum(row["train/tokens_per_s"] * row["train/iteration_s"] for row in rows)
    rewards = [row["train/reward"] for row in rows]
    return {"checkpoints": checkpoints, "wall_s": wall, "train_s": train_s[args.steps],
            "step_s": train_s[args.steps] / len(rows), "tokens_per_s": tokens / train_s[args.steps],
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


def run_trl(args: argparse.Namespace, task_name: str, sft: Path, run_dir: Path) -> dict:
    """TRL's GRPOTrainer on the same model, problems, reward and settings; its model is saved every
    --curve-every steps and at the end as checkpoint directories our eval reads."""
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from embodied_rl.config import compose
    from embodied_rl.lm.model import load_model, recorded_task, save_model
    from embodied_rl.lm.rl import rl_problem_stream
    from embodied_rl.lm.tasks import make_task

    task_cfg = compose("finetune", [f"task={task_name}", *task_overrides(args)]).task
    task = make_task(task_cfg)
    max_new_tokens = int(task_cfg.max_new_tokens)
    # our finetune draws `prompts` problems per iteration from this stream, in this order
    stream = rl_problem_stream(task, args.seed)
    problems = [next(stream) for _ in range(args.steps * args.prompts)]
    model, tokenizer = load_model(sft)
    dataset = Dataset.from_dict({"prompt": [trl_prompt_text(tokenizer, p.prompt) for p in problems],
                                 "problem_index": list(range(len(problems)))})
    record = {**(recorded_task(sft) or {}), "base": str(sft), "trained_by": "trl.GRPOTrainer"}

    def reward(completions: list[str], problem_index: list[int], **_) -> list[float]:
        return [task.reward(problems[i], text) for text, i in zip(completions, problem_index)]

    step_times: list[float] = []
    checkpoints: dict[int, tuple[Path, float]] = {}

    class StepTimerAndSaver(TrainerCallback):
        def on_step_begin(self, *_args, **_kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, _args, state, _control, model=None, **_kwargs):
            step_times.append(time.perf_counter() - self.begin)  # before saving: saving is not training
            step = state.global_step
            if step == args.steps or (args.curve_every and step % args.curve_every == 0):
                path = run_dir / "checkpoints" / str(step)
                save_model(path, model, tokenizer, {**record, "step": step})
                checkpoints[step] = (path, sum(step_times))

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
                          processing_class=tokenizer, callbacks=[StepTimerAndSaver()])
    trainer.remove_callback(PrinterCallback)  # no metrics dict printed per step; log_history.json keeps them
    trainer.train()
    wall = time.perf_counter() - start
    (run_dir / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1) + "\n")
    logged = [row for row in trainer.state.log_history if "reward" in row]
    rewards = [float(row["reward"]) for row in logged]
    # completions/mean_length counts each completion's tokens up to and including EOS, as ours
    tokens = sum(row["completions/mean_length"] for row in logged) * args.prompts * args.group_size
    return {"checkpoints": checkpoints, "wall_s": wall, "train_s": sum(step_times), "step_s": mean_of(step_times),
            "tokens_per_s": tokens / sum(step_times), "reward_first": mean_of(rewards[:10]),
            "reward_last": mean_of(rewards[-10:])}


def curve_point(step: int, train_s: float, overall: dict) -> dict:
    return {"step": step, "train_s": train_s, "pass@1": overall["pass@1"], "pass@1_ci95": overall["pass@1_ci95"],
            "n_problems": overall["n_problems"]}


def at_train_s(curve: list[dict], seconds: float) -> dict:
    """The curve's point that a run holds after `seconds` of training: its last checkpoint by then
    (the curve starts at step 0, 0 s)."""
    return [point for point in curve if point["train_s"] <= seconds][-1]


def compare(ours: list[dict], trl: list[dict], ours_step_s: float, trl_step_s: float) -> dict:
    """embodied_rl grpo against TRL: pass@1 after equal steps (each curve's end), and at equal
    training time (when the faster side finished, the checkpoint each side held)."""
    seconds = min(ours[-1]["train_s"], trl[-1]["train_s"])
    ours_then, trl_then = at_train_s(ours, seconds), at_train_s(trl, seconds)
    return {"equal_steps": {"steps": ours[-1]["step"], "embodied_rl": ours[-1]["pass@1"], "trl": trl[-1]["pass@1"]},
            "equal_time": {"train_s": seconds, "faster": "embodied_rl" if ours[-1]["train_s"] <= trl[-1]["train_s"]
                           else "trl", "embodied_rl": ours_then["pass@1"], "embodied_rl_step": ours_then["step"],
                           "trl": trl_then["pass@1"], "trl_step": trl_then["step"]},
            "step_s_ratio": ours_step_s / trl_step_s}


def percent(value: float) -> str:
    return f"{100 * value:.1f}%"


def with_ci(point: dict) -> str:
    low, high = point["pass@1_ci95"]
    return f"{percent(point['pass@1'])} [{percent(low)}, {percent(high)}]"


def task_args(args: argparse.Namespace, task: str) -> argparse.Namespace:
    """The arguments of one task's runs: --countdown-steps is --steps there."""
    return argparse.Namespace(**{**vars(args), "steps": args.countdown_steps if task == "lm/countdown" else args.steps})


def run_task(args: argparse.Namespace, task: str, out: Path) -> dict:
    """SFT, then every algorithm and TRL from it; each run's curve scored by our eval."""
    args = task_args(args, task)
    sft = sft_checkpoint(args, task, out)
    results = {algo: run_embodied_rl(args, task, algo, sft, out / algo) for algo in args.algos}
    if not args.skip_trl:
        results["trl"] = run_trl(args, task, sft, out / "trl")
    start = curve_point(0, 0.0, evaluate(args, task, sft, out / "evals" / "sft"))
    for name, result in results.items():
        result["curve"] = [start] + [curve_point(step, train_s, evaluate(args, task, path, out / "evals" / f"{name}_{step}"))
                                     for step, (path, train_s) in sorted(result.pop("checkpoints").items())]
        result.update({"pass@1": result["curve"][-1]["pass@1"], "pass@1_ci95": result["curve"][-1]["pass@1_ci95"]})
    summary = {"sft_checkpoint": str(sft), "steps": args.steps, "sft": start, "rows": results}
    if not args.skip_trl and "grpo" in results:
        summary["grpo_vs_trl"] = compare(results["grpo"]["curve"], results["trl"]["curve"],
                                         results["grpo"]["step_s"], results["trl"]["step_s"])
    return summary


def print_task(args: argparse.Namespace, task: str, summary: dict) -> None:
    labels = {"trl": "TRL GRPOTrainer"}
    rows = summary["rows"]
    print(f"\n{task}: SFT {summary['sft_checkpoint']}, {summary['steps']} RL steps x {args.prompts} prompts x "
          f"{args.group_size} completions, pass@1 over {summary['sft']['n_problems']} held-out problems")
    print(f"{'method':<22} {'pass@1 [95% CI]':<26} {'wall s':>7} {'train s':>8} {'s / step':>9} {'tokens/s':>9} "
          f"{'reward first->last 10':>22}")
    print(f"{'SFT checkpoint (start)':<22} {with_ci(summary['sft']):<26}")
    for name, result in rows.items():
        reward = f"{result['reward_first']:.3f} -> {result['reward_last']:.3f}"
        print(f"{labels.get(name, name):<22} {with_ci(result['curve'][-1]):<26} {result['wall_s']:>7.1f} "
              f"{result['train_s']:>8.1f} {result['step_s']:>9.3f} {result['tokens_per_s']:>9.0f} {reward:>22}")
    print("\npass@1 along training, at training seconds:")
    print(f"{'step':>5}  " + "  ".join(f"{labels.get(name, name):>16}" for name in rows))
    for index, point in enumerate(next(iter(rows.values()))["curve"]):
        cells = [result["curve"][index] for result in rows.values()]
        print(f"{point['step']:>5}  " + "  ".join(f"{percent(c['pass@1']):>7} @{c['train_s']:>6.1f}s" for c in cells))
    if "grpo_vs_trl" in summary:
        versus = summary["grpo_vs_trl"]
        same, timed = versus["equal_steps"], versus["equal_time"]
        print(f"\nembodied_rl grpo vs TRL GRPOTrainer: after {same['steps']} steps {percent(same['embodied_rl'])} vs "
              f"{percent(same['trl'])}; at {timed['train_s']:.1f} training s (when {timed['faster']} finished) "
              f"{percent(timed['embodied_rl'])} (step {timed['embodied_rl_step']}) vs {percent(timed['trl'])} "
              f"(step {timed['trl_step']}); time per step ours / TRL {versus['step_s_ratio']:.2f}")


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
    methods = args.algos + ([] if args.skip_trl else ["trl"])
    for task in args.tasks:
        for name in methods:
            if (out / task_dir(task) / name).exists():
                raise SystemExit(f"{out / task_dir(task) / name} exists: choose another --out "
                                 f"(finished RL runs are not reused)")
    settings = {"tasks": args.tasks, "algos": args.algos, "trl": not args.skip_trl, "sft_steps": args.sft_steps,
                "steps": args.steps, "countdown_steps": args.countdown_steps, "curve_every": args.curve_every,
                "prompts_per_step": args.prompts, "group_size": args.group_size, "temperature": args.temperature,
                "max_new_tokens": args.max_new_tokens or "task default", "lr": args.lr, "kl": 0.0,
                "clip": [args.clip_low, args.clip_high], "dual_clip": args.dual_clip, "loss_agg": args.agg,
                "trl_loss_type": TRL_LOSS_TYPE[args.agg], "normalize_std": not args.no_normalize_std,
                "max_grad_norm": args.max_grad_norm, "eval_problems": args.eval_problems, "seed": args.seed,
                "threads": 1}
    tasks = {task: run_task(args, task, out / task_dir(task)) for task in args.tasks}
    for task, task_summary in tasks.items():  # the tables together, after every run's own output
        print_task(args, task, task_summary)
    print("\nsettings: " + ", ".join(f"{key}={value}" for key, value in settings.items()))
    summary = {"settings": settings, "tasks": tasks}
    print(json.dumps(summary))
    return summary


def task_dir(task: str) -> str:
    return task.split("/", 1)[1]


if __name__ == "__main__":
    main()

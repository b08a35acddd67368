"""`embodied-rl finetune task=lm/<name> checkpoint=DIR algo=grpo|scaf_grpo|rloo|reinforce_pp|ppo`:
RL with a verifiable reward on token sequences, every advantage and loss from embodied_rl.core.

One iteration (hyperparameters: the task config's `lm.rl` section, `RLConfig`):
1. sample `group_size` completions (temperature, KV cache) for each of `prompts` training problems;
   score each completion with the task's reward (1 correct, 0 otherwise);
2. dynamic sampling (DAPO, optional): drop groups whose rewards are all equal (they carry no
   signal) and sample new problems, up to `max_refills` more rounds;
   scaf_grpo (Scaf-GRPO, Zhang et al. 2025) instead scaffolds the groups whose completions all
   failed, once the first `hint_after` share of the run (its guidance-exemption period) is over:
   `hint_samples` completions per such problem under the task's tier-1 hint, then tier 2, ...
   until one succeeds (`scaffold`); that completion, with its hinted prompt, replaces one failed
   completion of the group, so the group has an advantage again. Its log-probs, old and new,
   are taken under the hinted prompt it was sampled from (the paper's on-policy form). Held-out
   evaluation never shows a hint;
3. recompute the old log-probs with the current weights (so the ratio is exactly 1 at the first
   minibatch), the frozen reference's log-probs when kl_coef > 0, and ppo's values;
4. token rewards `[B, L]`: the score on each row's last valid token, minus kl_coef * KL per token
   when kl_in_reward;
5. advantages `[B, L]`:
   grpo/rloo: `core.group_advantages(row scores, group ids)` (normalize_std=false is Dr.GRPO)
   broadcast over the row; reinforce_pp: `core.discounted_returns` then `core.masked_whiten`;
   ppo: `core.masked_gae` with a value model (a copy of the base LM with a linear value head)
   then `core.masked_whiten`;
6. `update_epochs` x `minibatches` steps of `core.policy_loss` (clip_low/clip_high, dual clip,
   any `core.agg_loss` mode) + kl_coef * `core.kl_penalty` (as a loss) - ent_coef * entropy, and
   `core.value_loss` for ppo.
ReMix (Liang et al. 2025), for every algorithm: with `reuse_iterations` m > 1 the update of step 6
also trains on the previous m - 1 iterations' completions, kept with the log-probs and advantages
they were sampled with (update-to-data ratio m); their clipped loss is the mix-policy one
(`core.policy_loss` with `precedent_logp`: the trust region centred on the weights before the
update). `kl_convex` < 1 splits the KL loss term between the base model and those weights (the
KL-convex constraint); after iteration `reincarnate_at` the base becomes the current model,
the replayed iterations are dropped and training goes on on-policy (policy reincarnation).

The run's bookkeeping is the robot finetune's, `algos.common.FinetuneLoop`, counting iterations
(`steps`) where robot runs count env steps: resume, checkpoints, the evaluation schedule
(`HeldOutEvaluation`: greedy pass@1 on held-out problems), checkpoints/best, the logging window
and the divergence guard. Run directory as the robot finetune: config.yaml, metrics.jsonl + tb/,
checkpoints/<step>/ (the model and tokenizer files at the top, training_state/ for an exact
resume) with checkpoints/last, checkpoints/best (the model of the best evaluation, best.json),
eval_info.json of the last evaluation, report.md with the reward and accuracy curves.
A run_dir holding checkpoints resumes (a larger lm.rl.steps continues training).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from embodied_rl import core
from embodied_rl.core.losses import KL_KINDS
from embodied_rl.errors import UserError
from embodied_rl.lm.sampling import Samples, decode_completions, encode_prompt, left_pad, sample

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
USED_KEYS = ("checkpoint", "seed", "device", "threads", "run_dir", "algo")
# keys a resumed run may change: how long it runs and what it records, not what it trains
RESUME_MAY_CHANGE = ("lm.rl.steps", "lm.rl.eval_every", "lm.rl.eval_problems", "lm.rl.checkpoint_every",
                     "lm.rl.log_every")


@dataclass(frozen=True)
class RLConfig:
    """configs/task/lm/<task>.yaml `lm.rl` plus the algorithm; every value checked at start."""

    algo: str
    steps: int
    prompts: int
    group_size: int
    temperature: float
    lr: float
    critic_lr: float
    update_epochs: int
    minibatches: int
    clip_low: float
    clip_high: float
    dual_clip: float | None
    loss_agg: str
    normalize_std: bool
    kl_coef: float
    kl_kind: str
    kl_in_reward: bool
    ent_coef: float
    dynamic_sampling: bool
    max_refills: int
    gamma: float
    lam: float
    value_clip: float | None
    max_grad_norm: float
    log_every: int
    eval_every: int
    eval_problems: int
    checkpoint_every: int
    hint_after: float
    hint_samples: int
    reuse_iterations: int
    kl_convex: float
    reincarnate_at: int | None

    @classmethod
    def from_cfg(cls, algo: str, rl: Any) -> RLConfig:
        values = OmegaConf.to_container(rl, resolve=True) if OmegaConf.is_config(rl) else dict(rl)
        names = [f.name for f in fields(RLConfig) if f.name != "algo"]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise UserError(f"unknown key lm.rl.{unknown[0]}")
        missing = [name for name in names if name not in values]
        if missing:
            raise UserError(f"lm.rl.{missing[0]} is required")
        config = cls(algo=algo, **values)
        config.check()
        return config

    def check(self) -> None:
        def integer(name: str, low: int) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise UserError(f"lm.rl.{name} must be an integer >= {low}, got {value!r}")

        def number(name: str, low: float, allow_none: bool = False, strict: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < low or (strict and value == low):
                raise UserError(f"lm.rl.{name} must be a number {'>' if strict else '>='} {low}, got {value!r}")

        if self.algo not in ADVANTAGES:
            raise UserError(f"algo={self.algo} does not apply to language tasks (choose from: {', '.join(ADVANTAGES)})")
        for name, low in (("steps", 1), ("prompts", 1), ("group_size", 1), ("update_epochs", 1), ("minibatches", 1),
                          ("max_refills", 0), ("log_every", 1), ("eval_every", 0), ("eval_problems", 1),
                          ("checkpoint_every", 0), ("hint_samples", 1), ("reuse_iterations", 1)):
            integer(name, low)
        for name in ("temperature", "lr", "critic_lr", "max_grad_norm"):
            number(name, 0.0, strict=True)
        for name in ("clip_low", "clip_high", "kl_coef", "ent_coef"):
            number(name, 0.0)
        number("value_clip", 0.0, allow_none=True)
        number("dual_clip", 1.0, allow_none=True, strict=True)
        if self.reincarnate_at is not None:
            integer("reincarnate_at", 0)
        for name in ("gamma", "lam", "hint_after", "kl_convex"):
            number(name, 0.0)
            if getattr(self, name) > 1:
                raise UserError(f"lm.rl.{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("normalize_std", "kl_in_reward", "dynamic_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"lm.rl.{name} must be true or false, got {getattr(self, name)!r}")
        if self.loss_agg not in AGG_MODES:
            raise UserError(f"lm.rl.loss_agg must be one of {', '.join(AGG_MODES)}, got {self.loss_agg!r}")
        if self.kl_kind not in KL_KINDS:
            raise UserError(f"lm.rl.kl_kind must be one of {', '.join(KL_KINDS)}, got {self.kl_kind!r}")
        if self.algo == "scaf_grpo" and self.dynamic_sampling:
            raise UserError("lm.rl.dynamic_sampling drops the groups whose completions all fail; algo=scaf_grpo "
                            "scaffolds them with hints: use one or the other")
        if self.kl_convex < 1 and (self.kl_coef == 0 or self.kl_in_reward):
            raise UserError(f"lm.rl.kl_convex={self.kl_convex} weighs the KL loss term between the base and the "
                            "precedent policy: it needs lm.rl.kl_coef > 0 and lm.rl.kl_in_reward=false")
        if self.algo in ("grpo", "scaf_grpo", "rloo") and self.group_size < 2:
            raise UserError(f"lm.rl.group_size must be >= 2 for algo={self.algo} (advantages compare a group)")
        if self.prompts * self.group_size < self.minibatches:
            raise UserError(f"lm.rl.minibatches={self.minibatches} is more than the {self.prompts * self.group_size} "
                            "completions per iteration")


# ---------------------------------------------------------------------------------------------
# Tensors of a batch of completions
# ---------------------------------------------------------------------------------------------


def sequence_inputs(samples: Samples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids) of prompt + completion rows."""
    ids = torch.cat([samples.prompt_ids, samples.completion_ids], dim=1)
    mask = torch.cat([samples.prompt_mask, samples.completion_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def completion_logprobs(model: Any, samples: Samples, with_entropy: bool = False, with_hidden: bool = False,
                        temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """Log-probs [B, L] of the completion tokens under `model` with its logits divided by the
    sampling temperature, so that they are the sampling policy's (as verl); and their
    entropies, and the last hidden states at the positions that predict them."""
    ids, mask, positions = sequence_inputs(samples)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=with_hidden)
    prompt_len, length = samples.prompt_ids.shape[1], samples.completion_ids.shape[1]
    logits = out.logits[:, prompt_len - 1:prompt_len - 1 + length].float() / temperature  # t predicts t+1
    logp = torch.log_softmax(logits, dim=-1).gather(-1, samples.completion_ids[..., None]).squeeze(-1)
    result = {"logp": logp}
    if with_entropy:
        result["entropy"] = core.entropy_from_logits(logits)
    if with_hidden:
        result["hidden"] = out.hidden_states[-1][:, prompt_len - 1:prompt_len - 1 + length].float()
    return result


class ValueModel(torch.nn.Module):
    """PPO's critic: a copy of the base LM whose last hidden state feeds a linear value head."""

    def __init__(self, lm: Any):
        super().__init__()
        self.lm = copy.deepcopy(lm)
        self.head = torch.nn.Linear(self.lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, samples: Samples) -> torch.Tensor:
        hidden = completion_logprobs(self.lm, samples, with_hidden=True)["hidden"]
        return self.head(hidden).squeeze(-1)


def select(samples: Samples, rows: torch.Tensor) -> Samples:
    return Samples(samples.prompt_ids[rows], samples.prompt_mask[rows], samples.completion_ids[rows],
                   samples.completion_mask[rows])


def concat(parts: list[Samples], pad_id: int) -> Samples:
    """One batch of several sampling rounds (prompts re-left-padded, completions right-padded)."""
    prompt_width = max(p.prompt_ids.shape[1] for p in parts)
    width = max(p.completion_ids.shape[1] for p in parts)

    def pad(tensor: torch.Tensor, to: int, value: int, left: bool) -> torch.Tensor:
        extra = to - tensor.shape[1]
        padding = (extra, 0) if left else (0, extra)
        return torch.nn.functional.pad(tensor, padding, value=value)

    return Samples(
        torch.cat([pad(p.prompt_ids, prompt_width, pad_id, True) for p in parts]),
        torch.cat([pad(p.prompt_mask, prompt_width, 0, True) for p in parts]),
        torch.cat([pad(p.completion_ids, width, pad_id, False) for p in parts]),
        torch.cat([pad(p.completion_mask, width, 0, False) for p in parts]),
    )


def last_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L] zeros with each row's score on its last valid token (an outcome reward)."""
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    last = (mask.sum(1) - 1).clamp(min=0).long()
    rewards[torch.arange(mask.shape[0], device=mask.device), last] = scores
    return rewards


def informative_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[num_groups] bool: the groups (consecutive rows) whose scores are not all equal."""
    per_group = scores.view(-1, group_size)
    return (per_group.max(1).values - per_group.min(1).values) > 1e-6


def group_relative(config: RLConfig, token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                   values: torch.Tensor | None) -> tuple[torch.Tensor, None]:
    """grpo / scaf_grpo / rloo: each row's score against its group's, broadcast over the row."""
    valid = mask.to(token_rewards.dtype)
    scores = (token_rewards * valid).sum(1)
    method = "rloo" if config.algo == "rloo" else "grpo"
    advantages = core.group_advantages(scores, group_ids, method=method, normalize_std=config.normalize_std)
    return advantages[:, None] * valid, None


def whitened_returns(config: RLConfig, token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                     values: torch.Tensor | None) -> tuple[torch.Tensor, None]:
    """reinforce_pp: discounted token returns, whitened over the batch."""
    returns = core.discounted_returns(token_rewards, mask, config.gamma)
    return core.masked_whiten(returns, mask) * mask.to(token_rewards.dtype), None


def whitened_gae(config: RLConfig, token_rewards: torch.Tensor, mask: torch.Tensor, group_ids: torch.Tensor,
                 values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """ppo: GAE on the value model's values, whitened; and the returns its value loss fits."""
    advantages, returns = core.masked_gae(token_rewards, values, mask, config.gamma, config.lam)
    return core.masked_whiten(advantages, mask) * mask.to(token_rewards.dtype), returns


# algo -> its advantage estimator; the keys are the language algorithms
ADVANTAGES = {"grpo": group_relative, "scaf_grpo": group_relative, "rloo": group_relative,
              "reinforce_pp": whitened_returns, "ppo": whitened_gae}


def compute_advantages(config: RLConfig, token_rewards: torch.Tensor, mask: torch.Tensor,
                       group_ids: torch.Tensor, values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages [B, L] zero outside the mask, returns [B, L] for ppo's value loss or None)."""
    return ADVANTAGES[config.algo](config, token_rewards, mask, group_ids, values)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def validate(cfg: DictConfig) -> RLConfig:
    from embodied_rl import distributed
    from embodied_rl.lm import refuse_robot_keys

    if distributed.active():  # FinetuneLoop would count every rank's iterations as the job's
        raise UserError(f"finetune on a language task ({cfg.task.name}) runs in one process; run it without torchrun")
    refuse_robot_keys(cfg, "finetune", USED_KEYS)
    config = RLConfig.from_cfg(str(cfg.algo.name), cfg.lm.rl)
    refuse_algo_keys(cfg)
    if cfg.get("checkpoint") in (None, ""):
        raise UserError("checkpoint=DIR is required (a language model checkpoint or a pretrain run directory)")
    for key, low in (("seed", 0), ("task.max_new_tokens", 1), ("lm.batch_size", 1), ("lm.show", 0)):
        value = OmegaConf.select(cfg, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise UserError(f"{key} must be an integer >= {low}, got {value!r}")
    distributed.check_device(cfg.device)
    return config


def refuse_algo_keys(cfg: DictConfig) -> None:
    """The language algorithms read lm.rl; an algo.* key changed on the command line (the
    robot algorithm's settings) cannot be honoured."""
    from embodied_rl.config import compose

    reference = compose("finetune", [f"task={cfg.task.name}", f"algo={cfg.algo.name}"]).algo
    for key, value in cfg.algo.items():
        if key != "name" and reference.get(key) != value:
            raise UserError(f"algo.{key} does not apply to language tasks; set lm.rl.* instead")


def rl_problem_stream(task: Any, seed: int):
    """The training problems RL draws, in order: a stream of its own, so that an SFT run with the
    same seed (`lm.sft_problems` takes the first problems of the untagged stream) does not hand RL
    its memorised set first (every group all correct: no advantage)."""
    return task.stream("train", seed, tag="rl")


def main(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    config = validate(cfg)
    from embodied_rl.algos.common import FinetuneLoop
    from embodied_rl.eval.stats import before_after, rate_with_interval, start_rate
    from embodied_rl.lm.evaluate import check_checkpoint_task, resolve_model_dir
    from embodied_rl.lm.model import context_length, load_model, save_model
    from embodied_rl.lm.sampling import check_fits
    from embodied_rl.lm.tasks import make_task
    from embodied_rl.runs import check_previous_run, start_run

    task = make_task(cfg.task)
    if config.algo == "scaf_grpo" and task.hint_tiers == 0:
        raise UserError(f"algo=scaf_grpo needs a task with hints; {task.name} has none")
    device, seed = str(cfg.device), int(cfg.seed)
    base = resolve_model_dir(Path(str(cfg.checkpoint)).expanduser())
    check_checkpoint_task(base, task.name)
    model, tokenizer = load_model(base, device)
    max_new_tokens = int(cfg.task.max_new_tokens)
    eval_problems = task.problems("test", config.eval_problems, seed=seed)
    check_fits([encode_prompt(tokenizer, p.prompt) for p in eval_problems], max_new_tokens, context_length(model))
    torch.manual_seed(seed)
    reference = None
    if config.kl_coef > 0:  # the frozen base model
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    critic = ValueModel(model).to(device) if config.algo == "ppo" else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0, betas=(0.9, 0.99))
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=config.critic_lr) if critic is not None else None
    task_record = {**OmegaConf.to_container(cfg.task, resolve=True), "base": str(base)}
    generator = torch.Generator(device=device).manual_seed(seed)

    # ---- run bookkeeping (FinetuneLoop, counting iterations), resumed from the newest checkpoint ----
    check_previous_run(cfg, "finetune", RESUME_MAY_CHANGE)
    run = start_run(cfg, "finetune", allow_existing=True)
    schedule = {"steps": config.steps, "log_every": config.log_every, "checkpoint_every": config.checkpoint_every,
                # lm.rl.eval_every=0 evaluates at the start and the end only: one period of the whole run
                "eval_every": config.eval_every or config.steps}
    evaluation = HeldOutEvaluation(cfg, run, model, tokenizer, task, eval_problems)
    loop = FinetuneLoop(schedule, run, evaluation, counter="steps")
    loop.counters["problems_drawn"] = 0  # the position in the training problem stream
    modules, optimizers = {"model": model}, {"optimizer": optimizer}
    if critic is not None:
        modules["critic"], optimizers["critic_optimizer"] = critic, critic_optimizer
    if reference is not None and config.reincarnate_at is not None:  # after the reincarnation the base is another model
        modules["reference"] = reference
    # ReMix: reincarnation before the iteration after reincarnate_at; on-policy from it on
    reincarnation_step = None if config.reincarnate_at is None else config.reincarnate_at + 1
    history: list[dict[str, Any]] = []  # ReMix: the previous iterations' batches that the next update replays

    def write_model(directory: Path) -> None:  # a checkpoint's (and checkpoints/best's) files
        save_model(directory, model, tokenizer, {**task_record, "step": loop.step})

    saved = loop.resume(modules, optimizers, write_model)
    window: list[dict[str, float]] = []  # the iterations' metrics since the last row, averaged into it
    if saved is not None:
        print(f"resuming from {loop.resumed_from}")
        generator.set_state(saved["generator"])
        window = saved["window"]
        history = [{**batch, "samples": Samples(**batch["samples"])} for batch in saved.get("history", [])]
    stream = rl_problem_stream(task, seed)
    for _ in range(loop.counters["problems_drawn"]):  # the problems earlier iterations drew
        next(stream)

    def draw(count: int) -> list[Any]:
        loop.counters["problems_drawn"] += count
        return [next(stream) for _ in range(count)]

    def loop_state() -> dict[str, Any]:
        replay = [{**batch, "samples": vars(batch["samples"])} for batch in history]
        return {"generator": generator.get_state(), "window": window, "history": replay}

    start = time.perf_counter()
    try:
        loop.start(f"finetune {config.algo}")
        while loop.step < loop.total:
            loop.advance(1)  # counted before the update, so a divergence in it names this iteration's step
            # scaf_grpo: hints only after its guidance-exemption period (the first hint_after of the run)
            hints = config.algo == "scaf_grpo" and loop.step > config.hint_after * config.steps
            if loop.step == reincarnation_step:  # ReMix: the current model becomes the base; on-policy from here
                if reference is not None:
                    reference.load_state_dict(model.state_dict())
                history.clear()
            reuse = 1 if reincarnation_step is not None and loop.step >= reincarnation_step else config.reuse_iterations
            metrics = iteration(config, model, tokenizer, task, draw, reference, critic, optimizer, critic_optimizer,
                                generator, max_new_tokens, loop.check_finite, hints, history, reuse)
            loop.bar.set_postfix(reward=f"{metrics['train/reward']:.3f}")
            window.append(metrics)
            if loop.log(window_mean(window), force=loop.step == loop.total):
                window = []
            loop.boundary(loop_state)
        result = loop.finish(loop_state)
        train_s = time.perf_counter() - start
        write_rl_report(run, task.name, config.algo, evaluation.before, loop.evaluator.last_info)
    finally:
        run.close()

    headline: dict[str, Any] = {"task": task.name, "algo": config.algo, "steps": loop.step}
    headline["pass@1"] = before_after(result["pass@1"], start_rate(run.read_metrics(), "eval/pass@1"))
    if loop.best is not None:
        best = loop.best
        headline["best"] = f"{rate_with_interval(best['pass@1'], best['pass@1_ci95'])} at step {best['step']}"
    headline["train_s"] = train_s
    headline["checkpoint"] = result["checkpoint"]
    if "best_checkpoint" in result:
        headline["best_checkpoint"] = result["best_checkpoint"]
    return headline, run.path


class HeldOutEvaluation:
    """What FinetuneLoop's evaluations run (the robot runs' `EnvEvaluation` contract): greedy
    pass@1 on `lm.rl.eval_problems` held-out problems, the same ones every time."""

    def __init__(self, cfg: DictConfig, run: Any, model: Any, tokenizer: Any, task: Any, problems: list[Any]):
        self.cfg, self.run, self.task, self.problems = cfg, run, task, problems
        self.model, self.tokenizer = model, tokenizer
        self.before: dict[str, Any] | None = None  # the step-0 evaluation (a fresh run's), for the report

    def __call__(self, step: int) -> tuple[dict[str, Any], dict[str, float]]:
        from embodied_rl.lm.evaluate import evaluate_model, format_overall

        cfg = self.cfg
        info = evaluate_model(self.model, self.tokenizer, self.task, self.problems,
                              max_new_tokens=int(cfg.task.max_new_tokens), batch_size=int(cfg.lm.batch_size),
                              seed=int(cfg.seed), show=int(cfg.lm.show))
        overall = info["overall"]
        if step == 0:
            self.before = info
            print(f"before: {format_overall(overall)}")
        low, high = overall["pass@1_ci95"]
        metrics = {"eval/pass@1": overall["pass@1"], "eval/pass@1_low": low, "eval/pass@1_high": high,
                   "eval/mean_length": overall["mean_length"]}
        # the checkpoint holding the weights scored, where one was written at this step (the final
        # evaluation comes after the run's last checkpoint)
        checkpoint = self.run.file("checkpoints", str(step))
        saved = {"checkpoint": str(checkpoint.resolve())} if checkpoint.is_dir() else {}
        return {"task": self.task.name, **saved, "seed": int(cfg.seed), "device": str(cfg.device), **info,
                "config": OmegaConf.to_container(cfg, resolve=True)}, metrics

    def record(self, info: dict[str, Any]) -> dict[str, Any]:
        """best.json: `eval lm.problems=<problems> seed=<seed>` scores the same problems again."""
        overall = info["overall"]
        return {"pass@1": overall["pass@1"], "pass@1_ci95": overall["pass@1_ci95"], "problems": overall["n_problems"],
                "seed": int(self.cfg.seed)}

    def headline(self, info: dict[str, Any]) -> dict[str, Any]:
        from embodied_rl.lm.evaluate import pass1_text

        return {"pass@1": pass1_text(info["overall"])}

    def close(self) -> None:
        pass


def window_mean(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the rows that have it."""
    keys = sorted({key for row in rows for key in row})
    return {key: sum(row[key] for row in rows if key in row) / sum(key in row for row in rows) for key in keys}


def iteration(config: RLConfig, model: Any, tokenizer: Any, task: Any, draw: Any, reference: Any, critic: Any,
              optimizer: Any, critic_optimizer: Any, generator: torch.Generator, max_new_tokens: int,
              check_finite: Any, hints: bool = False, history: list[dict[str, Any]] | None = None,
              reuse: int = 1) -> dict[str, float]:
    """Sample, score, compute advantages and update once; returns the iteration's metrics. The
    loss and the gradient norm go through `check_finite(quantity, value)` (FinetuneLoop's: a
    non-finite one stops the run) before the update. `hints`: scaffold the groups that all
    failed (scaf_grpo after its exemption period). ReMix (`reuse` > 1): the update also trains
    on the batches in `history` (the previous iterations', as they were sampled), and this
    iteration's batch joins `history`, which keeps the last `reuse - 1`."""
    start = time.perf_counter()
    group_size = config.group_size
    batches, scores, kept_problems = [], [], []
    drawn_groups, kept_groups, all_scores = 0, 0, []
    model.eval()
    for _round in range(1 + (config.max_refills if config.dynamic_sampling else 0)):
        wanted = config.prompts - kept_groups
        problems = draw(wanted)
        prompts = [encode_prompt(tokenizer, p.prompt) for p in problems for _ in range(group_size)]
        ids, mask = left_pad(prompts, tokenizer.pad_token_id)
        samples = sample(model, ids, mask, max_new_tokens=max_new_tokens, eos_id=tokenizer.eos_token_id,
                         pad_id=tokenizer.pad_token_id, temperature=config.temperature, generator=generator)
        texts = decode_completions(tokenizer, samples)
        round_scores = torch.tensor([task.reward(problems[i // group_size], text) for i, text in enumerate(texts)],
                                    dtype=torch.float32, device=samples.completion_ids.device)
        drawn_groups += len(problems)
        all_scores.append(round_scores)
        keep = torch.ones(len(problems), dtype=torch.bool, device=round_scores.device)
        if config.dynamic_sampling:
            keep = informative_groups(round_scores, group_size)
        rows = keep.repeat_interleave(group_size)
        if keep.any():
            batches.append(select(samples, rows))
            scores.append(round_scores[rows])
            kept_problems += [p for p, k in zip(problems, keep.tolist()) if k]
            kept_groups += int(keep.sum())
        if kept_groups >= config.prompts:
            break
    every_score = torch.cat(all_scores)
    metrics = {"train/reward": float(every_score.mean()), "train/groups_sampled": float(drawn_groups)}
    if not batches:  # dynamic sampling found no group with a learning signal
        metrics["train/updated"] = 0.0
        return metrics
    samples = concat(batches, tokenizer.pad_token_id)
    score = torch.cat(scores)
    if hints:
        samples, score, hint_metrics = scaffold(config, model, tokenizer, task, kept_problems, samples, score,
                                                generator, max_new_tokens)
        metrics.update(hint_metrics)
    mask = samples.completion_mask.bool()
    valid = mask.float()
    group_ids = torch.arange(kept_groups, device=score.device).repeat_interleave(group_size)

    # ---- old log-probs with the current weights, the reference's, the values ----
    with torch.no_grad():
        old_logp = completion_logprobs(model, samples, temperature=config.temperature)["logp"]
        ref_logp = (completion_logprobs(reference, samples, temperature=config.temperature)["logp"]
                    if reference is not None else None)
        values = critic(samples) if critic is not None else None
    token_rewards = last_token_rewards(score, mask)
    if ref_logp is not None and config.kl_in_reward:
        token_rewards = token_rewards - config.kl_coef * core.kl_penalty(old_logp, ref_logp, config.kl_kind) * valid
    advantages, returns = compute_advantages(config, token_rewards, mask, group_ids, values)
    metrics["train/completions"] = float(score.shape[0])
    history = [] if history is None else history
    replayed = history[len(history) - (reuse - 1):] if reuse > 1 else []
    history.append({"samples": samples, "old_logp": old_logp, "advantages": advantages, "returns": returns,
                    "values": values})
    del history[:len(history) - (reuse - 1)]
    # ReMix: the update's batch is this iteration's completions and the replayed ones, each row with
    # the log-probs of the policy that sampled it (behaviour) and of the weights before this update
    # (precedent); this iteration's rows have the two equal
    behaviour, precedent, train_ref_logp = old_logp, old_logp, ref_logp
    if replayed:
        parts = history[-1:] + replayed
        samples = concat([part["samples"] for part in parts], tokenizer.pad_token_id)
        width = samples.completion_ids.shape[1]

        def stack(key: str) -> torch.Tensor | None:
            if parts[0][key] is None:
                return None
            return torch.cat([torch.nn.functional.pad(part[key], (0, width - part[key].shape[1])) for part in parts])

        behaviour, advantages, returns, values = stack("old_logp"), stack("advantages"), stack("returns"), stack("values")
        mask = samples.completion_mask.bool()
        fresh = score.shape[0]
        # the replayed rows' log-probs under the current weights and the base; this iteration's are known
        with torch.no_grad():
            older = select(samples, torch.arange(fresh, mask.shape[0], device=mask.device))
            precedent = torch.cat([behaviour[:fresh], completion_logprobs(model, older, temperature=config.temperature)["logp"]])
            if reference is not None:
                train_ref_logp = torch.cat([
                    torch.nn.functional.pad(ref_logp, (0, width - ref_logp.shape[1])),
                    completion_logprobs(reference, older, temperature=config.temperature)["logp"]])
        metrics["train/replayed_completions"] = float(mask.shape[0] - fresh)

    # ---- update ----
    model.train()
    rows = mask.shape[0]
    minibatch = -(-rows // config.minibatches)
    totals: dict[str, list[float]] = {}
    first_ratio_deviation = None
    for _epoch in range(config.update_epochs):
        order = torch.randperm(rows, generator=generator, device=generator.device).to(mask.device)
        if config.minibatches == 1:
            order = torch.arange(rows, device=mask.device)  # one minibatch: the rows as sampled
        for begin in range(0, rows, minibatch):
            index = order[begin:begin + minibatch]
            part = select(samples, index)
            out = completion_logprobs(model, part, with_entropy=config.ent_coef > 0, temperature=config.temperature)
            part_mask = mask[index]
            if first_ratio_deviation is None:  # against the weights before the update: 1 at the first minibatch
                ratio = torch.exp(out["logp"].detach() - precedent[index])
                first_ratio_deviation = float((ratio - 1).abs().masked_fill(~part_mask, 0).max())
            loss, info = core.policy_loss(out["logp"], behaviour[index], advantages[index], part_mask,
                                          clip_low=config.clip_low, clip_high=config.clip_high,
                                          dual_clip=config.dual_clip, agg=config.loss_agg,
                                          precedent_logp=precedent[index] if replayed else None)
            parts = {"pg_loss": loss.detach(), **info}
            if train_ref_logp is not None and not config.kl_in_reward:
                kl = core.agg_loss(core.kl_penalty(out["logp"], train_ref_logp[index], config.kl_kind), part_mask,
                                   config.loss_agg)
                parts["kl"] = kl.detach()
                if config.kl_convex < 1:  # ReMix's KL-convex constraint: the base and the precedent policy
                    kl_precedent = core.agg_loss(core.kl_penalty(out["logp"], precedent[index], config.kl_kind),
                                                 part_mask, config.loss_agg)
                    kl = config.kl_convex * kl + (1 - config.kl_convex) * kl_precedent
                    parts["kl_precedent"] = kl_precedent.detach()
                loss = loss + config.kl_coef * kl
            if config.ent_coef > 0:
                entropy = core.agg_loss(out["entropy"], part_mask, config.loss_agg)
                loss = loss - config.ent_coef * entropy
                parts["entropy"] = entropy.detach()
            check_finite("train/loss", loss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            parts["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            check_finite("train/grad_norm", parts["grad_norm"])
            optimizer.step()
            if critic is not None:
                value_loss, value_info = core.value_loss(critic(part), values[index], returns[index], part_mask,
                                                         clip=config.value_clip)
                critic_optimizer.zero_grad(set_to_none=True)
                value_loss.backward()
                torch.nn.utils.clip_grad_norm_(critic.parameters(), config.max_grad_norm)
                critic_optimizer.step()
                parts["value_loss"] = value_loss.detach()
                parts["value_clipfrac"] = value_info["clipfrac"]
            for key, value in parts.items():
                totals.setdefault(key, []).append(float(value))
    if ref_logp is not None:
        metrics["train/kl_to_reference"] = float(core.agg_loss(core.kl_penalty(old_logp, ref_logp, "k3"),
                                                               valid.bool(), "token-mean"))
    metrics.update({f"train/{key}": sum(values_) / len(values_) for key, values_ in totals.items()})
    metrics.update({
        "train/updated": 1.0, "train/ratio_dev_first": first_ratio_deviation,
        "train/informative_groups": float(informative_groups(every_score, group_size).float().mean()),
        "train/kept_groups": float(kept_groups), "train/mean_length": float(valid.sum(1).mean()),
        "train/tokens_per_s": float(valid.sum()) / (time.perf_counter() - start),
        "train/iteration_s": time.perf_counter() - start,
    })
    return metrics


def scaffold(config: RLConfig, model: Any, tokenizer: Any, task: Any, problems: list[Any], samples: Samples,
             score: torch.Tensor, generator: torch.Generator,
             max_new_tokens: int) -> tuple[Samples, torch.Tensor, dict[str, float]]:
    """Scaf-GRPO's hint-guided exploration. For every group (consecutive rows of `problems`)
    whose completions all failed: sample `hint_samples` completions under the task's hint of
    tier 1, then of tier 2, ... until one succeeds; it replaces the group's last completion
    (with its hinted prompt, so its log-probs are those of the policy that sampled it) and its
    score. Returns the batch, the scores and the metrics: the share of groups that all failed
    (`train/stuck_groups`), that a hint rescued (`train/hinted_groups`), and the mean tier of
    the rescuing hints (`train/hint_tier`)."""
    group_size = config.group_size
    stuck = [g for g in range(len(problems)) if float(score[g * group_size:(g + 1) * group_size].max()) <= 0]
    rescued: dict[int, tuple[Samples, float, int]] = {}  # group -> (its hinted success, one row; its reward; the tier)
    for tier in range(1, task.hint_tiers + 1):
        waiting = [g for g in stuck if g not in rescued]
        if not waiting:
            break
        prompts = [encode_prompt(tokenizer, task.hinted_prompt(problems[g], tier))
                   for g in waiting for _ in range(config.hint_samples)]
        ids, mask = left_pad(prompts, tokenizer.pad_token_id)
        hinted = sample(model, ids, mask, max_new_tokens=max_new_tokens, eos_id=tokenizer.eos_token_id,
                        pad_id=tokenizer.pad_token_id, temperature=config.temperature, generator=generator)
        for row, text in enumerate(decode_completions(tokenizer, hinted)):
            group = waiting[row // config.hint_samples]
            reward = task.reward(problems[group], text)
            if group not in rescued and reward > 0:
                rescued[group] = (select(hinted, torch.tensor([row], device=hinted.prompt_ids.device)), reward, tier)
    metrics = {"train/stuck_groups": len(stuck) / len(problems), "train/hinted_groups": len(rescued) / len(problems)}
    if not rescued:
        return samples, score, metrics
    metrics["train/hint_tier"] = sum(tier for _, _, tier in rescued.values()) / len(rescued)
    replaced = {(g + 1) * group_size - 1: (success, reward) for g, (success, reward, _) in rescued.items()}
    rows = [replaced[r][0] if r in replaced else select(samples, torch.tensor([r], device=score.device))
            for r in range(len(score))]
    score = score.clone()
    for r, (_, reward) in replaced.items():
        score[r] = reward
    return concat(rows, tokenizer.pad_token_id), score, metrics


def write_rl_report(run: Any, task_name: str, algo: str, before: dict[str, Any] | None, after: dict[str, Any]) -> None:
    from embodied_rl.eval.report import image_link, plot_curve, write_report
    from embodied_rl.lm.evaluate import completions_markdown, format_overall

    rows = run.read_metrics()
    sections = []
    if before is not None:
        sections.append(("Held-out accuracy", f"- before: {format_overall(before['overall'])}\n"
                                              f"- after: {format_overall(after['overall'])}"))
    else:
        sections.append(("Held-out accuracy", f"- after: {format_overall(after['overall'])}"))
    for name, keys, title, bands in (
        ("reward.png", ["train/reward"], "training reward (mean over completions)", None),
        ("pass1.png", ["eval/pass@1"], "held-out pass@1", {"eval/pass@1": ("eval/pass@1_low", "eval/pass@1_high")}),
    ):
        try:
            plot_curve(rows, "step", keys, run.file("plots", name), title=title, bands=bands)
            sections.append((title.capitalize(), image_link(run.file("plots", name), run.path)))
        except ValueError:  # nothing logged for this curve
            pass
    sections.append(("Sample completions", completions_markdown(after["completions"])))
    write_report(run.path, f"RL fine-tuning ({algo}): {task_name}", sections)

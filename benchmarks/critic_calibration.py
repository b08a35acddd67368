"""Is a residual TD3/SAC critic biased? Its Q against the Monte-Carlo returns of its own replay buffer.

A checkpoint of `finetune algo=residual_offpolicy` (save_replay=true, the default) holds the replay:
n-step transitions, one row per env per step, in the order they were collected. Chaining each row's
n-step return with the row n steps later in the same env gives the discounted return the behaviour
actually collected from that (s, a) to the end of its episode (a truncated episode stops at its time
limit). This script reports, on rows whose episode ended inside the buffer:

  checkpoint   the run's own critics (their mean, as the actor reads them) vs those returns
  --refit K    fresh critics fitted for K updates by SARSA on the same rows (the TD target reads the
               behaviour's own next action, so its fixed point is exactly those returns), once per
               `target_min_of` in --target-min-of: the bias each TD target brings by itself

Rewards here are >= 0, so a Q below 0 is the estimator's own error. With a sparse success reward over
long episodes the clipped double-Q minimum compounds at every bootstrap (docs/finetuning.md).

    OMP_NUM_THREADS=1 python benchmarks/critic_calibration.py \\
        --checkpoint runs/vla_libero/td3_transgrip/checkpoints/last --refit 40000

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from embodied_rl.algos.offpolicy import (
    QEnsemble,
    critic_and_target,
    critic_step,
    polyak,
    random_min,
)
from embodied_rl.errors import UserError

BUCKETS = [(0.0, 0.05), (0.05, 0.3), (0.3, 0.6), (0.6, float("inf"))]  # of the Monte-Carlo return


def load_run(checkpoint: Path) -> tuple[dict, dict, dict]:
    """(the run's config, its replay's data in collection order, the learner's state) of a checkpoint
    directory run_dir/checkpoints/<name>."""
    from omegaconf import OmegaConf

    replay_file = checkpoint / "training_state" / "replay.pt"
    config_file = checkpoint.parent.parent / "config.yaml"
    if not replay_file.is_file() or not config_file.is_file():
        raise UserError(f"'{checkpoint}' has no training_state/replay.pt or no ../../config.yaml: give a checkpoint "
                        "of a residual_offpolicy run saved with save_replay=true")
    cfg = OmegaConf.to_container(OmegaConf.load(config_file))
    if cfg.get("algo", {}).get("name") not in ("residual_offpolicy", "residual_sac", "rlpd"):
        raise UserError(f"'{config_file}' is not a residual_offpolicy run (algo.name={cfg.get('algo', {}).get('name')})")
    if int(cfg["algo"]["n_step"]) < 2:
        raise UserError("algo.n_step=1: a truncated row cannot be told from a running one by its discount")
    replay = torch.load(replay_file, weights_only=True)["online"]
    size, pos = int(replay["size"]), int(replay["pos"])
    # a full ring buffer's oldest row is at pos
    data = {key: value.roll(-pos, 0) if size == int(cfg["algo"]["buffer_size"]) else value
            for key, value in replay["data"].items()}
    state = torch.load(checkpoint / "training_state" / "state.pt", weights_only=True)["modules"]["learner"]
    return cfg, data, state


def monte_carlo(reward: torch.Tensor, discount: torch.Tensor, n: int, gamma: float) -> tuple[torch.Tensor, torch.Tensor,
                                                                                               torch.Tensor]:
    """reward, discount: [T, N] n-step rows per step and env. Returns (the discounted return to the
    episode's end [T, N], whether that end is inside the buffer [T, N], whether the row's window
    ran n steps with the episode going on after it [T, N])."""
    steps, envs = reward.shape
    # a window that truncates on its last step has a running window's discount gamma^n; the row of
    # that step tells it: truncated on its own first step, its discount is gamma (n >= 2)
    truncates_here = (discount - gamma).abs() < 1e-6
    running = (discount - gamma**n).abs() < 1e-6
    running[: steps - n + 1] &= ~truncates_here[n - 1:]
    returns = torch.zeros(steps + n, envs)
    known = torch.zeros(steps + n, envs, dtype=torch.bool)
    for t in range(steps - 1, -1, -1):
        returns[t] = reward[t] + torch.where(running[t], discount[t] * returns[t + n], torch.zeros(envs))
        known[t] = ~running[t] | known[t + n]
    return returns[:steps], known[:steps], running


def bias_report(q: torch.Tensor, returns: torch.Tensor) -> dict:
    report = {"q_mean": float(q.mean()), "return_mean": float(returns.mean()),
              "correlation": float(torch.corrcoef(torch.stack([q, returns]))[0, 1]),
              "q_below_zero": float((q < 0).float().mean()), "by_return": {}}
    for low, high in BUCKETS:
        inside = (returns >= low) & (returns < high)
        if inside.any():
            report["by_return"][f"[{low}, {high})"] = {"rows": int(inside.sum()), "q_mean": float(q[inside].mean()),
                                                      "return_mean": float(returns[inside].mean())}
    return report


def show(name: str, report: dict) -> None:
    buckets = ", ".join(f"{key} {value['q_mean']:.3f}" for key, value in report["by_return"].items())
    print(f"{name}: Q {report['q_mean']:.3f} vs return {report['return_mean']:.3f} (corr {report['correlation']:.2f}, "
          f"Q < 0 on {report['q_below_zero']:.0%}); Q by return: {buckets}", flush=True)


def refit(data: dict, rows: torch.Tensor, next_rows: torch.Tensor, running: torch.Tensor, target_min_of: int,
          ensemble: int, hidden: list[int], algo: dict, updates: int, seed: int) -> QEnsemble:
    """SARSA: fresh critics regressed on reward + discount * min over `target_min_of` target critics
    of Q(next obs, next base, the behaviour's next action). A window that ended in truncation
    bootstraps from its final observation with the base action (the behaviour's next one is unknown)."""
    torch.manual_seed(seed)
    input_dim = data["obs"].shape[1] + data["base"].shape[1] + data["action"].shape[1]
    critic, target = critic_and_target(input_dim, hidden, ensemble, torch.device("cpu"))
    optimizer = torch.optim.Adam(critic.parameters(), lr=float(algo["critic_lr"]))
    generator = torch.Generator().manual_seed(seed)
    batch_size = int(algo["batch_size"])
    for _ in range(updates):
        pick = torch.randint(len(rows), (batch_size,), generator=generator)
        row, after, goes_on = rows[pick], next_rows[pick], running[pick, None]
        with torch.no_grad():
            next_obs = torch.where(goes_on, data["obs"][after], data["next_obs"][row])
            next_base = torch.where(goes_on, data["base"][after], data["next_base"][row])
            next_action = torch.where(goes_on, data["action"][after], data["next_base"][row])
            next_q = random_min(target(next_obs, next_base, next_action), target_min_of, generator)
            td_target = data["reward"][row] + data["discount"][row] * next_q
        critic_step(critic, optimizer, td_target, data["obs"][row], data["base"][row], data["action"][row])
        polyak(critic, target, float(algo["tau"]))
    return critic.eval().requires_grad_(False)


def run(args) -> dict:
    from embodied_rl.actors import resolve_checkpoint

    torch.set_num_threads(1)
    checkpoint = resolve_checkpoint(args.checkpoint)
    cfg, data, state = load_run(checkpoint)
    algo, envs = cfg["algo"], int(cfg["num_envs"])
    n, gamma = int(algo["n_step"]), float(algo["gamma"])
    steps = data["reward"].shape[0] // envs
    if steps <= n:
        raise UserError(f"the replay holds {steps} steps of {envs} envs: too few for {n}-step chains")
    data = {key: value[: steps * envs] for key, value in data.items()}
    returns, known, running = monte_carlo(data["reward"].view(steps, envs), data["discount"].view(steps, envs), n, gamma)
    # rows whose return is known (a running window's continuation row is then in the buffer too)
    rows = torch.arange(steps * envs).view(steps, envs)[known]
    next_rows = (rows + n * envs).clamp(max=steps * envs - 1)
    returns, running = returns.reshape(-1), running.reshape(-1)
    generator = torch.Generator().manual_seed(args.seed)
    sample = rows[torch.randperm(len(rows), generator=generator)[: args.rows]]

    ensemble, hidden = int(algo["ensemble"]), list(algo["critic_hidden_sizes"])
    input_dim = data["obs"].shape[1] + data["base"].shape[1] + data["action"].shape[1]
    critic = QEnsemble(input_dim, hidden, ensemble)
    critic.load_state_dict(state["critic"])
    with torch.no_grad():
        q = critic(data["obs"][sample], data["base"][sample], data["action"][sample]).mean(0)
    result = {"checkpoint": str(checkpoint), "rows": len(rows), "sample": len(sample), "n_step": n, "gamma": gamma,
              "target_min_of": int(algo.get("target_min_of", 2)),
              "checkpoint_critics": bias_report(q, returns[sample]), "refit": {}}
    print(f"{len(rows)} rows with a known return ({steps} steps x {envs} envs)")
    show("the run's critics", result["checkpoint_critics"])
    for size in args.target_min_of if args.refit else []:
        if not 1 <= size <= ensemble:
            raise UserError(f"--target-min-of {size}: the run's ensemble has {ensemble} critics")
        started = time.time()
        fitted = refit(data, rows, next_rows, running[rows], size, ensemble, hidden, algo, args.refit, args.seed)
        with torch.no_grad():
            q = fitted(data["obs"][sample], data["base"][sample], data["action"][sample]).mean(0)
        result["refit"][size] = bias_report(q, returns[sample])
        show(f"SARSA refit, target_min_of={size}, {args.refit} updates ({time.time() - started:.0f} s)",
             result["refit"][size])
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a residual_offpolicy checkpoint (or its run directory)")
    parser.add_argument("--refit", type=int, default=0, help="SARSA updates per refit (0: only the run's critics)")
    parser.add_argument("--target-min-of", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--rows", type=int, default=20000, help="rows (drawn at random) the reports average over")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.refit < 0 or args.rows < 1:
        parser.error("--refit must be >= 0 and --rows >= 1")
    return args


if __name__ == "__main__":
    try:
        print(json.dumps(run(parse_args())))
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None

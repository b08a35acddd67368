"""What every off-policy method shares (residual TD3/SAC and RLPD, QC-FQL, SAC Flow; RECAP reads
the demos the same way): each algorithm file keeps only what differs, and imports this.

- `OffPolicyConfig`: the config keys they all have.
- `QEnsemble`: E LayerNorm critics Q(x_1, ..., x_k) -> [E, B] over any inputs (flattened and
  concatenated), and `random_min`, REDQ's TD target over a random few of them; `critic_and_target`
  makes an ensemble and its target network, `critic_step` regresses it on a TD target, and
  `actor_q` is what an actor loss reads of it.
- `Replay`: a circular buffer of transitions (a dict of named tensors) whose storage grows as it
  fills, so a short run does not hold `capacity` rows of memory.
- Demonstrations: `find_demo_path` (algo.data, else the dataset the BC checkpoint recorded),
  `dataset_obs` (a dataset's observations as the env gives them), and its transitions per env
  step (`demo_transitions`, base actions relabelled by the base policy) or per executed chunk
  (`demo_chunk_transitions`).
- `MixedBatches`: every batch `demo_fraction` demos (and the expert's intervened steps), the
  rest from the replay.
- `UpdateBudget`: the update-to-data ratio, `utd_ratio` gradient steps per collected transition,
  the fraction carried over from one collection step to the next.
- `normalised_q`: FQL's Q loss scale. `polyak`: the target networks' soft update.
The n-step returns (residual) and the chunk MDP (algos/chunks.py) stay with their methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from embodied_rl import distributed
from embodied_rl.actors.base import layer_norm_mlp
from embodied_rl.algos.common import AlgoConfig
from embodied_rl.errors import UserError
from embodied_rl.policies.base import Obs
from embodied_rl.policies.runner import index_obs, map_obs

# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OffPolicyConfig(AlgoConfig):
    """The keys every off-policy method here has (residual TD3/SAC and RLPD, QC-FQL, SAC Flow):
    the critic ensemble's, the replay's and the batches'. Each method adds its own, and the
    ranges that differ between them (ensemble, batch_size, demo_fraction)."""

    name: str
    reward: str
    data: str | None  # the demo dataset (None: the one the BC checkpoint recorded)
    ensemble: int
    gamma: float
    tau: float
    actor_lr: float
    critic_lr: float
    batch_size: int
    buffer_size: int
    utd_ratio: float
    demo_fraction: float

    def checks(self) -> list[tuple[str, bool, str]]:
        return [
            ("gamma", 0.0 <= self.gamma <= 1.0, "in [0, 1]"),
            ("tau", 0.0 < self.tau <= 1.0, "in (0, 1]"),
            ("actor_lr", self.actor_lr > 0, "> 0"),
            ("critic_lr", self.critic_lr > 0, "> 0"),
            ("buffer_size", self.buffer_size >= 1, ">= 1"),
            ("utd_ratio", self.utd_ratio > 0, "> 0"),
        ]


# --------------------------------------------------------------------------------------------
# Critics
# --------------------------------------------------------------------------------------------


class QEnsemble(nn.Module):
    """E LayerNorm critics over the concatenation of their flattened inputs -> [E, B]."""

    def __init__(self, input_dim: int, hidden_sizes: list[int], ensemble: int):
        super().__init__()
        self.critics = nn.ModuleList(layer_norm_mlp(input_dim, 1, list(hidden_sizes)) for _ in range(ensemble))

    def forward(self, *inputs: Tensor) -> Tensor:
        x = torch.cat([part.flatten(1) for part in inputs], dim=-1)
        return torch.stack([q(x).squeeze(-1) for q in self.critics])


def critic_and_target(input_dim: int, hidden_sizes: list[int], ensemble: int,
                      device: torch.device) -> tuple[QEnsemble, QEnsemble]:
    """A QEnsemble and its target network: a copy without gradients that `polyak` moves."""
    critic = QEnsemble(input_dim, hidden_sizes, ensemble).to(device)
    target = QEnsemble(input_dim, hidden_sizes, ensemble).to(device)
    target.load_state_dict(critic.state_dict())
    target.requires_grad_(False)
    return critic, target


def critic_step(critic: QEnsemble, optimizer: torch.optim.Optimizer, target: Tensor,
                *inputs: Tensor) -> tuple[Tensor, Tensor]:
    """One gradient step of every critic toward the TD target [B]: the squared error, averaged
    over the batch and summed over the ensemble (gradients averaged across ranks under torchrun).
    Returns (the loss, Q [E, B])."""
    q = critic(*inputs)
    loss = ((q - target[None]) ** 2).mean(1).sum()
    optimizer.zero_grad()
    loss.backward()
    distributed.average_gradients(critic.parameters())
    optimizer.step()
    return loss, q


def actor_q(critic: QEnsemble, *inputs: Tensor, reduce: str = "mean") -> Tensor:
    """The ensemble's Q [B] for an actor loss, its mean or (`reduce="min"`) its minimum: the
    gradient reaches the actions (dQ/da), not the critics' weights."""
    critic.requires_grad_(False)
    q_values = critic(*inputs)
    q = q_values.min(0).values if reduce == "min" else q_values.mean(0)
    critic.requires_grad_(True)
    return q


def random_min(q_values: Tensor, size: int = 2, generator: torch.Generator | None = None) -> Tensor:
    """[E, B] ensemble values -> [B]: the minimum over `size` distinct critics drawn at random,
    one draw per batch (REDQ's and RLPD's num_min_qs: 2 is clipped double Q over a random pair;
    1 takes one random critic, no minimum)."""
    subset = torch.randperm(q_values.shape[0], generator=generator)[:size].to(q_values.device)
    return q_values[subset].min(0).values


def normalised_q(q: Tensor) -> Tensor:
    """Q in units of the batch's mean |Q| (FQL's normalize_q_loss), so that the weights of an
    actor's other terms mean the same whatever the reward scale; the scale carries no gradient."""
    return q / q.abs().mean().detach().clamp(min=1e-6)


@torch.no_grad()
def polyak(source: nn.Module, target: nn.Module, tau: float) -> None:
    """target <- (1 - tau) target + tau source."""
    torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), tau)


# --------------------------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------------------------


class Replay:
    """A circular buffer of transitions, each a dict of tensors with these `shapes` per row (torch
    tensors on one device), holding at most `capacity`. Its storage grows (doubling) as it fills."""

    def __init__(self, capacity: int, shapes: dict[str, tuple[int, ...]], device: torch.device):
        self.shapes = {key: tuple(shape) for key, shape in shapes.items()}
        self.capacity, self.size, self.pos, self.device = int(capacity), 0, 0, device
        self.data: dict[str, Tensor] = {}
        self._reserve(min(self.capacity, 1024))

    def _reserve(self, rows: int) -> None:
        """Storage for at least `rows` transitions (at most `capacity`)."""
        held = len(next(iter(self.data.values()))) if self.data else 0
        if rows <= held:
            return
        rows = min(self.capacity, max(rows, 2 * held))
        grown = {key: torch.zeros((rows, *shape), device=self.device) for key, shape in self.shapes.items()}
        for key, value in self.data.items():
            grown[key][:held] = value
        self.data = grown

    def add(self, batch: dict[str, Tensor]) -> None:
        n = len(next(iter(batch.values())))
        self._reserve(min(self.pos + n, self.capacity))  # the buffer wraps only once it is full
        idx = (self.pos + torch.arange(n)) % self.capacity
        for key in self.shapes:
            self.data[key][idx.to(self.data[key].device)] = batch[key].to(self.data[key])
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, n: int, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        return self.rows(torch.randint(0, self.size, (n,), generator=generator))

    def rows(self, idx: Tensor) -> dict[str, Tensor]:
        """The transitions at positions `idx` (< size)."""
        return {k: v[idx.to(v.device)] for k, v in self.data.items()}

    def state_dict(self) -> dict[str, Any]:
        """The filled part of the buffer and its write position (what a checkpoint saves)."""
        return {"data": {k: v[: self.size].cpu() for k, v in self.data.items()},
                "pos": torch.tensor(self.pos), "size": torch.tensor(self.size)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        size = int(state["size"])
        if size > self.capacity:
            raise UserError(f"the saved replay buffer holds {size} transitions, more than algo.buffer_size={self.capacity}")
        self._reserve(size)
        for key, value in state["data"].items():
            self.data[key][:size] = value.to(self.data[key])
        self.pos, self.size = int(state["pos"]) % self.capacity, size


class MixedBatches:
    """Batches of `batch_size` transitions: `demo_fraction` of them drawn uniformly from the demos
    and the `expert` replay (the steps an expert drove) together, the rest from `replay`. While
    `replay` is empty (offline pre-training), or where there are no demos, one source fills the
    batch. Each source draws from its own generator (None: torch's global one)."""

    def __init__(self, replay: Replay, demos: dict[str, Tensor] | None, batch_size: int, demo_fraction: float,
                 replay_generator: torch.Generator | None, demo_generator: torch.Generator,
                 expert: Replay | None = None):
        self.replay, self.demos, self.expert = replay, demos, expert
        self.batch_size = int(batch_size)
        self.demo_batch = int(round(batch_size * demo_fraction))
        self.replay_generator, self.demo_generator = replay_generator, demo_generator

    def offline_rows(self) -> int:
        return len(next(iter(self.demos.values()))) if self.demos is not None else 0

    def expert_rows(self) -> int:
        return self.expert.size if self.expert is not None else 0

    def sample(self) -> dict[str, Tensor]:
        demo_count = self.demo_batch if self.offline_rows() + self.expert_rows() > 0 else 0
        online = self.batch_size - demo_count if self.replay.size > 0 else 0
        parts = [self.replay.sample(online, self.replay_generator)] if online else []
        if self.batch_size - online:
            parts += self.sample_demos(self.batch_size - online)
        return {key: torch.cat([part[key] for part in parts]) for key in self.replay.shapes}

    def sample_demos(self, n: int) -> list[dict[str, Tensor]]:
        """n transitions drawn uniformly from the demos and the expert's steps together."""
        offline = self.offline_rows()
        idx = torch.randint(0, offline + self.expert_rows(), (n,), generator=self.demo_generator)
        parts = []
        if offline:
            parts.append({k: v[idx[idx < offline].to(v.device)] for k, v in self.demos.items()})
        if self.expert_rows():
            parts.append(self.expert.rows(idx[idx >= offline] - offline))
        return parts


class UpdateBudget:
    """The update-to-data ratio: `add(transitions)` earns utd_ratio gradient steps per collected
    transition, `take()` spends one while a whole one is left; the fraction carries over."""

    def __init__(self, utd_ratio: float):
        self.utd_ratio, self.pending = float(utd_ratio), 0.0

    def add(self, transitions: int) -> None:
        self.pending += self.utd_ratio * transitions

    def take(self) -> bool:
        if self.pending < 1:
            return False
        self.pending -= 1
        return True

    def state_dict(self) -> Tensor:
        return torch.tensor(self.pending)

    def load_state_dict(self, state: Tensor) -> None:
        self.pending = float(state)


# --------------------------------------------------------------------------------------------
# Demonstrations
# --------------------------------------------------------------------------------------------


def find_demo_path(cfg: Any) -> Path | None:
    """algo.data, else the data path the BC checkpoint recorded (config.json "extra")."""
    explicit = cfg.algo.get("data")
    if explicit:
        path = Path(explicit)
        if not path.exists():
            raise UserError(f"algo.data '{path}' does not exist")
        return path
    if not cfg.get("checkpoint"):
        return None
    from embodied_rl.policies import read_config

    checkpoint = Path(cfg.checkpoint)
    for candidate in (checkpoint, checkpoint / "checkpoints" / "last", checkpoint / "base_policy"):
        if (candidate / "config.json").exists():
            try:
                extra = read_config(candidate).get("extra", {}) or {}
            except Exception:
                continue
            for key in ("data", "data_path", "dataset"):
                if extra.get(key) and Path(extra[key]).exists():
                    return Path(extra[key])
    return None


def demo_action_dims(cfg: Any, action_dim: int) -> list[float]:
    """Per action dim, 1 where the demonstrations (`find_demo_path`) move it, 0 where every demo
    step holds it at one value; all 1 without demonstrations at hand.
    Why: a dim the demonstrations never vary (Meta-World reach's gripper, for one) is one the base
    policy was never shown varied; exploration noise there takes it off what it learned (reach's
    BC with the residual's noise on all four dims: .48 success; on the three it moves: .95)."""
    path = find_demo_path(cfg)
    if path is None:
        return [1.0] * action_dim
    from embodied_rl.data.dataset import read_actions

    actions = read_actions(path)
    if actions.shape[1] != action_dim:
        raise UserError(f"demo dataset '{path}' has {actions.shape[1]} action dims, the env {action_dim}")
    return (actions.std(0) > 1e-6).astype(float).tolist()


def load_demos(cfg: Any, env: Any) -> tuple[Any, bool]:
    """(the demo dataset of `find_demo_path`, whether the task's episodes end at success), or
    (None, ...) when there is none."""
    from embodied_rl.data.dataset import DemoDataset

    path = find_demo_path(cfg)
    success_terminates = bool(getattr(getattr(env, "task", None), "success_terminates", True))
    return (DemoDataset.load(path) if path is not None else None), success_terminates


def dataset_obs(dataset: Any, policy: Any) -> Obs:
    """Every step's observation of a demo dataset as the env gives it to `policy`: the state
    tensor [T, D], or a dict with the pixels and instruction ids where the policy reads them."""
    state = torch.as_tensor(np.asarray(dataset.obs), dtype=torch.float32)
    entries: dict[str, Tensor] = {}
    if policy.obs_mode == "pixels":
        if dataset.pixels is None:
            raise UserError(f"the base policy reads pixels but the demo dataset '{dataset.path}' has none")
        entries["pixels"] = torch.from_numpy(np.asarray(dataset.pixels))
    if policy.instructions:
        if dataset.instruction is None:
            raise UserError(f"the base policy reads instructions but the demo dataset '{dataset.path}' has none")
        entries["instruction"] = torch.as_tensor(np.asarray(dataset.instruction), dtype=torch.long)
    return {"state": state, **entries} if entries else state


STEP_FIELDS = ("obs", "base", "action", "reward", "discount", "next_obs", "next_base")


def demo_transitions(dataset: Any, policy: Any, gamma: float, success_terminates: bool, device: torch.device,
                     sparse: bool = False) -> dict[str, Tensor]:
    """1-step transitions (STEP_FIELDS) of a demo dataset; base actions relabelled by running the
    base policy's queue over each episode (replanning every n_action_steps from the episode's
    start, as online). The last step of a successful episode is terminal when the task ends on
    success; the last step of any other episode has no next observation and is dropped.
    `sparse`: the reward is 1 on the last step of a successful episode, else 0 (the online
    `algo.reward=success`)."""
    obs_all = dataset_obs(dataset, policy)
    act_all = torch.as_tensor(np.asarray(dataset.action), dtype=torch.float32)
    rew_all = torch.as_tensor(np.asarray(dataset.reward), dtype=torch.float32)
    successes = np.asarray(dataset.episode_success, dtype=bool) if hasattr(dataset, "episode_success") else None
    to, ha = int(policy.n_obs_steps), int(policy.n_action_steps)
    start_index = to - 1
    out: dict[str, list[Tensor]] = {k: [] for k in STEP_FIELDS}
    for episode in range(dataset.num_episodes):
        start, end = dataset.episode_bounds(episode)
        obs, act, rew = index_obs(obs_all, slice(start, end)), act_all[start:end], rew_all[start:end]
        length = end - start
        anchors = torch.arange(0, length, ha)
        window = (anchors[:, None] - torch.arange(to - 1, -1, -1)[None]).clamp(min=0)  # history indices
        with torch.no_grad():
            device_p = next(policy.parameters()).device
            history = map_obs(lambda o, rows=window, device=device_p: o[rows].to(device), obs)
            chunks = policy.predict_chunk(history, generator=torch.Generator(device=device_p).manual_seed(episode))
        base = chunks[:, start_index : start_index + ha].reshape(-1, act.shape[-1])[:length].float().cpu()
        terminal = bool(successes[episode]) and success_terminates if successes is not None else False
        if sparse:
            rew = torch.zeros(length)
            if successes is not None and bool(successes[episode]):
                rew[-1] = 1.0
        last = length if terminal else length - 1
        if last <= 0:
            continue
        nxt = torch.arange(1, last + 1).clamp(max=length - 1)
        discount = torch.full((last,), gamma)
        if terminal:
            discount[-1] = 0.0
        for key, value in (("obs", index_obs(obs, slice(0, last))), ("base", base[:last]), ("action", act[:last]),
                           ("reward", rew[:last]), ("discount", discount), ("next_obs", index_obs(obs, nxt)),
                           ("next_base", base[nxt])):
            out[key].append(value)
    if not out["obs"]:
        raise UserError("the demo dataset has no usable transitions (episodes of length 1?)")
    return {k: map_obs(lambda *parts: torch.cat(parts).to(device), *v) for k, v in out.items()}


CHUNK_FIELDS = ("cond", "chunk", "reward", "discount", "next_cond")


@torch.no_grad()
def demo_chunk_transitions(dataset: Any, policy: Any, gamma: float, success_terminates: bool, sparse: bool,
                           device: torch.device) -> dict[str, Tensor]:
    """Chunk transitions (CHUNK_FIELDS) of a demo dataset, with the chunk in the policy's
    normalised action space and the obs histories encoded by the frozen policy. They start at
    every step t of an episode whose next h actions are in the episode (a successful episode's
    last chunks end at its terminal step, padded with its last action)."""
    obs_all = dataset_obs(dataset, policy)
    actions = torch.as_tensor(np.asarray(dataset.action), dtype=torch.float32)
    rewards = torch.as_tensor(np.asarray(dataset.reward), dtype=torch.float32)
    successes = np.asarray(dataset.episode_success, dtype=bool)
    to, h = int(policy.n_obs_steps), int(policy.n_action_steps)
    out: dict[str, list[Tensor]] = {k: [] for k in CHUNK_FIELDS}
    for episode in range(dataset.num_episodes):
        start, end = dataset.episode_bounds(episode)
        length = end - start
        terminal = bool(successes[episode]) and success_terminates
        reward = torch.zeros(length) if sparse else rewards[start:end]
        if sparse and bool(successes[episode]):
            reward[-1] = 1.0
        # a chunk may run past the end only where the episode ended in a terminal state
        starts = torch.arange(length if terminal else length - h)
        if len(starts) == 0:
            continue
        steps = starts[:, None] + torch.arange(h)[None]                      # [n, h]
        inside = steps < length
        clipped = steps.clamp(max=length - 1)
        chunk = actions[start:end][clipped]                                  # the last action pads
        chunk_reward = (reward[clipped] * inside).sum(1)
        ended = ~inside.all(1) | (terminal & (steps[:, -1] == length - 1))
        discount = torch.where(ended, torch.zeros(len(starts)), torch.full((len(starts),), gamma ** h))

        def history(at: Tensor, first: int = start) -> Any:  # the obs histories ending at steps `at`
            rows = (at[:, None] - torch.arange(to - 1, -1, -1)[None]).clamp(min=0) + first
            return map_obs(lambda o: o[rows].to(policy.device), obs_all)

        out["cond"].append(policy.encode_obs(history(starts)).to(device))
        out["next_cond"].append(policy.encode_obs(history((starts + h).clamp(max=length - 1))).to(device))
        out["chunk"].append(policy.normalize_action(chunk.to(policy.device)).clamp(-1, 1).to(device))
        out["reward"].append(chunk_reward.to(device))
        out["discount"].append(discount.to(device))
    if not out["cond"]:
        raise UserError(f"the demo dataset has no episode longer than a chunk ({h} steps)")
    return {k: torch.cat(v) for k, v in out.items()}


def restore_generators(saved: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    for name, generator in generators.items():
        generator.set_state(saved[name])

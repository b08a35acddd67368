"""`embodied-rl eval task=T checkpoint=DIR episodes=N videos=V seed=S`

Loads a policy checkpoint (BC-pretrained or RL-finetuned: `load_policy` tells them apart), runs
it on `min(num_envs, episodes)` parallel envs through the agent protocol, and writes
`<run_dir>/eval_info.json` and `<run_dir>/videos/episode_<k>.mp4`. Without `task=`, the task
recorded in the checkpoint is used; a `task=` that differs from it is an error, unless it is a
task of the checkpoint's suite (below).

`checkpoint=RUN_DIR` (a pretrain or finetune run) takes its checkpoints/last, the newest;
`checkpoint=RUN_DIR/checkpoints/best` a finetune run's best periodic evaluation. The headline's
`checkpoint` line names the one taken and, for a fine-tuned one, its env step.

`task=<suite>/<task>` runs a checkpoint trained on a suite on one of its tasks (a
libero/libero_spatial checkpoint on libero/libero_spatial/4, all its episodes on that task): the
task's instructions must all be among the policy's, and each env's instruction id is translated to
the policy's id of the same text.

`instruction="any English sentence"` (a vla checkpoint) makes the policy read that instruction in
every env instead of the env's own, encoded on the fly by the policy's text encoder: language
ablations and paraphrases. Success is still judged on each env's own instruction, which the
per-episode records keep; eval_info.json adds "policy_instruction".

`env_instruction=ID|TEXT` makes every env draw that one of the task's own instructions (an id or
its exact text; MuJoCo backends), so `instruction="a paraphrase" env_instruction="the original"`
scores the typed sentence against the instruction it paraphrases, and the same command without
instruction= gives the original's score on the very same episodes. The headline and
eval_info.json say what was scored against ("scored_against").

`instruction_shuffle=true` (a checkpoint whose policy reads instructions) makes each env's policy
read the instruction another env was given (a seeded random cycle over the envs, drawn every
round): a language ablation on the very episodes of the same eval without it. eval_info.json adds
"instruction_shuffle": true.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from embodied_rl.errors import UserError


def validate(cfg: DictConfig) -> Path:
    """Check the config before any work; return the checkpoint path."""
    from embodied_rl.commands import validate_common

    checkpoint = cfg.get("checkpoint")
    if checkpoint in (None, ""):
        raise UserError("checkpoint=DIR is required (a policy checkpoint directory)")
    validate_common(cfg)
    path = Path(str(checkpoint)).expanduser()
    if not path.exists():
        raise UserError(f"checkpoint '{path}' does not exist")
    instruction = cfg.get("instruction")
    if instruction is not None and (not isinstance(instruction, str) or not instruction.strip()):
        raise UserError(f"instruction must be a non-empty string, got {instruction!r}")
    shuffle = bool(cfg.get("instruction_shuffle"))  # the config types it: true | false (or null)
    if shuffle and instruction is not None:
        raise UserError("instruction= and instruction_shuffle=true exclude each other: pick one")
    if shuffle and min(int(cfg.num_envs), int(cfg.episodes)) < 2:
        raise UserError("instruction_shuffle=true needs at least 2 envs (num_envs and episodes >= 2)")
    return path


class RewritesInstruction:
    """An agent shown other instruction ids than each env's own (`rewrite(ids) -> ids`); the env
    still scores its own."""

    def __init__(self, agent: Any):
        self.agent = agent

    def reset(self, mask: Any) -> None:
        self.agent.reset(mask)

    def seed(self, seed: int) -> None:
        from embodied_rl.eval.evaluate import seed_agent

        seed_agent(self.agent, seed)

    def rewrite(self, ids: Any) -> Any:
        raise NotImplementedError

    def act(self, obs: dict[str, Any]) -> Any:
        return self.agent.act({**obs, "instruction": self.rewrite(obs["instruction"])})


class ReadsInstruction(RewritesInstruction):
    """An agent shown instruction id `instruction` in every env in place of the env's own."""

    def __init__(self, agent: Any, instruction: int):
        super().__init__(agent)
        self.instruction = int(instruction)

    def rewrite(self, ids: Any) -> Any:
        return ids.clone().fill_(self.instruction)


class TranslatesInstructions(RewritesInstruction):
    """An agent on a task of the suite its policy was trained on (eval task=<suite>/<task>): the
    env's instruction id i becomes the policy's id `ids[i]` of the same text before it acts."""

    def __init__(self, agent: Any, ids: list[int]):
        import torch

        super().__init__(agent)
        self.ids = torch.tensor(ids)

    def rewrite(self, ids: Any) -> Any:
        return self.ids.to(ids.device)[ids]


def read_instruction(agent: Any, text: str) -> ReadsInstruction:
    """`agent`, made to read `text`: every vla policy it holds appends the text's embedding."""
    from torch import nn

    from embodied_rl.policies import VLAPolicy

    modules = [value for value in vars(agent).values() if isinstance(value, nn.Module)]
    policies = {id(m): m for module in modules for m in module.modules() if isinstance(m, VLAPolicy)}
    if not policies:
        raise UserError("instruction= needs a vla checkpoint (its policy encodes new instructions)")
    ids = {policy.add_instruction(text) for policy in policies.values()}
    return ReadsInstruction(agent, ids.pop())


class ShufflesInstructions:
    """An agent whose policy, in each env, reads the instruction another env was given; the env
    still scores its own. Every round (`seed`, which evaluate calls with the round's seed) draws a
    random cycle over the envs, so no env is its own partner; an env that starts an episode reads
    its partner's instruction at that first step until the episode ends. The counted episodes all
    start together, at the round's reset, so they read a permutation of the round's instructions."""

    def __init__(self, agent: Any, num_envs: int):
        import torch

        self.agent = agent
        self.generator = torch.Generator().manual_seed(0)
        self.partner = torch.arange(num_envs).roll(1)  # replaced by a random cycle at every seed()
        self.starting = torch.ones(num_envs, dtype=torch.bool)  # envs whose next step starts an episode
        self.read: Any = None  # [N] the instruction id each env's policy reads in its episode

    def seed(self, seed: int) -> None:
        import torch

        from embodied_rl.eval.evaluate import seed_agent

        self.generator.manual_seed(seed)
        order = torch.randperm(len(self.partner), generator=self.generator)
        self.partner[order] = order.roll(-1)  # one cycle through every env: order[k] reads order[k + 1]
        seed_agent(self.agent, seed)

    def reset(self, mask: Any) -> None:
        self.starting |= mask.cpu()
        self.agent.reset(mask)

    def act(self, obs: dict[str, Any]) -> Any:
        import torch

        own = obs["instruction"]
        partners = own[self.partner.to(own.device)]
        starting = self.starting.to(own.device)
        self.read = partners.clone() if self.read is None else torch.where(starting, partners, self.read)
        self.starting[:] = False
        return self.agent.act({**obs, "instruction": self.read.clone()})


def shuffle_instructions(agent: Any, policy: Any, num_envs: int) -> ShufflesInstructions:
    """`agent`, made to read shuffled instructions; refused for a policy that reads none."""
    if not getattr(policy, "instructions", None):
        raise UserError("instruction_shuffle=true needs a checkpoint whose policy reads instructions "
                        f"(a language-conditioned policy such as vla); this {policy.policy_type} policy reads none")
    return ShufflesInstructions(agent, num_envs)


def write_eval_report(run_dir: Path, eval_info: dict[str, Any]) -> Path:
    """report.md: the result table, the videos and how the run was made."""
    from embodied_rl.eval.report import run_section, success_table, video_links, write_report

    return write_report(run_dir, f"Evaluation: {eval_info['task']}", [
        ("Result", success_table({f"`{eval_info['checkpoint']}`": eval_info["overall"]})),
        ("Videos", video_links(eval_info, run_dir)),
        ("Run", run_section(eval_s=eval_info["overall"]["eval_s"])),
    ])


def env_instruction_id(cfg: DictConfig, instructions: list[str]) -> int | None:
    """The id of `env_instruction=` (an id or the exact text of one of the task's instructions)."""
    value = cfg.get("env_instruction")
    if value is None:
        return None
    if not instructions:
        raise UserError("env_instruction= needs a task with instructions")
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(instructions):
        return value
    if isinstance(value, str) and value in instructions:
        return instructions.index(value)
    raise UserError(f"env_instruction must be an id in [0, {len(instructions)}) or one of the task's instructions "
                    f"({'; '.join(repr(text) for text in instructions[:4])}{', ...' if len(instructions) > 4 else ''}), "
                    f"got {value!r}")


def main(cfg: DictConfig) -> tuple[dict[str, Any], Path]:
    from embodied_rl.lm import is_lm_task, refuse_lm_checkpoint

    if is_lm_task(cfg):  # task=lm/<name>: a language model (embodied_rl/lm)
        from embodied_rl.lm import evaluate

        return evaluate.main(cfg)
    refuse_lm_checkpoint(cfg)
    from embodied_rl.algos.common import saved_env_step
    from embodied_rl.commands import instruction_ids, load_checkpoint_agent
    from embodied_rl.runs import start_run

    episodes = int(cfg.episodes)
    # The default (videos unset) records up to 4 episodes, never more than are run.
    videos = min(4, episodes) if cfg.videos is None else int(cfg.videos)
    num_envs = min(int(cfg.num_envs), episodes)
    # without task=, the checkpoint's own task; a run directory stands for its checkpoints/last
    checkpoint, policy, agent, task = load_checkpoint_agent(
        validate(cfg), num_envs, str(cfg.device), OmegaConf.select(cfg, "task.name", default=None), member=True)
    step = saved_env_step(checkpoint)
    taken = str(checkpoint) if step is None else f"{checkpoint} (env step {step})"  # the headline says which

    import embodied_rl.envs as envs
    from embodied_rl.eval.evaluate import evaluate, success_text

    options = policy.env_options()  # the env renders what the policy was trained on
    # task= given: its config's overrides (task.max_episode_steps=N, ...); else the task as it is
    task_options = envs.task_overrides(cfg.task) if OmegaConf.select(cfg, "task.name") else {}
    instructions = list(envs.registry.task_class(task).instructions)
    fixed = env_instruction_id(cfg, instructions)
    if fixed is not None:
        task_options["fixed_instruction"] = fixed
    scored_against = (None if not instructions else "each env's own instruction" if fixed is None
                      else f"instruction {fixed}: {instructions[fixed]!r}")
    env = envs.make(
        task, num_envs=num_envs, backend=cfg.backend, device=cfg.device, seed=int(cfg.seed),
        render_size=int(cfg.video_size), task_options=task_options, **options,
    )
    if cfg.get("instruction") is not None:
        agent = read_instruction(agent, str(cfg.instruction))
    if cfg.get("instruction_shuffle"):
        agent = shuffle_instructions(agent, policy, num_envs)
    ids = instruction_ids(policy, task)
    if ids is not None:  # a task of the policy's suite: outermost, so the wrappers above see the policy's ids
        agent = TranslatesInstructions(agent, ids)

    if OmegaConf.select(cfg, "task.name", default=None) is None:
        with open_dict(cfg):  # record the task taken from the checkpoint in config.yaml
            cfg.task = {"name": task}
    run = start_run(cfg, "eval")
    try:
        eval_info = evaluate(
            env, agent, episodes, seed=int(cfg.seed), videos=videos, video_dir=run.file("videos"),
            video_size=int(cfg.video_size),
        )
    finally:
        env.close()
    for episode in eval_info["per_episode"]:  # video paths relative to the run directory
        if episode["video"]:
            episode["video"] = Path(episode["video"]).relative_to(run.path).as_posix()
    eval_info = {
        "task": task,
        "checkpoint": str(checkpoint.resolve()),
        "seed": int(cfg.seed),
        "backend": envs.resolve_backend(task, cfg.backend),
        "device": str(cfg.device),
        **({"policy_instruction": str(cfg.instruction)} if cfg.get("instruction") is not None else {}),
        **({"scored_against": scored_against} if scored_against else {}),
        **({"instruction_shuffle": True} if cfg.get("instruction_shuffle") else {}),
        **eval_info,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    run.write_json("eval_info.json", eval_info)
    write_eval_report(run.path, eval_info)
    run.close()

    overall = eval_info["overall"]
    headline: dict[str, Any] = {"task": task, "checkpoint": taken, "n_episodes": overall["n_episodes"]}
    if overall["success_rate"] is not None:
        headline["success"] = success_text(overall)
    if cfg.get("instruction") is not None:
        headline["policy_read"] = str(cfg.instruction)
    if scored_against and (cfg.get("instruction") is not None or fixed is not None):
        headline["scored_against"] = scored_against
    headline["avg_sum_reward"] = overall["avg_sum_reward"]
    if overall["sum_reward_ci95"] is not None:
        low, high = overall["sum_reward_ci95"]
        headline["sum_reward_ci95"] = f"[{low:.4g}, {high:.4g}]"
    headline["eval_s"] = overall["eval_s"]
    return headline, run.path

"""Meta-World through every command on EnvPool (tiny scale): collect with Meta-World's own
scripted policy -> pretrain (flow and diffusion) -> eval with a video -> finetune with one method
of each training loop (PPO, off-policy residual, DSRL, QC-FQL, SAC Flow, RECAP), resumed from a
checkpoint -> eval."""

import json

import mujoco  # noqa: F401  (EnvPool's renderer needs mujoco imported before envpool)
import pytest

from embodied_rl.cli import main

pytestmark = pytest.mark.e2e

pytest.importorskip("envpool")
pytest.importorskip("metaworld.policies")

# The expert reaches in 36-57 steps; the tiny policies are run for 20 (nothing is learnt here).
TASK = ["task=metaworld/reach", "task.max_episode_steps=20"]
TINY_POLICY = ["policy.horizon=4", "policy.n_action_steps=2", "policy.num_inference_steps=2",
               "policy.mlp.hidden_dim=16", "policy.mlp.num_blocks=1"]
FINETUNE = {
    "residual_ppo": ["algo.num_steps=4", "algo.actor_kwargs.hidden=16", "algo.actor_kwargs.critic_hidden=16"],
    "residual_offpolicy": ["algo.actor_hidden_sizes=[16,16]", "algo.critic_hidden_sizes=[16,16]", "algo.ensemble=2",
                           "algo.batch_size=16", "algo.warmup_env_steps=16", "algo.critic_only_steps=0"],
    "dsrl": ["algo.hidden_sizes=[16,16]", "algo.batch_size=16", "algo.warmup_env_steps=16",
             "algo.critic_only_steps=0"],
    "qc_fql": ["algo.hidden_sizes=[16,16]", "algo.batch_size=16", "algo.offline_updates=2", "algo.buffer_size=1000"],
    "sac_flow": ["algo.critic_hidden_sizes=[16,16]", "algo.batch_size=16", "algo.critic_only_steps=8",
                 "algo.buffer_size=1000"],
    "recap": ["algo.rollout_steps=4", "algo.policy_updates=2", "algo.value_updates=2", "algo.batch_size=8"],
}


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    root = tmp_path_factory.mktemp("metaworld")
    assert main(["collect", "task=metaworld/reach", "task.max_episode_steps=60", "demos=4", "num_envs=4", f"run_dir={root / 'collect'}"]) == 0
    return root


def test_collect_uses_meta_worlds_expert_and_records_the_instruction(demos):
    info = json.loads((demos / "collect" / "collect_info.json").read_text())
    assert info["expert_success_rate"] >= 0.75 and info["episodes_written"] == 4
    from embodied_rl.data import DemoDataset

    dataset = DemoDataset.load(demos / "collect" / "demos.zarr")
    assert dataset.attrs["task"] == "metaworld/reach" and dataset.attrs["backend"] == "envpool"
    assert dataset.instructions == ["reach the goal position with the gripper"]


@pytest.mark.parametrize("policy", ["flow", "diffusion"])
def test_pretrain_and_eval_with_a_video(policy, demos, capsys):
    bc = demos / f"bc_{policy}"
    assert main(["pretrain", *TASK, f"data={demos / 'collect' / 'demos.zarr'}", f"policy={policy}", "steps=20",
                 "batch_size=16", *TINY_POLICY, "eval_episodes=0", "videos=0", f"run_dir={bc}"]) == 0, \
        capsys.readouterr().err
    out = demos / f"eval_{policy}"
    assert main(["eval", f"checkpoint={bc}", *TASK, "episodes=2", "num_envs=2", "videos=1",
                 "video_size=64", f"run_dir={out}"]) == 0, capsys.readouterr().err
    info = json.loads((out / "eval_info.json").read_text())
    assert info["backend"] == "envpool" and info["overall"]["n_episodes"] == 2
    assert list(info["overall"]["success_by_instruction"]) == ["reach the goal position with the gripper"]
    assert (out / info["per_episode"][0]["video"]).stat().st_size > 0


def success_cohorts(run_dir):
    """The tags of the cohorts under way in the last checkpoint's EarnedReach (residual TD3's reach,
    residual PPO's anchor release); None for a method without one."""
    import torch

    loop = torch.load(run_dir / "checkpoints" / "last" / "training_state" / "state.pt", weights_only=False)["loop"]
    earned = loop.get("earned_reach") or loop.get("earned_anchor")
    return None if earned is None else set(earned["cohorts"])


@pytest.mark.parametrize("algo", list(FINETUNE))
def test_finetune_resume_and_eval(algo, demos, capsys):
    bc = demos / "bc_finetune"
    if not bc.exists():
        assert main(["pretrain", *TASK, f"data={demos / 'collect' / 'demos.zarr'}", "policy=flow", "steps=20",
                     "batch_size=16", *TINY_POLICY, "eval_episodes=0", "videos=0", f"run_dir={bc}"]) == 0
    run_dir = demos / algo
    common = [*TASK, f"checkpoint={bc}", f"algo={algo}", *FINETUNE[algo], "num_envs=2", "eval_every=0",
              "eval_episodes=2", "videos=0", "checkpoint_every=16", f"run_dir={run_dir}"]
    assert main(["finetune", *common, "env_steps=32"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    stopped = success_cohorts(run_dir)
    # EnvPool cannot snapshot its envs: the resumed run restarts its episodes and says so
    assert main(["finetune", *common, "env_steps=64"]) == 0, capsys.readouterr().err
    assert "episodes in progress restart" in capsys.readouterr().out
    if stopped is not None:  # the cohorts of the lost episodes are dropped: they could never complete
        assert min(success_cohorts(run_dir)) > max(stopped)
    assert main(["eval", f"checkpoint={run_dir}", *TASK, "episodes=2", "num_envs=2",
                 "videos=0", f"run_dir={demos / ('eval_' + algo)}"]) == 0, capsys.readouterr().err


def test_collect_per_instruction_keeps_k_demos_per_task_of_a_suite(tmp_path):
    """A few-shot multi-task set: per_instruction=1 on MT10 keeps one demo of each task and stops
    once every task has one, short of demos=20."""
    from embodied_rl.data import DemoDataset

    assert main(["collect", "task=metaworld/MT10", "demos=20", "per_instruction=1", "num_envs=10",
                 f"run_dir={tmp_path / 'collect'}"]) == 0
    info = json.loads((tmp_path / "collect" / "collect_info.json").read_text())
    assert info["per_instruction"] == 1 and info["episodes_written"] == 10
    dataset = DemoDataset.load(tmp_path / "collect" / "demos.zarr")
    first_ids = [int(dataset.instruction[dataset.episode_bounds(e)[0]]) for e in range(dataset.num_episodes)]
    assert sorted(first_ids) == list(range(10))


def test_collect_refuses_a_bad_per_instruction(tmp_path, capsys):
    assert main(["collect", "task=metaworld/reach", "per_instruction=0", f"run_dir={tmp_path / 'c'}"]) == 2
    assert "per_instruction must be null or an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_collect_on_a_suite_picks_a_fitting_num_envs_or_names_one(tmp_path, capsys):
    from embodied_rl.commands.collect import validate
    from embodied_rl.config import compose

    for suite, num_envs in (("MT50", 50), ("MT10", 20), ("reach", 16)):
        cfg = compose("collect", [f"task=metaworld/{suite}"])
        validate(cfg)
        assert cfg.num_envs == num_envs, suite
    assert main(["collect", "task=metaworld/MT10", "num_envs=16", "demos=1", f"run_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert "num_envs=16 must be a multiple of the 10 tasks it is split across (e.g. num_envs=20)" in err
    assert not (tmp_path / "r").exists()


def test_export_takes_meta_worlds_control_rate(demos, capsys):
    pytest.importorskip("pyarrow")
    out = demos / "lerobot"
    assert main(["export-demos", f"data={demos / 'collect' / 'demos.zarr'}", f"out={out}",
                 f"run_dir={demos / 'export'}"]) == 0, capsys.readouterr().err
    assert json.loads((out / "meta" / "info.json").read_text())["fps"] == 80  # frame_skip 5 x 0.0025 s


def test_eval_runs_a_suite_checkpoint_on_one_of_its_tasks(tmp_path, capsys):
    """eval task=metaworld/<task> of an MT10 checkpoint: every episode on that task, the policy
    reading its own id of the task's instruction; a task outside the suite is refused."""
    import torch

    from embodied_rl.commands import instruction_ids
    from embodied_rl.commands.evaluate import TranslatesInstructions
    from embodied_rl.envs.registry import task_class
    from embodied_rl.policies import make_policy, save_policy

    suite = list(task_class("metaworld/MT10").instructions)
    torch.manual_seed(0)
    policy = make_policy("flow", obs_dim=39, action_dim=4, n_obs_steps=2, horizon=4, n_action_steps=2,
                         num_inference_steps=2, task="metaworld/MT10", instructions=suite, text_encoder="hash",
                         backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))
    checkpoint = save_policy(policy, tmp_path / "mt10")
    run_dir = tmp_path / "eval_drawer"
    assert main(["eval", f"checkpoint={checkpoint}", "task=metaworld/drawer-open", "task.max_episode_steps=10",
                 "episodes=2", "num_envs=2", "videos=0", f"run_dir={run_dir}"]) == 0, capsys.readouterr().err
    info = json.loads((run_dir / "eval_info.json").read_text())
    assert info["task"] == "metaworld/drawer-open"
    assert {episode["instruction"] for episode in info["per_episode"]} == {"pull the drawer open"}
    capsys.readouterr()

    class Reads:  # what the policy is shown
        def act(self, obs):
            self.instruction = obs["instruction"]

    reads = Reads()
    assert instruction_ids(policy, "metaworld/drawer-open") == [4] and instruction_ids(policy, "metaworld/MT10") is None
    TranslatesInstructions(reads, [4]).act({"instruction": torch.zeros(2, dtype=torch.long)})
    assert reads.instruction.tolist() == [4, 4]  # the env's only instruction is MT10's fifth

    assert main(["eval", f"checkpoint={checkpoint}", "task=metaworld/assembly", "episodes=1",
                 f"run_dir={tmp_path / 'outside'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: checkpoint '{checkpoint}' was trained on task 'metaworld/MT10' but task=metaworld/assembly; "
                   "pass task=metaworld/MT10 or a task of it whose instructions it was trained on")
    assert not (tmp_path / "outside").exists()

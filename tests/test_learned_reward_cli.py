"""Learned rewards end to end through the CLI on reach: collect a checkpoint's rollouts, train a
reward model on them, fine-tune with reward=model:PATH (residual TD3 and ReinFlow), the logs
holding the learned and the true success; and the bad inputs, each one line, exit 2, no run_dir."""

import json
import shutil

import pytest
import torch

from embodied_rl.cli import main
from embodied_rl.data import DemoDataset
from embodied_rl.policies import make_policy, save_policy
from tests.algos.test_dsrl import tiny_policy
from tests.test_validation_cli import run_refused as refused

pytestmark = pytest.mark.e2e

# a 5 cm target and 20-step episodes: the untrained tiny policy succeeds in some episodes, fails in others
REACH = ["task=reach", "+task.success_radius=0.05", "task.max_episode_steps=20"]
SMALL_MODEL = ["channels=[8,8,8]", "feature_dim=8", "hidden_dim=16", "batch_size=16", "steps=30", "log_every=10"]
FINETUNE = {
    "residual_offpolicy": ["algo.warmup_env_steps=40", "algo.critic_only_steps=40", "algo.actor_hidden_sizes=[16,16]",
                           "algo.critic_hidden_sizes=[16,16]", "algo.ensemble=4", "algo.batch_size=32",
                           "algo.utd_ratio=0.25"],
    "reinflow": ["algo.num_steps=8", "algo.actor_kwargs.critic_hidden=16"],
}


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory):
    """(BC checkpoint, rollout dataset, train-reward run directory)."""
    root = tmp_path_factory.mktemp("learned")
    checkpoint = save_policy(tiny_policy(task="reach"), root / "bc")
    assert main(["collect", *REACH, f"checkpoint={checkpoint}", "pixels=true", "image_size=16", "demos=16",
                 "num_envs=8", f"run_dir={root / 'collect'}"]) == 0
    data = root / "collect" / "demos.zarr"
    assert main(["train-reward", *REACH, f"data={data}", *SMALL_MODEL, f"run_dir={root / 'reward'}"]) == 0
    return checkpoint, data, root / "reward"


def test_collect_records_a_checkpoints_rollouts_with_the_true_success_per_step(reward_run):
    checkpoint, data, _ = reward_run
    dataset = DemoDataset.load(data)
    assert dataset.num_episodes == 16 and 0 < dataset.episode_success.sum() < 16  # successes and failures
    assert dataset.attrs["checkpoint"] == str(checkpoint) and "quality" not in dataset.attrs
    assert dataset.step_success.shape == (dataset.num_steps,)
    for e in range(dataset.num_episodes):  # an episode succeeded iff a step of it did
        start, end = dataset.episode_bounds(e)
        assert dataset.step_success[start:end].any() == dataset.episode_success[e]
    assert dataset.final_pixels.shape == (16, 16, 16, 3) and dataset.final_obs.shape == (16, 8)
    info = json.loads((data.parent / "collect_info.json").read_text())
    assert 0 < info["policy_success_rate"] < 1


def test_collect_action_noise_perturbs_a_checkpoints_rollouts_and_is_recorded(reward_run, tmp_path, capsys):
    checkpoint, data, _ = reward_run
    noisy = tmp_path / "noisy"
    assert main(["collect", *REACH, f"checkpoint={checkpoint}", "demos=16", "num_envs=8", "action_noise=0.5",
                 f"run_dir={noisy}"]) == 0
    clean, perturbed = DemoDataset.load(data), DemoDataset.load(noisy / "demos.zarr")
    assert perturbed.attrs["action_noise"] == 0.5 and clean.attrs["action_noise"] == 0.0
    # the same seed and checkpoint: the first step's observations agree, its actions do not
    assert torch.equal(torch.as_tensor(clean.obs[0]), torch.as_tensor(perturbed.obs[0]))
    assert not torch.allclose(torch.as_tensor(clean.action[0]), torch.as_tensor(perturbed.action[0]))
    assert float(abs(perturbed.action).max()) <= 1.0
    capsys.readouterr()
    refused(tmp_path, capsys, ["collect", *REACH, "demos=2", "action_noise=0.1"], "action_noise perturbs a checkpoint")
    refused(tmp_path, capsys, ["collect", *REACH, f"checkpoint={checkpoint}", "action_noise=-1"],
            "action_noise must be a number in [0, 2]")


def test_train_reward_writes_the_model_its_scores_and_a_plot(reward_run, capsys):
    _, _, run_dir = reward_run
    info = json.loads((run_dir / "reward_info.json").read_text())
    assert info["kind"] == "cnn" and info["progress_labels"] == "milestones"  # reach names its end effector
    assert info["use_state"] is False  # reach's state holds the target's position: privileged
    held_out = info["held_out"]
    for key in ("roc_auc", "precision_at_threshold", "recall_at_threshold", "episode_recall",
                "episode_false_positive_rate", "voc", "progress_spearman"):
        assert key in held_out
    assert held_out["threshold"] == 0.95 and held_out["successful_episodes"] >= 1
    assert (run_dir / "reward_model" / "config.json").is_file() and (run_dir / "reward_model" / "model.safetensors").is_file()
    assert (run_dir / "plots" / "reward_model.png").is_file() and (run_dir / "done.json").is_file()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("train/success_loss" in row for row in rows) and "val/roc_auc" in rows[-1]


def test_train_reward_reads_the_state_where_it_is_proprioception_only(tmp_path):
    # tabletop's state is the hand's position and the fingers' closure: what a real robot knows
    assert main(["collect", "task=tabletop", "pixels=true", "image_size=16", "demos=4", "quality=0.3",
                 "only_success=false", "num_envs=4", f"run_dir={tmp_path / 'collect'}"]) == 0
    train = ["train-reward", "task=tabletop", f"data={tmp_path / 'collect' / 'demos.zarr'}", "text_encoder=hash",
             *SMALL_MODEL]
    assert main([*train, f"run_dir={tmp_path / 'auto'}"]) == 0
    assert main([*train, "use_state=false", f"run_dir={tmp_path / 'off'}"]) == 0
    for run, reads_state in (("auto", True), ("off", False)):
        info = json.loads((tmp_path / run / "reward_info.json").read_text())
        config = json.loads((tmp_path / run / "reward_model" / "config.json").read_text())
        assert info["kind"] == "cnn_film" and info["use_state"] is reads_state
        assert config["config"]["use_state"] is reads_state


def test_train_reward_takes_expert_demos_for_training_only(reward_run, tmp_path, capsys):
    _, data, run_dir = reward_run
    assert main(["collect", *REACH, "pixels=true", "image_size=16", "demos=4", "num_envs=4",
                 f"run_dir={tmp_path / 'demos'}"]) == 0
    demos = tmp_path / "demos" / "demos.zarr"
    assert main(["train-reward", *REACH, f"data={data}", f"demos={demos}", *SMALL_MODEL,
                 f"run_dir={tmp_path / 'reward'}"]) == 0
    alone = json.loads((run_dir / "reward_info.json").read_text())
    info = json.loads((tmp_path / "reward" / "reward_info.json").read_text())
    assert info["demos"] == str(demos) and alone["demos"] is None
    # the demos' states join the training split; the held-out episodes are data='s, the same as without them
    demo_states = DemoDataset.load(demos).num_steps
    assert info["train"]["states"] == alone["train"]["states"] + demo_states
    assert info["train"]["success_states"] >= alone["train"]["success_states"] + 4
    assert info["held_out_episodes"] == alone["held_out_episodes"]
    assert info["held_out"]["states"] == alone["held_out"]["states"]
    capsys.readouterr()
    refused(tmp_path, capsys, ["train-reward", *REACH, f"data={data}", f"demos={tmp_path / 'nothing'}"],
            f"demos dataset '{tmp_path / 'nothing'}' does not exist")
    assert main(["collect", *REACH, "pixels=true", "image_size=8", "demos=2", "num_envs=2",
                 f"run_dir={tmp_path / 'small'}"]) == 0
    capsys.readouterr()
    refused(tmp_path, capsys, ["train-reward", *REACH, f"data={data}", f"demos={tmp_path / 'small' / 'demos.zarr'}"],
            "has 8x8 frames, data= 16x16")
    assert main(["collect", "task=push_t", "pixels=true", "image_size=16", "demos=1", "num_envs=1",
                 f"run_dir={tmp_path / 'push_t'}"]) == 0
    capsys.readouterr()
    refused(tmp_path, capsys, ["train-reward", *REACH, f"data={data}", f"demos={tmp_path / 'push_t' / 'demos.zarr'}"],
            "was collected on task 'push_t', data= on 'reach'")


def test_train_reward_after_success_first_run_trains_through_the_first_success_run_only(reward_run, tmp_path):
    """Rollouts that run on past success (the untrained policy leaves the target and comes back):
    first_run trains on fewer rows, still with success states, and scores the same held-out rows."""
    checkpoint = reward_run[0]
    assert main(["collect", *REACH, f"checkpoint={checkpoint}", "pixels=true", "image_size=16", "demos=8",
                 "num_envs=8", "+task.success_terminates=false", f"run_dir={tmp_path / 'on'}"]) == 0
    on = DemoDataset.load(tmp_path / "on" / "demos.zarr")
    for after in ("keep", "first_run"):
        assert main(["train-reward", *REACH, f"data={on.path}", f"after_success={after}", *SMALL_MODEL,
                     f"run_dir={tmp_path / after}"]) == 0
    keep, first_run = (json.loads((tmp_path / a / "reward_info.json").read_text()) for a in ("keep", "first_run"))
    assert keep["after_success"] == "keep" and first_run["after_success"] == "first_run"
    assert first_run["train"]["states"] < keep["train"]["states"]
    assert first_run["train"]["success_states"] > 0
    assert first_run["held_out_episodes"] == keep["held_out_episodes"]
    assert first_run["held_out"]["states"] == keep["held_out"]["states"]  # scored on the episodes as they are


@pytest.mark.parametrize("algo", sorted(FINETUNE))
@pytest.mark.parametrize("kind", ["success", "success_progress"])
def test_finetune_learns_from_the_learned_reward_and_logs_both_successes(reward_run, tmp_path, capsys, algo, kind):
    checkpoint, _, reward_dir = reward_run
    run_dir = tmp_path / "ft"
    code = main(["finetune", *REACH, f"algo={algo}", f"checkpoint={checkpoint}", f"reward=model:{reward_dir}",
                 f"learned_reward.kind={kind}", "num_envs=4", "env_steps=240", "eval_every=120", "eval_episodes=4",
                 "videos=0", "log_every=40", f"run_dir={run_dir}", *FINETUNE[algo]])
    assert code == 0, capsys.readouterr().err
    assert "success: " in capsys.readouterr().out  # evaluation scores the simulator's success
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in rows if "rollout/success_rate" in row]
    assert logged and all("train/learned_success_rate" in row and "train/learned_return" in row for row in logged)
    assert any("eval/success_rate" in row for row in rows)
    assert (run_dir / "plots" / "learned_reward.png").is_file()
    assert "Learned vs true success" in (run_dir / "report.md").read_text()


def test_a_pixel_policy_collects_and_learns_beside_a_reward_model_that_reads_finer_frames(tmp_path, capsys):
    """An 8x8 pixel policy: collect records 16x16 frames (the policy reads them pooled to 8x8), the
    reward model trains on them, and finetune renders 16x16 for it while the policy sees 8x8."""
    torch.manual_seed(0)
    policy = make_policy("flow", obs_dim=8, action_dim=2, n_obs_steps=1, horizon=4, n_action_steps=2,
                         num_inference_steps=2, obs_mode="pixels", image_shape=[8, 8], task="reach",
                         backbone_kwargs={"hidden_dim": 16, "num_blocks": 1})
    checkpoint = save_policy(policy, tmp_path / "bc")
    collect = ["collect", *REACH, f"checkpoint={checkpoint}", "pixels=true", "demos=8", "num_envs=4"]
    refused(tmp_path, capsys, [*collect, "image_size=12"], "reads 8x8 frames, so the recorded ones must be that size "
            "or a multiple of it")
    assert main([*collect, "image_size=16", f"run_dir={tmp_path / 'collect'}"]) == 0
    data = DemoDataset.load(tmp_path / "collect" / "demos.zarr")
    assert data.final_pixels.shape[1:] == (16, 16, 3)
    assert main(["train-reward", *REACH, f"data={data.path}", *SMALL_MODEL, f"run_dir={tmp_path / 'reward'}"]) == 0
    run_dir = tmp_path / "ft"
    code = main(["finetune", *REACH, "algo=residual_offpolicy", f"checkpoint={checkpoint}",
                 f"reward=model:{tmp_path / 'reward'}", "num_envs=4", "env_steps=120", "eval_every=0",
                 "eval_episodes=4", "videos=0", "log_every=40", f"run_dir={run_dir}", *FINETUNE["residual_offpolicy"]])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("train/learned_success_rate" in row for row in rows)


def test_bad_learned_rewards_are_refused(reward_run, tmp_path, capsys):
    checkpoint, _, reward_dir = reward_run
    finetune = ["finetune", *REACH, "algo=residual_offpolicy", f"checkpoint={checkpoint}"]
    refused(tmp_path, capsys, [*finetune, "reward=oracle"], "reward must be sim or model:PATH")
    refused(tmp_path, capsys, [*finetune, f"reward=model:{reward_dir}", "learned_reward.kind=shaped"],
            "learned_reward.kind must be one of success, success_progress, got 'shaped'")
    refused(tmp_path, capsys, [*finetune, f"reward=model:{reward_dir}", "learned_reward.hacking_gap=0"],
            "learned_reward.hacking_gap must be in (0, 1], got 0")
    refused(tmp_path, capsys, [*finetune, f"reward=model:{reward_dir}", "learned_reward.hold_steps=0"],
            "learned_reward.hold_steps must be an integer >= 1, got 0")
    refused(tmp_path, capsys, [*finetune, f"reward=model:{tmp_path / 'none'}"], "does not exist")
    refused(tmp_path, capsys, [*finetune, f"reward=model:{reward_dir}", "algo.reward=success"],
            "leave it at auto")
    # a reward model for another task
    other = tmp_path / "other_task"
    shutil.copytree(reward_dir / "reward_model", other)
    config = json.loads((other / "config.json").read_text())
    config["config"]["task"] = "push_t"
    (other / "config.json").write_text(json.dumps(config))
    refused(tmp_path, capsys, [*finetune, f"reward=model:{other}"], "was trained on task 'push_t', not reach")
    # a corrupt model file
    corrupt = tmp_path / "corrupt"
    shutil.copytree(reward_dir / "reward_model", corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 40)
    refused(tmp_path, capsys, [*finetune, f"reward=model:{corrupt}"], "model.safetensors is corrupt or truncated")
    # a policy that reads frames of another size than the reward model
    torch.manual_seed(0)
    pixel_policy = make_policy("flow", obs_dim=8, action_dim=2, n_obs_steps=1, horizon=4, n_action_steps=2,
                               num_inference_steps=2, obs_mode="pixels", image_shape=[24, 24], task="reach",
                               backbone_kwargs={"hidden_dim": 16, "num_blocks": 1})
    pixels_checkpoint = save_policy(pixel_policy, tmp_path / "pixel_bc")
    refused(tmp_path, capsys, ["finetune", *REACH, "algo=residual_offpolicy", f"checkpoint={pixels_checkpoint}",
                               f"reward=model:{reward_dir}"], "reads 16x16 frames, the policy 24x24")


def test_bad_reward_model_training_is_refused(reward_run, tmp_path, capsys):
    checkpoint, data, _ = reward_run
    train = ["train-reward", *REACH, f"data={data}"]
    refused(tmp_path, capsys, ["train-reward", "task=reach"], "data=PATH is required")
    refused(tmp_path, capsys, [*train, "kind=vit"], "kind must be auto or one of cnn, cnn_film, got 'vit'")
    refused(tmp_path, capsys, [*train, "progress=oracle"], "progress must be auto or one of milestones, time, none")
    refused(tmp_path, capsys, [*train, "threshold=1.5"], "threshold must be in (0, 1), got 1.5")
    refused(tmp_path, capsys, [*train, "after_success=drop"], "after_success must be one of keep, first_run, got 'drop'")
    refused(tmp_path, capsys, [*train, "use_state=maybe"], "bad value for 'use_state': expected auto, true or false")
    refused(tmp_path, capsys, ["train-reward", "task=push_t", f"data={data}"], "collected on task 'reach' but task=push_t")
    refused(tmp_path, capsys, [*train, "kind=cnn_film"], "cnn_film conditions on instructions")
    no_frames = tmp_path / "no_frames"
    assert main(["collect", *REACH, f"checkpoint={checkpoint}", "demos=2", "num_envs=2",
                 f"run_dir={no_frames}"]) == 0
    capsys.readouterr()
    refused(tmp_path, capsys, ["train-reward", *REACH, f"data={no_frames / 'demos.zarr'}"], "collect it with pixels=true")
    refused(tmp_path, capsys, ["collect", *REACH, f"checkpoint={checkpoint}", "quality=0.5"],
            "a checkpoint's rollouts have none")


def test_reward_firing_scores_a_model_on_rollouts_at_several_operating_points(reward_run):
    from tests.test_benchmarks import load_benchmark

    _, data, run_dir = reward_run
    result = load_benchmark("reward_firing").main(["--model", str(run_dir), "--data", str(data), "--thresholds", "0.5", "0.95", "--holds", "1", "3"])
    rows = {(row["threshold"], row["hold_steps"]): row for row in result["rows"]}
    assert set(rows) == {(0.5, 1), (0.5, 3), (0.95, 1), (0.95, 3)} and result["episodes"] == 16
    for threshold in (0.5, 0.95):  # holding for longer can only fire in fewer episodes
        assert rows[(threshold, 3)]["fires_in_successful"] <= rows[(threshold, 1)]["fires_in_successful"]
        assert rows[(threshold, 3)]["fires_in_failed"] <= rows[(threshold, 1)]["fires_in_failed"]
    assert rows[(0.5, 1)]["fires_in_failed"] >= rows[(0.95, 1)]["fires_in_failed"]

"""LearnedRewardEnv: the learner is paid the reward model's judgement of the frames, the learned
success ends the episode, and the simulator's reward and success reach it nowhere but the logs."""

from pathlib import Path

import pytest
import torch

import embodied_rl.envs as envs
from embodied_rl.rewards import LearnedReward, RewardOutput


class ScriptedJudge:
    """A stand-in reward model whose verdict the test sets before each step."""

    image_size = 16

    def __init__(self, num_envs):
        self.success_prob = torch.zeros(num_envs)
        self.progress = torch.zeros(num_envs)
        self.seen = None

    def judge(self, frames, state, instruction=None):
        self.seen = frames
        return RewardOutput(self.success_prob.clone(), self.progress.clone())


def learned_env(kind="success", policy_image_size=None, success_radius=0.02, gain=0.2, cap=0.25, num_envs=3):
    judge = ScriptedJudge(num_envs)
    learned = LearnedReward(Path("stub"), judge, kind, threshold=0.95, progress_gain=gain, progress_cap=cap)
    options, task_options = learned.env_options({"obs_mode": "state"}, {"success_radius": success_radius})
    env = envs.make("reach", num_envs=num_envs, seed=0, task_options=task_options, **options)
    return learned.wrap(env, policy_image_size), judge


def test_the_learned_success_is_the_reward_and_ends_the_episode():
    env, judge = learned_env()
    obs, _ = env.reset(seed=0)
    assert isinstance(obs, torch.Tensor) and obs.shape == (3, 8)  # a state policy sees no frames
    assert env.task.success_terminates and not env.env.task.success_terminates
    judge.success_prob = torch.tensor([0.99, 0.5, 0.0])
    obs, reward, terminated, truncated, info = env.step(torch.zeros(3, 2))
    assert judge.seen.shape == (3, 16, 16, 3) and judge.seen.dtype == torch.uint8  # the reached frames
    assert reward.tolist() == [1.0, 0.0, 0.0]
    assert terminated.tolist() == [True, False, False] and not truncated.any()
    assert info["_final"].tolist() == [True, False, False] and info["learned_success"].tolist() == [True, False, False]
    assert info["episode"]["learned_success_once"][0] and info["episode"]["learned_return"][0] == 1.0
    assert isinstance(info["final_obs"], torch.Tensor)
    assert env.env.elapsed.tolist() == [0, 1, 1]  # env 0 started a new episode


def test_the_simulators_success_ends_no_episode_and_pays_nothing():
    env, judge = learned_env(success_radius=1.0)  # the simulator calls every state a success
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(torch.zeros(3, 2))
    assert info["success"].all() and info["episode"]["success_once"].all()  # kept for the logs
    assert not terminated.any() and not reward.any()


def test_progress_pays_gain_times_progress_up_to_the_cap_per_episode():
    env, judge = learned_env("success_progress", gain=0.2, cap=0.25)
    env.reset(seed=0)
    judge.progress = torch.full((3,), 0.5)
    paid = [env.step(torch.zeros(3, 2))[1][0].item() for _ in range(4)]
    assert paid == pytest.approx([0.1, 0.1, 0.05, 0.0])
    judge.success_prob = torch.tensor([1.0, 0.0, 0.0])
    _, reward, terminated, _, info = env.step(torch.zeros(3, 2))
    assert reward[0].item() == pytest.approx(1.0) and terminated[0]
    assert info["episode"]["learned_return"][0].item() == pytest.approx(1.25)
    assert env.progress_paid[0] == 0 and env.progress_paid[1] == pytest.approx(0.25)  # a new episode starts afresh


def test_a_pixel_policy_keeps_the_frames_and_a_snapshot_restores_the_sums():
    env, judge = learned_env("success_progress", policy_image_size=16)
    obs, _ = env.reset(seed=0)
    assert set(obs) == {"state", "pixels"} and obs["pixels"].shape == (3, 16, 16, 3)
    judge.progress = torch.full((3,), 0.4)
    env.step(torch.zeros(3, 2))
    snapshot = env.get_state()
    after = [env.step(torch.full((3, 2), 0.1))[1] for _ in range(2)]
    env.set_state(snapshot)
    again = [env.step(torch.full((3, 2), 0.1))[1] for _ in range(2)]
    for a, b in zip(after, again):
        torch.testing.assert_close(a, b)


def test_a_policy_reading_coarser_frames_sees_the_models_frames_pooled_to_its_size():
    from embodied_rl.envs.render import pool_frames

    env, judge = learned_env(policy_image_size=8)  # the model reads 16x16, the policy 8x8
    obs, _ = env.reset(seed=0)
    assert obs["pixels"].shape == (3, 8, 8, 3) and env.single_observation_space["pixels"].shape == (8, 8, 3)
    judge.success_prob = torch.tensor([0.99, 0.0, 0.0])
    _, _, _, _, info = env.step(torch.zeros(3, 2))
    assert judge.seen.shape == (3, 16, 16, 3)  # the model judged its own size
    torch.testing.assert_close(info["final_obs"]["pixels"], pool_frames(judge.seen, 8))


def test_pool_frames_averages_each_block_and_refuses_a_size_that_does_not_divide():
    from embodied_rl.envs.render import pool_frames

    frames = torch.arange(2 * 4 * 4 * 3, dtype=torch.uint8).reshape(2, 4, 4, 3)
    pooled = pool_frames(frames, 2)
    assert pooled.shape == (2, 2, 2, 3) and pooled.dtype == torch.uint8
    assert pooled[0, 0, 0, 0] == round((0 + 3 + 12 + 15) / 4)  # pixels (0,0) (0,1) (1,0) (1,1), channel 0
    assert pool_frames(frames, 4) is frames
    with pytest.raises(ValueError, match="cannot pool 4x4 frames to 3x3"):
        pool_frames(frames, 3)


def test_reward_hacking_is_flagged_where_the_learned_success_outruns_the_simulators(capsys):
    """A logging window of >= 20 training episodes whose learned success rate exceeds the
    simulator's by learned_reward.hacking_gap is flagged: train/reward_gap and
    train/reward_hacking in its row, one warning, and the headline's reward_hacking."""
    from embodied_rl.algos.common import FinetuneLoop

    class Run:
        rows: list = []

        def log(self, step, row):
            self.rows.append(row)

    settings = {"env_steps": 100, "eval_every": 0, "checkpoint_every": 0, "log_every": 10, "reward": "model:stub",
                "learned_reward": {"hacking_gap": 0.25}}
    loop = FinetuneLoop(settings, Run(), evaluation=None)

    def window(true_successes, learned_successes, episodes=20):
        loop.counters["env_steps"] += 10
        loop.record_episodes([0.0] * episodes, [1.0] * true_successes + [0.0] * (episodes - true_successes),
                             [0.0] * episodes, [1.0] * learned_successes + [0.0] * (episodes - learned_successes))
        loop.log({}, force=True)
        return Run.rows[-1]

    assert window(8, 10)["train/reward_gap"] == pytest.approx(0.1)  # paid a little more: not flagged
    assert "train/reward_hacking" not in Run.rows[-1] and capsys.readouterr().err == ""
    assert window(6, 18)["train/reward_hacking"] == 1.0  # 90% paid, 30% true
    assert window(4, 19)["train/reward_hacking"] == 1.0
    assert "train/reward_gap" not in window(0, 10, episodes=10)  # too few episodes to judge
    err = capsys.readouterr().err
    assert err.count("warning: reward hacking?") == 1 and "at env step 20 the reward model paid a success in 90%" in err
    assert loop.counters["hacking_windows"] == 2 and loop.counters["hacking_first_step"] == 20
    # without a learned reward nothing is computed
    plain = FinetuneLoop({**settings, "reward": "sim"}, Run(), evaluation=None)
    plain.record_episodes([0.0] * 20, [0.0] * 20)
    plain.log({}, force=True)
    assert "train/reward_gap" not in Run.rows[-1]


def test_with_hold_steps_the_learned_success_needs_that_many_consecutive_frames():
    judge = ScriptedJudge(2)
    learned = LearnedReward(Path("stub"), judge, "success", threshold=0.95, progress_gain=0.0, progress_cap=0.0,
                            hold_steps=3)
    options, task_options = learned.env_options({"obs_mode": "state"}, {})
    env = learned.wrap(envs.make("reach", num_envs=2, seed=0, task_options=task_options, **options), None)
    env.reset(seed=0)
    fired = []
    for above in ([1, 1], [1, 0], [1, 1], [0, 1]):  # env 0 holds for 3 steps; env 1 never does
        judge.success_prob = torch.tensor(above, dtype=torch.float)
        _, reward, terminated, _, _ = env.step(torch.zeros(2, 2))
        fired.append(reward.tolist())
        assert terminated.tolist() == [r == 1.0 for r in reward.tolist()]
    assert fired == [[0, 0], [0, 0], [1, 0], [0, 0]]
    assert env.steps_above.tolist() == [0, 2]  # env 0's new episode starts its count afresh
    snapshot = env.get_state()
    del snapshot["learned_reward/steps_above"]  # a snapshot written before hold_steps
    env.set_state(snapshot)
    assert env.steps_above.tolist() == [0, 0]


def test_a_model_with_its_own_camera_judges_that_cameras_frames_and_the_policy_never_sees_them():
    judge = ScriptedJudge(2)
    learned = LearnedReward(Path("stub"), judge, "success", threshold=0.95, progress_gain=0.0, progress_cap=0.0,
                            camera="top")
    options, task_options = learned.env_options({"obs_mode": "pixels", "image_size": 16}, {})
    env = learned.wrap(envs.make("tabletop", num_envs=2, seed=0, task_options=task_options, **options), 16)
    assert "reward_pixels" not in env.single_observation_space.spaces
    obs, _ = env.reset(seed=0)
    assert set(obs) == {"state", "pixels", "instruction"}
    _, _, _, _, info = env.step(torch.zeros(2, env.single_action_space.shape[0]))
    assert torch.equal(judge.seen, env.env._observe()["reward_pixels"])  # the state reached, as "top" shows it
    assert not torch.equal(judge.seen, info["final_obs"]["pixels"])
    assert set(info["final_obs"]) == {"state", "pixels", "instruction"}
    env.close()

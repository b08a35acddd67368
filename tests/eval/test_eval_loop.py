"""evaluate() on a tiny fake BatchedEnv and fake agent (no simulator): slot assignment,
determinism, success_once, reward-only tasks, agent resets, videos."""

from __future__ import annotations

import math

import imageio.v2 as imageio
import pytest
import torch

from embodied_rl.eval import evaluate, round_seed, run_round, wilson_interval
from embodied_rl.eval.video import DEFAULT_FPS, end_hold_frames


class FakeTask:
    def __init__(self, has_success: bool = True):
        self.has_success = has_success
        self.max_episode_steps = 10


class FakeEnv:
    """N envs; each episode draws a length in [2, 8] and a success step in [1, 11] from the env's
    generator. Success holds at exactly that step (if the episode lasts that long) and does not
    end the episode, so only success_once can see it. Even lengths end by termination, odd by
    truncation. Reward: 1 at the success step, 0.1 otherwise, plus 0.01 * action."""

    def __init__(self, num_envs: int, seed: int = 0, has_success: bool = True):
        self.num_envs = num_envs
        self.device = torch.device("cpu")
        self.task = FakeTask(has_success)
        self.generator = torch.Generator().manual_seed(seed)
        self.length = torch.zeros(num_envs, dtype=torch.long)
        self.success_step = torch.zeros(num_envs, dtype=torch.long)
        self.elapsed = torch.zeros(num_envs, dtype=torch.long)
        self.returns = torch.zeros(num_envs)
        self.success_once = torch.zeros(num_envs, dtype=torch.bool)
        self.render_calls = 0

    def _sample(self, ids: torch.Tensor) -> None:
        n = len(ids)
        self.length[ids] = torch.randint(2, 9, (n,), generator=self.generator)
        self.success_step[ids] = torch.randint(1, 12, (n,), generator=self.generator)
        self.elapsed[ids] = 0
        self.returns[ids] = 0.0
        self.success_once[ids] = False

    def _obs(self) -> torch.Tensor:
        return torch.stack([self.length, self.elapsed], dim=1).float()

    def reset(self, seed=None, env_ids=None):
        if seed is not None:
            self.generator.manual_seed(seed)
        self._sample(torch.arange(self.num_envs))
        return self._obs(), {}

    def step(self, action):
        assert action.shape == (self.num_envs, 1)
        self.elapsed += 1
        success = self.elapsed == self.success_step
        reward = torch.where(success, 1.0, 0.1) + 0.01 * action[:, 0]
        self.returns += reward
        self.success_once |= success
        end = self.elapsed >= self.length
        terminated = end & (self.length % 2 == 0)
        truncated = end & ~terminated
        info = {
            "success": success if self.task.has_success else torch.zeros_like(success),
            "_final": end.clone(),
            "final_obs": self._obs(),
            "_episode": end.clone(),
            "episode": {"return": self.returns.clone(), "length": self.elapsed.clone(),
                        "success_once": self.success_once.clone()},
        }
        if end.any():
            self._sample(end.nonzero().flatten())
        return self._obs(), reward, terminated, truncated, info

    def render(self, env_ids):
        self.render_calls += 1
        ids = torch.as_tensor(env_ids)
        value = (self.elapsed[ids] * 25 + ids * 7).clamp(max=255).to(torch.uint8)
        return value.view(-1, 1, 1, 1).expand(-1, 24, 32, 3).contiguous()


class FakeAgent:
    """Counts steps per env since its last reset and checks it against the env's elapsed steps
    (seen in the obs): a missed or spurious reset breaks the check. Samples noisy actions from
    the global torch RNG, like a diffusion policy."""

    def __init__(self, num_envs: int):
        self.steps = torch.zeros(num_envs, dtype=torch.long)
        self.reset_masks: list[torch.Tensor] = []

    def reset(self, mask):
        self.reset_masks.append(mask.clone())
        self.steps[mask] = 0

    def act(self, obs):
        assert torch.equal(self.steps, obs[:, 1].long()), "agent state out of sync with its episode"
        self.steps += 1
        return torch.randn(len(obs), 1).clamp(-1, 1)


def run(num_envs=3, episodes=7, seed=0, has_success=True, **kwargs):
    env = FakeEnv(num_envs, has_success=has_success)
    agent = FakeAgent(num_envs)
    info = evaluate(env, agent, episodes, seed=seed, progress=False, **kwargs)
    return info, env, agent


def expected_episode(seed: int, num_envs: int, k: int) -> tuple[int, bool]:
    """Length and success of episode k, from a fresh env reset the way round k // N is."""
    env = FakeEnv(num_envs)
    env.reset(seed=round_seed(seed, k // num_envs))
    i = k % num_envs
    length, success_step = int(env.length[i]), int(env.success_step[i])
    return length, success_step <= length


def without_timing(info):
    return {**info, "overall": {k: v for k, v in info["overall"].items() if k != "eval_s"}}


def test_slots_are_assigned_up_front():
    info, _, _ = run(num_envs=3, episodes=7, seed=5)
    records = info["per_episode"]
    assert [r["episode"] for r in records] == list(range(7))
    for k, record in enumerate(records):
        assert record["env_index"] == k % 3
        assert record["seed"] == round_seed(5, k // 3)
        length, success = expected_episode(5, 3, k)
        assert record["length"] == length
        assert record["success"] == success
    assert info["overall"]["n_episodes"] == 7
    assert info["overall"]["num_envs"] == 3


def test_short_episodes_are_not_over_counted():
    # Episodes that end early auto-reset and run again; those extra episodes must be discarded.
    info, _, _ = run(num_envs=2, episodes=2, seed=1)
    lengths = [r["length"] for r in info["per_episode"]]
    assert lengths == [expected_episode(1, 2, k)[0] for k in range(2)]


def test_more_envs_than_episodes_counts_the_first_slots():
    info, _, _ = run(num_envs=5, episodes=2, seed=3)
    assert [r["env_index"] for r in info["per_episode"]] == [0, 1]


def test_deterministic_and_seed_dependent():
    first, _, _ = run(seed=11)
    second, _, _ = run(seed=11)
    other, _, _ = run(seed=12)
    assert without_timing(first) == without_timing(second)
    assert [r["length"] for r in first["per_episode"]] != [r["length"] for r in other["per_episode"]]


def test_callers_rng_is_untouched():
    torch.manual_seed(123)
    run()
    after_eval = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(after_eval, torch.rand(3))


def test_success_once_and_overall_numbers():
    info, _, _ = run(num_envs=4, episodes=9, seed=2)
    records = info["per_episode"]
    overall = info["overall"]
    successes = sum(r["success"] for r in records)
    assert 0 < successes < 9  # the seed gives a mix, so the test can tell success from failure
    for r in records:
        # the success step gives reward ~1: success_once, not the final step, decides success
        assert (r["max_reward"] > 0.5) == r["success"]
    assert overall["n_success"] == successes
    assert overall["pc_success"] == pytest.approx(100 * successes / 9)
    assert overall["success_rate"] == pytest.approx(successes / 9)
    assert overall["success_ci95"] == pytest.approx(list(wilson_interval(successes, 9)))
    assert overall["avg_episode_length"] == pytest.approx(sum(r["length"] for r in records) / 9)
    assert overall["avg_sum_reward"] == pytest.approx(sum(r["return"] for r in records) / 9)
    assert overall["avg_max_reward"] == pytest.approx(sum(r["max_reward"] for r in records) / 9)
    low, high = overall["sum_reward_ci95"]
    assert low < overall["avg_sum_reward"] < high


def test_reward_only_task_reports_return_statistics():
    info, _, _ = run(has_success=False)
    overall = info["overall"]
    assert overall["has_success"] is False
    for key in ("pc_success", "success_rate", "success_ci95", "n_success"):
        assert overall[key] is None
    assert all(r["success"] is None for r in info["per_episode"])
    assert overall["std_sum_reward"] > 0
    low, high = overall["sum_reward_ci95"]
    assert low < overall["avg_sum_reward"] < high


def test_agent_is_reset_where_episodes_end():
    info, _, agent = run(num_envs=3, episodes=6)  # FakeAgent.act asserts it stays in sync
    first_masks = [m for m in agent.reset_masks if bool(m.all())]
    assert len(first_masks) >= 2  # one full reset per round
    assert any(0 < int(m.sum()) < 3 for m in agent.reset_masks)  # partial resets on episode end


def test_single_episode_has_no_return_interval():
    info, _, _ = run(num_envs=1, episodes=1)
    assert info["overall"]["std_sum_reward"] is None
    assert info["overall"]["sum_reward_ci95"] is None


@pytest.mark.parametrize("episodes,videos", [(0, 0), (3, 4), (3, -1)])
def test_bad_arguments(episodes, videos, tmp_path):
    with pytest.raises(ValueError):
        evaluate(FakeEnv(2), FakeAgent(2), episodes, videos=videos, video_dir=tmp_path, progress=False)


def test_videos_are_written_and_do_not_change_results(tmp_path):
    plain, _, _ = run(num_envs=3, episodes=5, seed=4)
    recorded, env, _ = run(num_envs=3, episodes=5, seed=4, videos=4, video_dir=tmp_path, video_size=64)
    assert env.render_calls > 0
    strip = lambda info: [{k: v for k, v in r.items() if k != "video"} for r in info["per_episode"]]  # noqa: E731
    assert strip(plain) == strip(recorded)
    assert without_timing(plain)["overall"] == without_timing(recorded)["overall"]

    files = sorted(tmp_path.glob("*.mp4"))
    assert [f.name for f in files] == [f"episode_{k}.mp4" for k in range(4)]  # 4th is in round 2
    for record in recorded["per_episode"]:
        if record["episode"] < 4:
            frames = imageio.mimread(record["video"], memtest=False)
            assert len(frames) == record["length"] + end_hold_frames(DEFAULT_FPS)
            assert frames[0].shape == (64, 86, 3)  # 24x32 frames scaled to height 64, even width
        else:
            assert record["video"] is None


def test_overlay_changes_pixels_and_video_shows_progress(tmp_path):
    info, _, _ = run(num_envs=1, episodes=1, videos=1, video_dir=tmp_path, video_size=96)
    frames = imageio.mimread(info["per_episode"][0]["video"], memtest=False)
    # the fake frame brightens with each step: the bottom-right corner (no text) follows it
    corners = [int(f[-4:, -4:].mean()) for f in frames[: info["per_episode"][0]["length"]]]
    assert corners == sorted(corners) and corners[0] < corners[-1]
    # the overlay box darkens the top-left corner and draws white text there
    assert frames[1][:10, :30].max() > 200
    assert not math.isclose(float(frames[1][:10, :30].mean()), float(frames[1][-10:, -30:].mean()))


def test_run_round_replays_one_episode():
    info, _, _ = run(num_envs=3, episodes=7, seed=9)
    target = info["per_episode"][5]  # round 1, env 2
    records = run_round(FakeEnv(3), FakeAgent(3), target["seed"])
    again = records[target["env_index"]]
    assert {**again, "episode": target["episode"]} == target

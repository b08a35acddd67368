"""Reward-model data: the reached state of every step, its success label, and the progress
pseudo-labels (time to success, milestones)."""

import numpy as np
import pytest

from embodied_rl.data.dataset import DemoDataset, write_demos
from embodied_rl.errors import UserError
from embodied_rl.rewards.data import (
    RewardSamples,
    milestone_progress,
    milestones,
    reward_samples,
    through_first_success_run,
    time_progress,
)


def episode(length, success_at=None, size=4, obs_dim=3, seed=0):
    """An episode whose row t observes state t and whose frames carry t in every pixel, so the
    reached state of step t (state t + 1) is recognisable."""
    rng = np.random.default_rng(seed)
    states = np.arange(length + 1, dtype=np.float32)[:, None].repeat(obs_dim, axis=1) + 100 * seed
    frames = (np.arange(length + 1) + 10 * seed).astype(np.uint8)[:, None, None, None].repeat(size, 1).repeat(size, 2).repeat(3, 3)
    step_success = np.zeros(length, dtype=bool)
    if success_at is not None:
        step_success[success_at:] = True
    return {"obs": states[:-1], "action": rng.uniform(-1, 1, (length, 2)).astype(np.float32),
            "reward": np.zeros(length, np.float32), "pixels": frames[:-1], "step_success": step_success,
            "final_obs": states[-1], "final_pixels": frames[-1], "success": success_at is not None}


@pytest.fixture
def dataset(tmp_path):
    episodes = [episode(4, success_at=3, seed=0), episode(3, seed=1), episode(5, success_at=2, seed=2)]
    return DemoDataset.load(write_demos(tmp_path / "d.zarr", episodes, {"task": "reach"}))


def test_the_dataset_keeps_step_success_and_the_final_observations(dataset):
    assert dataset.step_success.tolist() == [False, False, False, True] + [False] * 3 + [False, False, True, True, True]
    assert dataset.final_obs.shape == (3, 3) and dataset.final_pixels.shape == (3, 4, 4, 3)
    first = dataset.first_episodes(2)
    assert len(first.step_success) == 7 and len(first.final_obs) == 2 and len(first.final_pixels) == 2


def test_samples_are_the_states_each_step_reached(dataset):
    samples = reward_samples(dataset, "time")
    # episode 0 (4 steps): states 1..4 reached, state 4 being its final observation
    assert samples.state[:4, 0].tolist() == [1, 2, 3, 4]
    assert samples.frames[:4, 0, 0, 0].tolist() == [1, 2, 3, 4]
    assert samples.state[4:7, 0].tolist() == [101, 102, 103]  # episode 1
    assert samples.frames[4:7, 0, 0, 0].tolist() == [11, 12, 13]
    assert samples.episode.tolist() == [0] * 4 + [1] * 3 + [2] * 5
    assert samples.time.tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]
    assert samples.success.tolist() == dataset.step_success.tolist()
    # time to success: (t + 1) / (t_s + 1), then 1; the failed episode is unlabelled
    np.testing.assert_allclose(samples.progress[:4], [0.25, 0.5, 0.75, 1.0])
    assert np.isnan(samples.progress[4:7]).all()
    np.testing.assert_allclose(samples.progress[7:], [1 / 3, 2 / 3, 1, 1, 1])


def test_a_dataset_without_frames_or_labels_is_refused(tmp_path):
    no_pixels = {k: v for k, v in episode(3).items() if k not in ("pixels", "final_pixels")}
    path = write_demos(tmp_path / "a.zarr", [no_pixels], {"task": "reach"})
    with pytest.raises(UserError, match="pixels=true"):
        reward_samples(DemoDataset.load(path), "time")
    no_labels = {k: v for k, v in episode(3).items() if k != "step_success"}
    path = write_demos(tmp_path / "b.zarr", [no_labels], {"task": "reach"})
    with pytest.raises(UserError, match="no per-step success labels"):
        reward_samples(DemoDataset.load(path), "time")


def test_time_progress():
    np.testing.assert_allclose(time_progress(np.array([False, False, True, False])), [1 / 3, 2 / 3, 1, 1])
    assert np.isnan(time_progress(np.zeros(3, bool))).all()


def test_milestones_are_gripper_changes_and_pauses_after_moving():
    # x moves 1 cm per step, pauses 4 steps (from step 3), moves on; the gripper closes at step 8
    x = [0.0, 0.01, 0.02, 0.03, 0.03, 0.03, 0.03, 0.03, 0.04, 0.05, 0.06]
    gripper = [0.0] * 9 + [1.0, 1.0]
    states = np.array([[xi, 0.0, g] for xi, g in zip(x, gripper)], dtype=np.float32)
    assert milestones(states, (0, 1), 2, pause_speed=0.003, pause_steps=3) == [3, 8]
    # standing still at the start is no pause; without a gripper only the pause counts
    still = np.concatenate([states[:1].repeat(4, 0), states])
    assert milestones(still, (0, 1), None, pause_speed=0.003, pause_steps=3) == [7]
    # a milestone within pause_steps of the previous one is the same one: grasping while paused
    grasp_in_pause = states.copy()
    grasp_in_pause[5:, 2] = 1.0  # the gripper closes at step 4
    assert milestones(grasp_in_pause, (0, 1), 2, pause_speed=0.003, pause_steps=3) == [3]


def test_milestone_progress_climbs_segment_by_segment():
    # success at step 7 with one milestone at step 3: 0.5 there, 1 at the success, linear between
    progress = milestone_progress(9, [3], 7, typical=1)
    np.testing.assert_allclose(progress[[3, 5, 7, 8]], [0.5, 0.75, 1.0, 1.0])
    assert progress[0] == pytest.approx(0.125)  # the state before step 0 is progress 0
    # a failed episode: 1/(K+1) per milestone reached, flat after, never 1
    failed = milestone_progress(8, [1, 4, 6], None, typical=2)
    assert failed.max() == pytest.approx(2 / 3) and failed[-1] == pytest.approx(2 / 3)
    assert failed[1] == pytest.approx(1 / 3)


def test_after_success_first_run_drops_what_follows_the_first_run_of_success_states():
    # episode 0 succeeds at t 2-3, fails again at 4-5 (the success undone) and succeeds again at 6;
    # episode 1 fails; episode 2 succeeds to its end; the rows come unordered in time
    success = {0: [0, 0, 1, 1, 0, 0, 1], 1: [0, 0, 0], 2: [0, 1, 1]}
    episode = np.array([e for e, labels in success.items() for _ in labels])
    time = np.array([t for labels in success.values() for t in range(len(labels))])
    labels = np.array([bool(v) for values in success.values() for v in values])
    order = np.random.default_rng(0).permutation(len(labels))
    n = len(labels)
    samples = RewardSamples(np.zeros((n, 2, 2, 3), np.uint8), np.arange(n, dtype=np.float32)[:, None], None,
                            labels, np.zeros(n, np.float32), episode, time).subset(order)
    kept = through_first_success_run(samples)
    rows = sorted(zip(kept.episode.tolist(), kept.time.tolist()))
    assert rows == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    # every kept row keeps its own labels and state
    assert all(kept.success[i] == bool(success[e][t]) for i, (e, t) in enumerate(zip(kept.episode, kept.time)))

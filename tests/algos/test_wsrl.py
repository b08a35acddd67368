"""The WSRL warm-start stages: warm-up (no updates) -> critic-only -> full, for every off-policy method.
(The residual SAC ordering test is tests/algos/test_sac.py::test_wsrl_stages_actor_unchanged_before_full_phase.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from embodied_rl.algos.dsrl import make_dsrl
from embodied_rl.algos.residual_offpolicy import ResidualOffPolicyConfig, ResidualOffPolicyLearner
from embodied_rl.algos.wsrl import CRITIC, FIRST_REACH, FULL, WARMUP, EarnedReach, WarmStart
from embodied_rl.errors import UserError
from embodied_rl.paths import config_dir
from tests.algos.test_dsrl import algo_cfg, make_vec_env, tiny_policy


def test_phases_in_order():
    stages = WarmStart(warmup_env_steps=100, critic_only_steps=50)
    assert [stages.phase(s) for s in (0, 99, 100, 149, 150, 10_000)] == [WARMUP, WARMUP, CRITIC, CRITIC, FULL, FULL]
    assert not stages.updates_critic(99) and stages.updates_critic(100)
    assert not stages.updates_actor(149) and stages.updates_actor(150)
    assert WarmStart(0, 0).phase(0) == FULL


def test_the_residual_reach_ramps_from_five_percent_after_the_critic_phase():
    ramp = WarmStart(warmup_env_steps=10, critic_only_steps=20, reach_ramp_steps=100)
    assert [ramp.reach(s) for s in (0, 29, 30, 35, 80, 130, 500)] == [0.05, 0.05, 0.05, 0.05, 0.5, 1.0, 1.0]
    assert WarmStart(10, 20).reach(0) == 1.0  # no ramp: the full scale throughout


def test_a_ramped_learner_bounds_its_residual_and_saves_the_bound():
    algo = ResidualOffPolicyConfig.from_cfg(OmegaConf.load(config_dir() / "algo" / "residual_offpolicy.yaml"))
    learner = ResidualOffPolicyLearner(algo, obs_dim=3, action_dim=2, device=torch.device("cpu"), seed=0)
    with torch.no_grad():  # a saturated residual network
        learner.actor.trunk[-1].bias.fill_(10.0)
    learner.set_reach(0.1)
    residual = learner.actor(torch.zeros(4, 3), torch.zeros(4, 2))
    assert torch.allclose(residual, torch.full((4, 2), 0.1 * algo.residual_scale))
    assert learner.config["residual_scale"] == 0.1 * algo.residual_scale  # agent.json acts with this bound


def test_a_ramped_td3_learner_explores_at_the_full_scale():
    """The ramp bounds what the actor does, not what the critic sees: TD3's exploration noise
    keeps its full-scale size (at 5% reach the critic would otherwise see only the BC actions
    and give the first actor updates an extrapolated slope: peg_insert's dip)."""
    algo = ResidualOffPolicyConfig.from_cfg(OmegaConf.load(config_dir() / "algo" / "residual_offpolicy.yaml"))
    learner = ResidualOffPolicyLearner(algo, obs_dim=3, action_dim=2, device=torch.device("cpu"), seed=0)
    learner.set_reach(0.05)
    torch.manual_seed(0)
    residual = learner.explore(torch.zeros(20000, 3), torch.zeros(20000, 2))  # the actor's own residual is 0
    full = algo.exploration_noise * algo.residual_scale
    assert abs(float(residual.std()) - full) < 0.05 * full
    assert float(residual.abs().max()) <= algo.residual_scale


def ended(earned, tag, successes, episodes):
    """`episodes` episodes of `tag` end, `successes` of them successful."""
    earned.record(torch.full((episodes,), tag), torch.arange(episodes) < successes)


def cohort(earned, successes, episodes=50):
    """`episodes` full-phase episodes start, then end, `successes` of them successful."""
    tag = earned.start(FULL, episodes)
    ended(earned, tag, successes, episodes)
    return tag


def baseline(earned, successes, episodes):
    tag = earned.start(CRITIC, episodes)
    assert tag == EarnedReach.BASELINE
    ended(earned, tag, successes, episodes)


def test_reach_past_the_free_part_is_earned_by_success_and_lost_by_harm():
    earned = EarnedReach(free_reach=0.4, window=50)
    assert earned.start(WARMUP, 50) == EarnedReach.IGNORED
    ended(earned, EarnedReach.IGNORED, 50, 50)  # warm-up episodes (no exploration noise) are not the baseline
    baseline(earned, 60, 100)
    assert earned.baseline == 0.6 and earned.cap == 0.4
    # margin: 2 sqrt(.24/100 + r(1-r)/50); 0.7 lies within it, 0.9 above, 0.4 below
    cohort(earned, 35)
    assert earned.cap == 0.4
    cohort(earned, 45)
    assert earned.cap == pytest.approx(0.6)
    cohort(earned, 20)
    assert earned.cap == pytest.approx(0.4)
    for _ in range(5):
        cohort(earned, 50)
    assert earned.cap == 1.0
    for _ in range(10):
        cohort(earned, 0)
    assert earned.cap == FIRST_REACH
    ended(earned, EarnedReach.BASELINE, 40, 40)  # critic-only episodes that end late still join the baseline
    assert earned.baseline_counts == [100.0, 140.0]


def test_a_cohort_is_judged_on_every_episode_that_started_in_it_not_on_the_first_to_end():
    earned = EarnedReach(free_reach=0.4, window=50)
    baseline(earned, 60, 100)
    first = earned.start(FULL, 30)
    earned.record(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool))
    second = earned.start(FULL, 30)  # the cohort is full (60 >= 50) only once these are counted
    ended(earned, first, 30, 30)  # the short episodes end first: successes
    ended(earned, second, 10, 20)  # the first 50 to end: 0.8 (above 0.6's margin); 10 of the cohort run on
    assert earned.cap == 0.4 and second == first
    later = earned.start(FULL, 64)  # the next cohort
    assert later != first
    ended(earned, first, 0, 10)  # the long failures: 40 / 60, within the margin of 0.6
    assert earned.cap == 0.4 and first not in earned.cohorts


def test_with_short_successes_and_no_change_in_success_the_cap_stays_where_it_was():
    # 64 envs; a success ends the episode after 25-59 steps, a failure at the limit (100): the first
    # episodes to end are mostly successes. Success is 0.6 before and after the actor starts.
    caps = []
    for seed in range(6):
        rng = np.random.default_rng(seed)
        earned = EarnedReach(free_reach=0.4, window=50)
        steps_left, success, tags = np.zeros(64, int), np.zeros(64, bool), np.full(64, EarnedReach.IGNORED)
        for step in range(800):
            done = steps_left == 0
            earned.record(torch.as_tensor(tags[done]), torch.as_tensor(success[done]))
            tags[done] = earned.start(CRITIC if step < 160 else FULL, int(done.sum()))
            success[done] = rng.random(int(done.sum())) < 0.6
            steps_left[done] = np.where(success[done], rng.integers(25, 60, int(done.sum())), 100)
            steps_left -= 1
        caps.append(earned.cap)
    assert max(caps) < 0.61, caps  # verdicts on the first episodes to end took it to 1.0 on most seeds


def test_a_cap_that_moves_drops_the_cohorts_under_way_and_the_state_round_trips():
    earned = EarnedReach(free_reach=0.4, window=50)
    baseline(earned, 60, 100)
    judged = earned.start(FULL, 50)
    earned.record(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool))
    under_way = earned.start(FULL, 40)  # started under the old cap
    ended(earned, judged, 50, 50)
    assert earned.cap == pytest.approx(0.6) and under_way not in earned.cohorts
    ended(earned, under_way, 0, 40)  # they count for nothing
    assert earned.cap == pytest.approx(0.6)
    earned.start(FULL, 7)
    restored = EarnedReach(free_reach=0.4, window=50)
    restored.load_state_dict(earned.state_dict())
    assert restored.state_dict() == earned.state_dict()
    written_before_cohorts = {"cap": 0.8, "full_regime": 3, "counts": {"baseline": [6.0, 10.0], "window": [1.0, 2.0]}}
    restored.load_state_dict(written_before_cohorts)
    assert (restored.cap, restored.baseline, restored.open_cohort) == (0.8, 0.6, 4)


def test_a_resume_that_loses_the_episodes_in_progress_drops_their_cohorts_and_verdicts_go_on():
    """EnvPool cannot snapshot its envs: a resumed run starts new episodes, and the ones in progress
    at the checkpoint never end. Their cohort would wait for them forever (no verdict again), so
    the resume drops the cohorts under way and the next cohorts are judged."""
    earned = EarnedReach(free_reach=0.4, window=50)
    baseline(earned, 60, 100)
    stopped = earned.start(FULL, 50)
    ended(earned, stopped, 40, 45)  # 5 episodes in progress at the checkpoint
    resumed = EarnedReach(free_reach=0.4, window=50)
    resumed.load_state_dict(earned.state_dict())
    stuck = EarnedReach(free_reach=0.4, window=50)  # what a resume without the drop did
    stuck.load_state_dict(earned.state_dict())
    resumed.drop_under_way()
    assert stopped not in resumed.cohorts
    for learner in (resumed, stuck):
        cohort(learner, 50)  # a clear gain over the baseline's 0.6
    assert resumed.cap == pytest.approx(0.6)
    assert stuck.cap == 0.4 and stopped in stuck.cohorts  # waits for episodes that will never end


def test_a_solved_task_keeps_its_free_reach_and_without_a_critic_phase_the_first_cohort_is_the_baseline():
    solved = EarnedReach(free_reach=0.4, window=10)
    baseline(solved, 40, 40)
    for _ in range(5):
        cohort(solved, 10, 10)  # cannot beat a baseline of 1
    assert solved.cap == 0.4
    cohort(solved, 6, 10)  # 0.6 < 1 - 2 sqrt(0.024): harm (0.8 lies within the margin)
    assert solved.cap == pytest.approx(0.2)
    direct = EarnedReach(free_reach=0.4, window=10)
    cohort(direct, 2, 10)
    assert direct.baseline == 0.2 and direct.cap == 0.4
    off = EarnedReach(free_reach=1.0, window=10)
    assert off.start(CRITIC, 10) == off.start(FULL, 10) == EarnedReach.IGNORED
    ended(off, EarnedReach.BASELINE, 0, 10)
    assert off.cap == 1.0 and off.baseline is None


def test_at_a_high_start_the_baseline_cannot_resolve_a_gain_of_a_few_points():
    """Why residual TD3/SAC judge on paired evaluations, not on training success: training episodes at .88 never beat a
    baseline of .88 on 60 episodes, and .96 against it only within a margin of ~8 points."""
    alone = EarnedReach(free_reach=0.2, window=50)
    baseline(alone, 53, 60)
    for _ in range(10):
        cohort(alone, 44, 50)
    assert alone.cap == pytest.approx(0.2)
    cohort(alone, 48, 50)
    assert alone.cap == pytest.approx(0.2)


def test_negative_lengths_are_user_errors():
    with pytest.raises(UserError):
        WarmStart(-1, 0)


@pytest.mark.parametrize("variant", ["dsrl", "dsrl_na"])
def test_dsrl_actor_fixed_in_warmup_and_critic_only(variant):
    vec_env = make_vec_env(tiny_policy())
    model = make_dsrl(algo_cfg(variant, warmup_env_steps=24, critic_only_steps=48), vec_env, seed=0)
    trained_critic = model.action_critic if variant == "dsrl_na" else model.critic  # DSRL-NA's default: Q_A only
    actor = [p.clone() for p in model.actor.parameters()]
    critic = [p.clone() for p in trained_critic.parameters()]
    model.learn(total_timesteps=4 * 2)  # 16 < 24 env steps: warm-up only
    assert vec_env.env_steps == 16
    assert all(torch.equal(a, b) for a, b in zip(critic, trained_critic.parameters()))  # no update at all
    assert len(model.replay_buffer.observations[: model.replay_buffer.pos]) == 2
    model.learn(total_timesteps=4 * 6, reset_num_timesteps=False)  # 64 < 72 env steps: critic-only
    assert all(torch.equal(a, b) for a, b in zip(actor, model.actor.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(critic, trained_critic.parameters()))
    model.learn(total_timesteps=4 * 3, reset_num_timesteps=False)  # full
    assert not all(torch.equal(a, b) for a, b in zip(actor, model.actor.parameters()))


def test_earned_reach_counts_the_success_the_learner_may_see():
    from embodied_rl.algos.wsrl import visible_success

    episode = {"success_once": torch.tensor([True, True, False, True])}
    assert visible_success({"episode": episode}).tolist() == [True, True, False, True]
    learned = {**episode, "learned_success_once": torch.tensor([False, True, False, False])}  # reward=model:PATH
    assert visible_success({"episode": learned}).tolist() == [False, True, False, False]


def test_the_sign_test_is_one_sided_over_the_discordant_pairs():
    from embodied_rl.algos.wsrl import sign_test

    assert sign_test(5, 0) == pytest.approx(1 / 32)
    assert sign_test(4, 0) == pytest.approx(1 / 16)  # four of four is not enough at 0.05
    assert sign_test(7, 1) == pytest.approx(9 / 256)
    assert sign_test(0, 0) == 1.0
    assert sign_test(0, 3) == 1.0


def test_judged_reach_deploys_the_training_reach_only_on_a_paired_win_and_gives_it_back_on_a_loss():
    from embodied_rl.algos.wsrl import JudgedReach

    judged = JudgedReach(0.2)
    assert judged.reach(0.1) == 0.1 and judged.reach(0.8) == 0.2  # below the floor the ramp is what acts
    # 95 vs 91 of 100 (4 discordant, all the training reach's): not resolved, the floor stays deployed
    floor = [True] * 91 + [False] * 9
    judged.judge(floor, [True] * 95 + [False] * 5)
    assert not judged.promoted
    # the same rates apart, counted only where one of the two failed: 5 of 5 is
    judged.judge(floor, [True] * 96 + [False] * 4)
    assert judged.promoted and judged.reach(0.8) == 0.8
    # ... and two episodes the training reach loses among six discordant do not take it back; 6 of 6 do
    judged.judge([True] * 96 + [False] * 4, [True] * 94 + [False] * 2 + [True] * 2 + [False] * 2)
    assert judged.promoted
    judged.judge([True] * 100, [True] * 94 + [False] * 6)
    assert not judged.promoted and judged.reach(0.8) == 0.2
    restored = JudgedReach(0.0)
    restored.load_state_dict(judged.state_dict())
    assert restored == judged


def test_the_judged_evaluation_reports_and_checkpoints_the_deployed_reach():
    """Two evaluations on the same episodes (floor, then training reach); the learner is left at the deployed
    reach, and the evaluation returned is the deployed one's."""
    from embodied_rl.algos.wsrl import JudgedEvaluation

    class Learner:
        reach = 0.1

        def set_reach(self, fraction):
            self.reach = fraction

    learner, calls = Learner(), []

    def evaluation(step, video_name=None):  # the training reach succeeds on 5 more episodes of 20
        calls.append((learner.reach, video_name))
        wins = 20 if learner.reach > 0.5 else 15
        episodes = [{"episode": k, "success": k < wins} for k in reversed(range(20))]
        return {"per_episode": episodes, "reach": learner.reach}, {"eval/success_rate": wins / 20}

    plain = JudgedEvaluation(evaluation, learner, None)  # algo.floor_reach null: the plain evaluation, nothing kept
    plain.train_reach = 0.8
    info, metrics = plain(10)
    assert calls == [(0.1, None)] and not plain.judges and plain.state_dict() is None
    assert plain.deployed_reach(0.8) == 0.8
    judged_evaluation = JudgedEvaluation(evaluation, learner, 0.2)
    assert judged_evaluation.judges and judged_evaluation.deployed_reach(0.8) == 0.2
    judged_evaluation.train_reach = 0.8
    info, metrics = judged_evaluation(20)
    assert calls[1:] == [(0.2, "step_20_reach_0.20"), (0.8, "step_20_reach_0.80")]
    assert info["reach"] == 0.8 and learner.reach == 0.8 and metrics["eval/deployed_reach"] == 0.8
    assert metrics["eval/floor_success_rate"] == 0.75 and metrics["eval/train_reach_success_rate"] == 1.0
    restored = JudgedEvaluation(evaluation, learner, 0.2)  # what a resumed run reads from the checkpoint
    restored.load_state_dict(judged_evaluation.state_dict())
    assert restored.deployed_reach(0.8) == 0.8 and restored.judged == judged_evaluation.judged


def test_judged_weights_deploy_the_current_weights_only_when_they_win_and_checkpoints_act_with_the_deployed(tmp_path):
    """The start is one plain evaluation; later ones score the deployed weights, then the current ones, on the same
    episodes. A tie keeps the deployed weights (what is reported and saved), however far training moved; a paired
    win copies the current ones; a later loss does not take them back. The actor always trains on its own weights."""
    from embodied_rl.algos.wsrl import JudgedWeights

    class Actor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.frozen = torch.nn.Parameter(torch.ones(1), requires_grad=False)
            self.register_buffer("count", torch.zeros(1))

        def save(self, directory):
            (directory / "w.txt").write_text(f"{float(self.w.detach()):g}")

    actor, calls = Actor(), []

    def evaluation(step, video_name=None):  # w = 0 succeeds on 10 of 20 episodes, w = 1 on all, w = 2 on 8
        calls.append((float(actor.w.detach()), video_name))
        wins = {0.0: 10, 1.0: 20, 2.0: 8}[float(actor.w.detach())]
        episodes = [{"episode": k, "success": k < wins} for k in reversed(range(20))]
        return {"per_episode": episodes, "w": float(actor.w.detach())}, {"eval/success_rate": wins / 20}

    judged = JudgedWeights(evaluation, actor, actor.save)
    assert judged(0)[0]["w"] == 0.0 and calls == [(0.0, None)]  # nothing trained yet: one evaluation
    with torch.no_grad():
        actor.w.fill_(2.0)  # trained, and worse: 2 paired losses, no win
    info, metrics = judged(10)
    assert calls[1:] == [(0.0, "step_10_deployed"), (2.0, "step_10_current")] and float(actor.w.detach()) == 2.0
    assert info["w"] == 0.0 and metrics["eval/deployed_success_rate"] == 0.5 and metrics["eval/deployed_step"] == 0
    judged.write_agent(tmp_path)
    assert (tmp_path / "w.txt").read_text() == "0" and float(actor.w.detach()) == 2.0
    with torch.no_grad():
        actor.w.fill_(1.0)  # 10 paired wins: p = 2^-10
    info, metrics = judged(20)
    assert info["w"] == 1.0 and metrics["eval/current_success_rate"] == 1.0 and metrics["eval/deployed_step"] == 20
    assert judged(20)[0]["w"] == 1.0 and len(calls) == 6  # the current weights are the deployed ones: one evaluation
    with torch.no_grad():
        actor.w.fill_(2.0)
    assert judged(30)[0]["w"] == 1.0  # the winner stays
    restored = JudgedWeights(evaluation, Actor(), None)
    restored.load_state_dict(judged.state_dict())
    assert restored.deployed_step == 20 and float(restored.deployed["w"]) == 1.0 and "frozen" not in restored.deployed
    assert set(restored.deployed) == {"w", "count"}

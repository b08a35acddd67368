"""The PPO loop's rollout: truncation bootstraps from final_obs, terminations do not; GRPO groups
share initial states and uninformative groups are masked out."""

import torch

from embodied_rl import core
from embodied_rl.actors.base import ActorOutput, HistoryEnv, ObsHistory
from embodied_rl.algos.ppo import collect_grpo, collect_ppo, explained_variance


class CountingEnv:
    """obs = [t, env id]; reward 1; env 0 is truncated at t=3, env 1 terminates at t=2."""

    num_envs, device, action_dim = 2, torch.device("cpu"), 1

    def __init__(self):
        self.t = torch.zeros(2)

    def obs(self):
        return torch.stack([self.t, torch.arange(2.0)], dim=1)

    def reset(self, seed=None, env_ids=None, group_size=None):
        self.t[:] = 0
        return self.obs(), {}

    def step(self, action):
        self.t += 1
        final_obs = self.obs()
        truncated = torch.tensor([bool(self.t[0] == 3), False])
        terminated = torch.tensor([False, bool(self.t[1] == 2)])
        done = truncated | terminated
        self.t[done] = 0
        info = {"final_obs": final_obs, "_final": done, "_episode": done, "success": terminated,
                "episode": {"return": torch.ones(2), "success_once": terminated}}
        return self.obs(), torch.ones(2), terminated, truncated, info


class ValueIsTimeActor:
    chunked = False
    n_obs_steps = 1

    def get_value(self, obs):
        return 10.0 * obs[:, 0]

    def next_value(self, obs):
        return self.get_value(obs)

    def act(self, obs, deterministic=False):
        return ActorOutput(torch.zeros(len(obs), 1), torch.zeros(len(obs), 1), self.get_value(obs), {"x": obs})

    def reset(self, mask):
        self.last_reset = mask


class EpisodeRecorder:
    """What collect_ppo reports to the FinetuneLoop: env steps and finished episodes."""

    def __init__(self):
        self.env_steps, self.returns = 0, []

    def advance(self, env_steps, info):
        self.env_steps += env_steps
        self.returns += info["episode"]["return"][info["_episode"]].tolist()


def test_truncation_bootstraps_from_the_final_observation():
    env = CountingEnv()
    obs, _ = env.reset()
    loop = EpisodeRecorder()
    batch, _ = collect_ppo(env, HistoryEnv(env, ObsHistory(1)), ValueIsTimeActor(), obs, 4, loop)
    # env 0: t = 0,1,2 then truncated at t=3 (final obs t=3 -> V=30), then t=0 again
    assert batch["truncated"][:, 0].tolist() == [0, 0, 1, 0]
    assert batch["next_value"][:, 0].tolist() == [10, 20, 30, 10]
    # env 1: terminated at t=2; its next_value is V(final obs) but GAE must not use it
    assert batch["terminated"][:, 1].tolist() == [0, 1, 0, 1]
    gamma = 0.9
    advantages, _ = core.gae(batch["reward"], batch["value"], batch["next_value"], batch["terminated"],
                             batch["truncated"], gamma, 1.0)
    assert advantages[2, 0] == torch.tensor(1 + gamma * 30 - 20)  # bootstrapped, not carried over
    assert advantages[1, 1] == torch.tensor(1 - 10.0)  # terminated: no bootstrap
    assert len(loop.returns) == 3 and loop.env_steps == 4 * env.num_envs


def test_sparse_reward_pays_one_on_the_step_that_succeeds():
    env = CountingEnv()
    obs, _ = env.reset()
    loop = EpisodeRecorder()
    batch, _ = collect_ppo(env, HistoryEnv(env, ObsHistory(1)), ValueIsTimeActor(), obs, 4, loop, sparse_reward=True)
    # env 1 "succeeds" (terminates) at t=2 and t=4; env 0 never does; stats keep the env return
    assert batch["reward"].tolist() == [[0, 0], [0, 1], [0, 0], [0, 1]]
    assert loop.returns == [1.0, 1.0, 1.0]


def test_grpo_groups_share_initial_states_and_filter_constant_groups():
    from embodied_rl import envs
    from embodied_rl.actors import make_actor
    from embodied_rl.policies import make_policy

    torch.manual_seed(0)
    policy = make_policy("flow", obs_dim=8, action_dim=2, n_obs_steps=1, horizon=4, n_action_steps=4,
                         num_inference_steps=2, backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))
    actor = make_actor("flow_noise", policy, 4, critic_hidden=8)
    env = envs.make("reach", num_envs=4, seed=0, task_options={"max_episode_steps": 12})
    henv = HistoryEnv(env, ObsHistory(1))
    batch, stats = collect_grpo(env, henv, actor, group_size=2, max_mdp_steps=4)
    first_obs = batch["obs"][0, :, -1]
    assert torch.equal(first_obs[0], first_obs[1]) and torch.equal(first_obs[2], first_obs[3])
    assert not torch.equal(first_obs[0], first_obs[2])
    returns = torch.tensor(stats["returns"])
    advantage = batch["advantage"][0]
    for g in (0, 1):
        pair = slice(2 * g, 2 * g + 2)
        if returns[pair][0] == returns[pair][1]:
            assert batch["valid"][:, pair].sum() == 0
        else:
            assert torch.allclose(advantage[pair].sum(), torch.tensor(0.0), atol=1e-5)
            assert (advantage[pair][returns[pair].argmax()] > 0)
    env.close()


def test_potential_shaping_pays_progress_and_skips_the_first_step_of_an_episode():
    from embodied_rl.algos.common import PotentialShaping

    shaping = PotentialShaping(coef=2.0, gamma=0.5)
    no, yes = torch.tensor([False]), torch.tensor([True])
    assert shaping(torch.tensor([0.4]), no).tolist() == [0.0]  # first step: potential unknown
    assert shaping(torch.tensor([0.8]), yes).tolist() == [2.0 * (0.5 * 0.8 - 0.4)]  # episode ends
    assert shaping(torch.tensor([0.1]), no).tolist() == [0.0]  # a new episode starts
    assert torch.allclose(shaping(torch.tensor([0.1]), no), torch.tensor([2.0 * (0.05 - 0.1)]))


def test_explained_variance_of_perfect_mean_and_constant_predictions():
    target = torch.tensor([0.0, 1.0, 2.0, 5.0])
    assert explained_variance(target.clone(), target) == 1.0
    assert abs(explained_variance(torch.full_like(target, 2.0), target)) < 1e-6  # the mean explains nothing
    assert explained_variance(-target, target) < 0  # worse than the mean
    assert explained_variance(target, torch.ones(4)) is None  # nothing to explain

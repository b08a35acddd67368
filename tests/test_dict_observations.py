"""Dict observations through fine-tuning. Language-conditioned policies: observations with a
per-env instruction go through the policy, every actor and critic, and every fine-tuning algorithm
(tiny scale: shapes, resets and checkpoints are under test, not learning), and collect ->
pretrain -> finetune keeps the instruction end to end. Pixel policies fine-tune on the camera
observations they were trained on."""

import json

import pytest
import torch

from embodied_rl import envs
from embodied_rl.actors import make_actor
from embodied_rl.cli import main
from embodied_rl.errors import UserError
from embodied_rl.policies import load_policy, make_policy, save_policy
from embodied_rl.policies.text import embed_instructions

TASK = "reach_choice"
ON_POLICY = {
    "residual_ppo": ["algo.num_steps=4", "algo.actor_kwargs.hidden=16"],
    "residual_ppo+obs_critic": ["algo.num_steps=4", "algo.actor_kwargs.hidden=16",
                                "algo.actor_kwargs.chunk_critic=false"],
    "residual_ppo+residual_chunk": ["algo.actor=residual_chunk", "~algo.actor_kwargs.chunk_critic", "algo.reward_shaping=0",
                                    "algo.num_steps=2", "algo.actor_kwargs.hidden=16"],
    "dppo": ["algo.num_steps=2"],
    "reinflow": ["algo.num_steps=2", "algo.actor_kwargs.noise_hidden=16"],
    "flow_sde": ["algo.num_steps=2"],
    "grpo": ["algo.num_steps=2", "algo.group_size=2"],
    "dsrl_ppo": ["algo.num_steps=2", "algo.actor_kwargs.hidden=16"],
}
OFF_POLICY = {
    "dsrl": ["algo.hidden_sizes=[16,16]", "algo.batch_size=16"],
    "dsrl_na": ["algo.hidden_sizes=[16,16]", "algo.batch_size=16"],
    "residual_offpolicy": ["algo.actor_hidden_sizes=[16,16]", "algo.critic_hidden_sizes=[16,16]", "algo.ensemble=2",
                           "algo.batch_size=16"],
    "residual_offpolicy+sac": ["algo=residual_offpolicy", "algo.learner=sac", "algo.actor_hidden_sizes=[16,16]",
                               "algo.critic_hidden_sizes=[16,16]", "algo.ensemble=2", "algo.batch_size=16"],
}


def tiny_policy(instructions, policy_type="flow"):
    torch.manual_seed(0)
    return make_policy(policy_type, obs_dim=8, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2,
                       num_inference_steps=2, task=TASK, instructions=instructions,
                       backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))


@pytest.fixture(scope="module")
def instructions():
    env = envs.make(TASK, num_envs=1)
    names = list(env.instructions)
    env.close()
    return names


def obs_history(n, instruction):
    torch.manual_seed(1)
    return {"state": torch.randn(n, 2, 8), "instruction": torch.full((n, 2), instruction, dtype=torch.long)}


def test_the_instruction_conditions_the_policy_and_its_features(instructions):
    policy = tiny_policy(instructions)
    assert policy.feature_dim == 8 + embed_instructions(instructions).shape[1]
    noise = torch.randn(3, 4, 2)
    red, blue = (policy.predict_chunk(obs_history(3, i), noise=noise) for i in (0, 1))
    assert not torch.allclose(red, blue)  # the same state, another instruction: another chunk
    step = {"state": torch.zeros(3, 8), "instruction": torch.tensor([0, 1, 1])}
    features = policy.obs_features(step)
    assert features.shape == (3, policy.feature_dim)
    assert torch.equal(features[1], features[2]) and not torch.equal(features[0], features[1])
    with pytest.raises(ValueError, match="instruction"):
        policy.predict_chunk({"state": torch.zeros(3, 2, 8)})  # the instruction is missing
    with pytest.raises(ValueError, match="instruction ids"):
        policy.obs_features({"state": torch.zeros(1, 8), "instruction": torch.tensor([2])})


def test_a_language_policy_checkpoint_round_trips_exactly(instructions, tmp_path):
    policy = tiny_policy(instructions)
    save_policy(policy, tmp_path / "bc")
    loaded = load_policy(tmp_path / "bc")
    assert loaded.instructions == instructions
    noise = torch.randn(2, 4, 2)
    obs = obs_history(2, 1)
    assert torch.equal(policy.predict_chunk(obs, noise=noise), loaded.predict_chunk(obs, noise=noise))


@pytest.mark.parametrize("kind", ["residual", "residual_chunk", "dppo", "flow_noise", "flow_sde", "latent_noise"])
def test_every_actor_reads_the_instruction(instructions, kind):
    """Two envs in the same state with different instructions get different values (the critic
    reads the policy's features), and the ratio is 1 before an update on dict observations."""
    policy = tiny_policy(instructions, "diffusion" if kind == "dppo" else "flow")
    actor = make_actor(kind, policy, 2)
    with torch.no_grad():
        for module in actor.critic.modules():  # a critic whose output depends on its input
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.normal_(module.weight)
    history = {"state": torch.zeros(2, 2, 8), "instruction": torch.tensor([[0, 0], [1, 1]])}
    obs = history if actor.chunked else {key: value[:, -1] for key, value in history.items()}
    out = actor.act(obs)
    assert out.value[0] != out.value[1]
    logprob, _ = actor.evaluate(obs, out.stash)
    assert torch.allclose(logprob, out.logprob, atol=1e-5)


def test_finetune_refuses_a_policy_trained_on_other_instructions(instructions, tmp_path, capsys):
    save_policy(tiny_policy(["reach the green target", "reach the blue target"]), tmp_path / "bc")
    code = main(["finetune", f"task={TASK}", f"checkpoint={tmp_path / 'bc'}", "algo=residual_ppo",
                 f"run_dir={tmp_path / 'run'}"])
    assert code == 2
    assert "instructions" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_every_algorithm_fine_tunes_a_language_conditioned_policy(instructions, tmp_path, capsys):
    save_policy(tiny_policy(instructions), tmp_path / "bc")
    common = [f"task={TASK}", f"checkpoint={tmp_path / 'bc'}", "num_envs=4", "eval_every=0", "eval_episodes=4",
              "videos=0"]
    for name, extra in ON_POLICY.items():
        algo = name.split("+")[0]
        run_dir = tmp_path / name
        assert main(["finetune", f"algo={algo}", "env_steps=16", f"run_dir={run_dir}", *common,
                     "algo.actor_kwargs.critic_hidden=16", *extra]) == 0, capsys.readouterr().err
        assert (run_dir / "checkpoints" / "last" / "agent.json").exists()
        assert main(["eval", f"checkpoint={run_dir}", "episodes=2", "num_envs=2", "videos=0",
                     f"run_dir={tmp_path / (name + '_eval')}"]) == 0, capsys.readouterr().err
    for name, extra in OFF_POLICY.items():
        algo = name.split("+")[0]
        run_dir = tmp_path / name
        assert main(["finetune", f"algo={algo}", "env_steps=48", f"run_dir={run_dir}", "algo.warmup_env_steps=16",
                     "algo.critic_only_steps=16", "algo.utd_ratio=0.25", *common, *extra]) == 0, \
            capsys.readouterr().err
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
        assert max(steps) >= 48
        assert main(["eval", f"checkpoint={run_dir}", "episodes=2", "num_envs=2", "videos=0",
                     f"run_dir={tmp_path / (name + '_eval')}"]) == 0, capsys.readouterr().err


@pytest.mark.e2e
def test_collect_pretrain_finetune_keep_the_instruction(tmp_path, capsys):
    """Demos record each step's instruction, pretraining builds a language-conditioned policy from
    them, and the residual off-policy learner mixes those demos (with their instructions) in."""
    data = tmp_path / "demos.zarr"
    assert main(["collect", f"task={TASK}", "demos=6", "num_envs=2", f"out={data}",
                 f"run_dir={tmp_path / 'collect'}"]) == 0, capsys.readouterr().err
    bc = tmp_path / "bc"
    assert main(["pretrain", f"task={TASK}", f"data={data}", "policy=flow", "steps=20", "batch_size=16",
                 "policy.horizon=4", "policy.n_action_steps=2", "policy.num_inference_steps=2",
                 "policy.mlp.hidden_dim=16", "policy.mlp.num_blocks=1", "eval_episodes=0", "videos=0",
                 f"run_dir={bc}"]) == 0, capsys.readouterr().err
    policy = load_policy(bc / "checkpoints" / "last")
    assert policy.instructions == ["reach the red target", "reach the blue target"]
    run_dir = tmp_path / "residual"
    assert main(["finetune", f"task={TASK}", f"checkpoint={bc}", "algo=residual_offpolicy", f"algo.data={data}",
                 "algo.demo_fraction=0.5", "env_steps=32", "algo.warmup_env_steps=8", "algo.critic_only_steps=8",
                 "algo.utd_ratio=0.25", "algo.batch_size=16", "algo.actor_hidden_sizes=[16,16]",
                 "algo.critic_hidden_sizes=[16,16]", "algo.ensemble=2", "num_envs=2", "eval_every=0",
                 "eval_episodes=2", "videos=0", f"run_dir={run_dir}"]) == 0, capsys.readouterr().err
    assert (run_dir / "checkpoints" / "last" / "agent.json").exists()


def test_an_unknown_text_encoder_is_refused():
    with pytest.raises(UserError, match="text encoder"):
        make_policy("flow", obs_dim=8, action_dim=2, instructions=["a"], text_encoder="nope")


@pytest.mark.parametrize("algo, extra", [
    ("residual_ppo", ["algo.num_steps=4", "algo.actor_kwargs.hidden=16", "algo.actor_kwargs.critic_hidden=16"]),
    ("dsrl", ["algo.hidden_sizes=[16,16]", "algo.batch_size=16", "algo.warmup_env_steps=16",
              "algo.critic_only_steps=0", "algo.utd_ratio=0.25"]),
])
@pytest.mark.e2e
def test_a_pixel_policy_fine_tunes_on_camera_observations(algo, extra, tmp_path, capsys):
    torch.manual_seed(0)
    policy = make_policy("flow", obs_dim=8, action_dim=2, n_obs_steps=2, horizon=4, n_action_steps=2,
                         num_inference_steps=2, task="reach", obs_mode="pixels", image_shape=[32, 32],
                         vision_kwargs=dict(feature_dim=8, channels=[8, 8, 8]),
                         backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))
    assert policy.env_options() == {"obs_mode": "pixels", "image_size": 32}
    save_policy(policy, tmp_path / "bc")
    run_dir = tmp_path / algo
    assert main(["finetune", "task=reach", f"checkpoint={tmp_path / 'bc'}", f"algo={algo}", "env_steps=32",
                 "num_envs=2", "eval_every=0", "eval_episodes=2", "videos=0", f"run_dir={run_dir}", *extra]) == 0, \
        capsys.readouterr().err
    assert (run_dir / "checkpoints" / "last" / "agent.json").exists()

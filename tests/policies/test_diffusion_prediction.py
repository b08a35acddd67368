"""DiffusionPolicy's network targets (epsilon, v, x0): predict_noise always returns epsilon."""

import pytest
import torch
from test_chunk_policies import ACTION_DIM, OBS_DIM, tiny_policy, toy_dataset

from embodied_rl.policies import load_policy, save_policy

PREDICTION_TYPES = ["epsilon", "v_prediction", "sample"]


@pytest.mark.parametrize("prediction_type", PREDICTION_TYPES)
def test_predict_noise_is_epsilon_for_every_target(prediction_type):
    policy = tiny_policy("diffusion", prediction_type=prediction_type).eval()
    x0 = torch.rand(6, *policy.noise_shape) * 2 - 1
    noise = torch.randn_like(x0)
    cond = policy.encode_obs(torch.randn(6, 2, OBS_DIM))
    t = torch.tensor([0, 10, 30, 50, 70, 90])
    x_t = policy.train_scheduler.add_noise(x0, noise, t)
    # an oracle network that outputs the exact target gives back the exact epsilon
    target = {"epsilon": noise, "sample": x0,
              "v_prediction": policy.train_scheduler.get_velocity(x0, noise, t)}[prediction_type]
    policy.net.forward = lambda x, times, c: target
    torch.testing.assert_close(policy.predict_noise(x_t, t, cond), noise, atol=2e-3, rtol=1e-3)
    assert policy.bc_loss({"obs": torch.randn(6, 2, OBS_DIM), "action": torch.zeros(6, 8, ACTION_DIM)}).ndim == 0


@pytest.mark.parametrize("prediction_type", PREDICTION_TYPES)
def test_chain_and_checkpoint_for_every_target(prediction_type, tmp_path):
    policy = tiny_policy("diffusion", prediction_type=prediction_type).eval()
    obs, noise = torch.randn(3, 2, OBS_DIM), torch.randn(3, *policy.noise_shape)
    cond = policy.encode_obs(obs)
    x = noise
    for i in range(policy.num_inference_steps):
        mean, std = policy.step_mean_std(x, i, cond, 0.0)
        x_next = policy.denoise_step(x, i, cond)
        torch.testing.assert_close(mean, x_next, atol=1e-5, rtol=1e-5)
        x = x_next
    torch.testing.assert_close(policy.unnormalize_action(x), policy.predict_chunk(obs, noise))
    save_policy(policy, tmp_path / "p")
    loaded = load_policy(tmp_path / "p")
    assert loaded.prediction_type == prediction_type
    assert torch.equal(loaded.predict_chunk(obs, noise), policy.predict_chunk(obs, noise))


def test_unknown_prediction_type():
    with pytest.raises(ValueError, match="prediction_type"):
        tiny_policy("diffusion", dataset=toy_dataset(), prediction_type="velocity")

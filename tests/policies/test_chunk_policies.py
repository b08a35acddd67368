"""ChunkPolicy contract for diffusion, flow and shortcut policies (tiny models)."""

import numpy as np
import pytest
import torch

from embodied_rl.data import ChunkWindows, DemoDataset, fit_normalizer
from embodied_rl.policies import make_policy

POLICY_TYPES = ["diffusion", "flow", "shortcut"]
OBS_DIM, ACTION_DIM = 3, 2


def toy_dataset(episodes=8, length=30, pixels=False, seed=0) -> DemoDataset:
    """Action = a smooth function of obs, plus a bimodal offset per episode."""
    rng = np.random.default_rng(seed)
    obs = rng.uniform(-1, 1, size=(episodes * length, OBS_DIM)).astype(np.float32)
    mode = np.repeat(rng.choice([-0.5, 0.5], size=episodes), length)[:, None]
    action = np.stack([np.sin(2 * obs[:, 0]), obs[:, 1] * obs[:, 2]], 1) + mode
    ends = np.arange(1, episodes + 1) * length
    pix = rng.integers(0, 255, size=(len(obs), 12, 12, 3), dtype=np.uint8) if pixels else None
    return DemoDataset("toy", obs, action.astype(np.float32), np.zeros(len(obs), np.float32), ends,
                       np.ones(episodes, bool), pix)


def tiny_policy(policy_type, dataset=None, backbone="mlp", **kwargs):
    dataset = dataset or toy_dataset()
    backbone_kwargs = {"hidden_dim": 32, "num_blocks": 2, "time_dim": 16} if backbone == "mlp" else \
        {"down_dims": [16, 32], "n_groups": 4, "time_dim": 16}
    torch.manual_seed(0)
    return make_policy(
        policy_type, obs_dim=OBS_DIM, action_dim=ACTION_DIM, normalizer=fit_normalizer(dataset),
        n_obs_steps=2, horizon=8, n_action_steps=4, backbone=backbone,
        backbone_kwargs=backbone_kwargs, num_inference_steps=4, **kwargs,
    )


@pytest.mark.parametrize("policy_type", POLICY_TYPES)
def test_predict_chunk_shape_and_determinism(policy_type):
    policy = tiny_policy(policy_type).eval()
    obs = torch.randn(5, 2, OBS_DIM)
    noise = torch.randn(5, *policy.noise_shape)
    assert policy.noise_shape == (8, ACTION_DIM)
    chunk = policy.predict_chunk(obs, noise)
    assert chunk.shape == (5, 8, ACTION_DIM) and chunk.dtype == torch.float32
    assert torch.equal(chunk, policy.predict_chunk(obs, noise.clone()))
    assert not torch.equal(chunk, policy.predict_chunk(obs))  # fresh noise differs
    # chunks are clipped to the action range seen in the data
    low, high = torch.tensor([-1.5, -1.5]), torch.tensor([1.5, 1.5])
    assert (chunk >= low).all() and (chunk <= high).all()
    with pytest.raises(ValueError, match="noise must be"):
        policy.predict_chunk(obs, torch.randn(5, 7, ACTION_DIM))
    with pytest.raises(ValueError, match="obs must be"):
        policy.predict_chunk(torch.randn(5, 3, OBS_DIM))


@pytest.mark.parametrize("policy_type", POLICY_TYPES)
def test_single_steps_reproduce_predict_chunk(policy_type):
    policy = tiny_policy(policy_type).eval()
    obs = torch.randn(4, 2, OBS_DIM)
    noise = torch.randn(4, *policy.noise_shape)
    with torch.no_grad():
        cond = policy.encode_obs(obs)
        x = noise
        assert len(policy.timesteps()) == policy.num_inference_steps
        for i in range(policy.num_inference_steps):
            mean, std = policy.step_mean_std(x, i, cond, 0.0)
            x_next = policy.denoise_step(x, i, cond)
            torch.testing.assert_close(mean, x_next, atol=1e-5, rtol=1e-5)
            assert torch.all(std == 0)
            _, std_noisy = policy.step_mean_std(x, i, cond, 0.7)
            assert std_noisy.shape == x.shape and torch.all(std_noisy >= 0)
            x = x_next
        assert torch.equal(policy.unnormalize_action(x), policy.predict_chunk(obs, noise))


def test_diffusion_step_mean_std_matches_diffusers_ddim_with_eta():
    policy = tiny_policy("diffusion").eval()
    obs, x = torch.randn(3, 2, OBS_DIM), torch.randn(3, 8, ACTION_DIM)
    with torch.no_grad():
        cond = policy.encode_obs(obs)
        for i in range(policy.num_inference_steps):
            t = policy.timesteps()[i]
            eps = policy.predict_noise(x, t, cond)
            z = torch.randn_like(x)
            expected = policy.scheduler.step(eps, t, x, eta=1.0, variance_noise=z).prev_sample
            mean, std = policy.step_mean_std(x, i, cond, 1.0)
            torch.testing.assert_close(mean + std * z, expected, atol=1e-5, rtol=1e-5)
    assert policy.timesteps().tolist() == [75, 50, 25, 0]


def test_flow_grid_and_shortcut_steps():
    flow = tiny_policy("flow")
    assert flow.timesteps().tolist() == [0.0, 0.25, 0.5, 0.75]
    shortcut = tiny_policy("shortcut")
    shortcut.set_num_inference_steps(1)
    assert shortcut.predict_chunk(torch.randn(2, 2, OBS_DIM)).shape == (2, 8, ACTION_DIM)
    with pytest.raises(ValueError, match="power of two"):
        shortcut.set_num_inference_steps(3)


@pytest.mark.parametrize("policy_type", POLICY_TYPES)
def test_bc_loss_decreases(policy_type):
    dataset = toy_dataset()
    policy = tiny_policy(policy_type, dataset)
    windows = ChunkWindows(dataset, policy.n_obs_steps, policy.horizon)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(80):
        loss = policy.bc_loss(windows.sample(64, generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert np.mean(losses[-15:]) < 0.7 * np.mean(losses[:15])


@pytest.mark.parametrize("policy_type", ["diffusion", "flow"])
def test_unet_backbone_and_pixels(policy_type):
    dataset = toy_dataset(episodes=2, length=10, pixels=True)
    policy = tiny_policy(policy_type, dataset, backbone="unet", obs_mode="pixels", image_shape=[12, 12],
                         vision_kwargs={"feature_dim": 8, "channels": [8, 8, 8], "n_groups": 4})
    windows = ChunkWindows(dataset, 2, 8, obs_mode="pixels")
    batch = windows.sample(4, torch.Generator().manual_seed(0))
    loss = policy.bc_loss(batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert policy.image_encoder.convs[0].weight.grad is not None
    policy.eval()
    obs = {"state": batch["obs"], "pixels": batch["pixels"]}
    noise = torch.randn(4, 8, ACTION_DIM)
    assert torch.equal(policy.predict_chunk(obs, noise), policy.predict_chunk(obs, noise))
    with pytest.raises(ValueError, match="pixels"):
        policy.predict_chunk(batch["obs"])

"""save_policy / load_policy round trip and corrupt checkpoints."""

import json

import pytest
import torch
from test_chunk_policies import OBS_DIM, tiny_policy

from embodied_rl.errors import UserError
from embodied_rl.policies import load_policy, save_policy


@pytest.mark.parametrize("policy_type", ["diffusion", "flow", "shortcut"])
def test_round_trip_predicts_identically(policy_type, tmp_path):
    policy = tiny_policy(policy_type, normalizer_mode="minmax", task="reach")
    with torch.no_grad():  # make weights non-trivial
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    policy.eval()
    obs, noise = torch.randn(3, 2, OBS_DIM), torch.randn(3, *policy.noise_shape)
    expected = policy.predict_chunk(obs, noise)
    save_policy(policy, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "config.json", "model.safetensors", "normalizer.safetensors"]
    loaded = load_policy(tmp_path / "ckpt")
    assert type(loaded) is type(policy) and loaded.task == "reach"
    assert loaded.config == policy.config
    assert torch.equal(loaded.predict_chunk(obs, noise), expected)
    save_policy(loaded, tmp_path / "ckpt")  # overwriting is atomic and keeps it loadable
    assert torch.equal(load_policy(tmp_path / "ckpt").predict_chunk(obs, noise), expected)


@pytest.fixture
def checkpoint(tmp_path):
    return save_policy(tiny_policy("flow"), tmp_path / "ckpt")


def test_missing_files(checkpoint, tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        load_policy(tmp_path / "nowhere")
    (checkpoint / "normalizer.safetensors").unlink()
    with pytest.raises(UserError, match="normalizer.safetensors is missing"):
        load_policy(checkpoint)
    (checkpoint / "config.json").unlink()
    with pytest.raises(UserError, match="config.json is missing"):
        load_policy(checkpoint)


def test_bad_json(checkpoint):
    (checkpoint / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_policy(checkpoint)
    (checkpoint / "config.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(UserError, match="format"):
        load_policy(checkpoint)


def test_truncated_safetensors(checkpoint):
    model = checkpoint / "model.safetensors"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    with pytest.raises(UserError, match="corrupt or truncated"):
        load_policy(checkpoint)


def test_shape_mismatch_and_unknown_type(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["policy"]["backbone_kwargs"]["hidden_dim"] = 48
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="has shape") as error:
        load_policy(checkpoint)
    assert "\n" not in str(error.value)
    config["policy_type"] = "transformer"
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="unknown policy_type"):
        load_policy(checkpoint)
    config["policy_type"] = "flow"
    config["policy"]["horizon"] = 0
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="valid flow policy"):
        load_policy(checkpoint)

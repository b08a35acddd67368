"""The reward-model contract: (frames, state, instruction) -> success probability and progress in
[0, 1]; checkpoints that load back exactly and refuse damage in one line."""

import json

import pytest
import torch

from embodied_rl.errors import UserError
from embodied_rl.rewards import (
    REWARD_MODELS,
    load_reward_model,
    make_reward_model,
    save_reward_model,
)

SMALL = {"channels": [8, 8, 8], "feature_dim": 8, "hidden_dim": 16}


def frames(n, size=16, seed=0):
    return torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", sorted(REWARD_MODELS))
def test_judge_gives_a_probability_and_a_progress_per_env(kind):
    instructions = ["reach the red target", "reach the blue target"]
    model = make_reward_model(kind, task="reach_choice", image_size=16, obs_dim=8, instructions=instructions,
                              text_encoder="hash", use_state=True, **SMALL)
    model.train()
    out = model.judge(frames(5), torch.randn(5, 8), torch.tensor([0, 1, 0, 1, 1]))
    for value in (out.success_prob, out.progress):
        assert value.shape == (5,) and bool(((value >= 0) & (value <= 1)).all())
    assert model.training  # judge scores in eval mode and leaves the mode as it found it
    with pytest.raises(ValueError, match="reads 16x16 frames"):
        model.judge(frames(2, size=32), torch.randn(2, 8), torch.tensor([0, 1]))


def test_cnn_film_needs_instructions():
    with pytest.raises(UserError, match="cnn_film conditions on instructions"):
        make_reward_model("cnn_film", task="reach", image_size=16, obs_dim=8)
    with pytest.raises(UserError, match="unknown reward model kind 'mlp'"):
        make_reward_model("mlp", task="reach", image_size=16, obs_dim=8)


def test_a_checkpoint_loads_back_exactly_and_a_run_directory_stands_for_it(tmp_path):
    torch.manual_seed(0)
    model = make_reward_model("cnn", task="reach", image_size=16, obs_dim=8, use_state=True,
                              progress_labels="time", **SMALL).eval()
    model.state_mean.fill_(0.5)
    save_reward_model(model, tmp_path / "run" / "reward_model")
    loaded = load_reward_model(tmp_path / "run")  # a train-reward run directory
    assert loaded.kind == "cnn" and loaded.task == "reach" and loaded.config["progress_labels"] == "time"
    x, state = frames(3), torch.randn(3, 8)
    for a, b in zip(vars(model.judge(x, state)).values(), vars(loaded.judge(x, state)).values()):
        torch.testing.assert_close(a, b)


def test_a_damaged_checkpoint_is_one_line(tmp_path):
    path = save_reward_model(make_reward_model("cnn", task="reach", image_size=16, obs_dim=8, **SMALL), tmp_path / "m")
    weights = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(UserError, match="model.safetensors is corrupt or truncated"):
        load_reward_model(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "kind": "transformer"}))
    with pytest.raises(UserError, match="unknown kind 'transformer'"):
        load_reward_model(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_reward_model(path)
    with pytest.raises(UserError, match="does not exist"):
        load_reward_model(tmp_path / "nowhere")

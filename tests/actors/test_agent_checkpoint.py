"""Agent checkpoints: every kind written before the v1 format (tests/fixtures/checkpoints_v0, made
by make_checkpoints_v0.py) loads and takes the actions it took then; v1 checkpoints written by
save_agent load the same; a bad checkpoint gets a one-line UserError."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from embodied_rl.actors import (
    AGENTS,
    LEGACY_ACTOR_DEFAULTS,
    load_agent,
    load_agent_tensors,
    read_agent_json,
    save_agent,
)
from embodied_rl.actors.checkpoint import FORMAT
from embodied_rl.errors import UserError
from embodied_rl.eval.evaluate import seed_agent
from embodied_rl.policies import load_policy

FIXTURES = Path(__file__).parents[1] / "fixtures" / "checkpoints_v0"
NUM_ENVS, RESETS = 3, {3: [False, True, False], 5: [True, False, False]}  # as make_checkpoints_v0.py
FINETUNED = ["residual", "residual_chunk", "latent_noise", "dppo", "flow_noise", "flow_sde", "residual_sac",
             "residual_td3", "dsrl"]


def replay(path: Path, obs: torch.Tensor) -> torch.Tensor:
    """The actions the agent loaded from `path` takes on obs [T, N, D], as the fixtures were recorded."""
    agent = load_agent(path, num_envs=NUM_ENVS)
    seed_agent(agent, 0)
    torch.manual_seed(0)
    agent.reset(torch.ones(NUM_ENVS, dtype=torch.bool))
    actions = []
    for t in range(len(obs)):
        if t in RESETS:
            agent.reset(torch.tensor(RESETS[t]))
        actions.append(agent.act(obs[t]).float())
    return torch.stack(actions)


@pytest.mark.parametrize("name", ["bc_diffusion", "bc_flow", "bc_shortcut", *FINETUNED])
def test_checkpoints_written_before_v1_act_as_they_did(name):
    recorded = load_file(str(FIXTURES / name / "actions.safetensors"))
    torch.testing.assert_close(replay(FIXTURES / name, recorded["obs"]), recorded["actions"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", FINETUNED)
def test_v1_checkpoints_act_like_the_old_ones(name, tmp_path):
    kind, config, _ = read_agent_json(FIXTURES / name)
    assert kind in AGENTS
    base_policy = load_policy(FIXTURES / name / "base_policy")
    save_agent(tmp_path, kind, config, load_agent_tensors(FIXTURES / name), base_policy)
    spec = json.loads((tmp_path / "agent.json").read_text())
    assert spec == {"format": FORMAT, "kind": kind, "config": config}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent.json", "agent.safetensors", "base_policy"]
    recorded = load_file(str(FIXTURES / name / "actions.safetensors"))
    torch.testing.assert_close(replay(tmp_path, recorded["obs"]), recorded["actions"], rtol=0, atol=1e-6)


def test_a_checkpoint_without_a_later_default_builds_with_the_value_it_was_made_with(tmp_path):
    # dppo's constructor defaults moved to configs/algo/dppo.yaml's values; a config written
    # without them was built with the old ones (actors.LEGACY_ACTOR_DEFAULTS)
    kind, config, _ = read_agent_json(FIXTURES / "dppo")
    older = {key: value for key, value in config.items() if key not in LEGACY_ACTOR_DEFAULTS["dppo"]}
    save_agent(tmp_path, kind, older, load_agent_tensors(FIXTURES / "dppo"), load_policy(FIXTURES / "dppo" / "base_policy"))
    assert load_agent(tmp_path, num_envs=NUM_ENVS).actor.config() == config
    recorded = load_file(str(FIXTURES / "dppo" / "actions.safetensors"))
    torch.testing.assert_close(replay(tmp_path, recorded["obs"]), recorded["actions"], rtol=0, atol=1e-6)


def v1_copy(tmp_path: Path, name: str = "dppo") -> Path:
    kind, config, _ = read_agent_json(FIXTURES / name)
    path = tmp_path / "ckpt"
    save_agent(path, kind, config, load_agent_tensors(FIXTURES / name), load_policy(FIXTURES / name / "base_policy"))
    return path


def one_line_error(path: Path, match: str) -> None:
    with pytest.raises(UserError, match=match) as error:
        load_agent(path, num_envs=1)
    assert "\n" not in str(error.value)


def test_a_bad_checkpoint_is_one_line(tmp_path):
    path = v1_copy(tmp_path)
    (path / "agent.safetensors").write_bytes(b"not a safetensors file")
    one_line_error(path, "agent.safetensors is corrupt")
    (path / "agent.safetensors").unlink()
    one_line_error(path, "agent.safetensors is missing")

    path = v1_copy(tmp_path / "b")
    spec = json.loads((path / "agent.json").read_text())
    (path / "agent.json").write_text(json.dumps({**spec, "kind": "nope"}))
    one_line_error(path, "unknown agent kind 'nope'")
    (path / "agent.json").write_text(json.dumps({**spec, "format": "other/v9"}))
    one_line_error(path, "format")
    (path / "agent.json").write_text("{not json")
    one_line_error(path, "cannot read agent.json")
    # weights of one kind under another's config: the agent does not build
    (path / "agent.json").write_text(json.dumps({**spec, "config": {"ft_denoising_steps": 1}}))
    one_line_error(path, "dppo agent does not load")

    shutil.rmtree(path / "base_policy")
    (path / "agent.json").write_text(json.dumps(spec))
    one_line_error(path, "base_policy")


def test_an_unknown_legacy_loader_is_refused(tmp_path):
    (tmp_path / "agent.json").write_text('{"loader": "os:system", "kind": "residual"}')
    one_line_error(tmp_path, "unknown loader 'os:system'")


def test_a_corrupt_legacy_checkpoint_is_one_line(tmp_path):
    path = tmp_path / "dsrl"
    shutil.copytree(FIXTURES / "dsrl", path)
    tensors = load_file(str(path / "actor.safetensors"))
    save_file({k: v for k, v in tensors.items() if "qf0" not in k}, str(path / "actor.safetensors"))
    one_line_error(path, "dsrl agent does not load")

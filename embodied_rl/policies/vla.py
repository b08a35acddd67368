"""A small vision-language-action policy: a frozen pretrained sentence encoder, an image encoder
trained from scratch and FiLM-conditioned on the instruction, proprioception, and a
flow-matching action expert over action chunks.

    language = E[instruction]                     # frozen sentence embedding (policies/text.py,
                                                  # "minilm": all-MiniLM-L6-v2, 384-d), cached
    image    = FiLMImageEncoder(pixels, language) # per observation step: conv blocks whose
                                                  # GroupNorm outputs are scaled and shifted by
                                                  # linear maps of the language vector
    cond     = [state_1, image_1, ..., state_To, image_To, language]
    chunk    = flow matching (FlowPolicy): the residual-MLP velocity field, FiLM-conditioned
               on cond, integrated with K Euler steps from noise

The instruction embeddings are computed once, when the policy is built, for the task's
instruction list, and kept as the buffer `instruction_embeddings` (saved in model.safetensors), so
the text encoder never runs in the RL loop. The checkpoint names the encoder (`text_encoder`, and
`text_encoder_source`: package and version), not its weights; loading one rebuilds the policy,
which needs the encoder installed (a missing one is a one-line UserError). `add_instruction(text)`
encodes any other English instruction on the fly and appends its row (eval's `instruction=`).

Everything else is FlowPolicy's: deterministic sampling given noise, `denoise_step`,
`step_mean_std`, `bc_loss`, so Flow-Noise/ReinFlow, Flow-SDE, DSRL, residual PPO/TD3 and GRPO
apply unchanged; critics and heads read `obs_features` (normalised state, language-conditioned
image features, language vector). With obs_mode="state" (e.g. Meta-World) there is no image
encoder and the language conditions the action expert only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from embodied_rl.errors import UserError
from embodied_rl.policies import text
from embodied_rl.policies.base import Obs
from embodied_rl.policies.flow import FlowPolicy
from embodied_rl.policies.nets.vision import ImageEncoder


class FiLMImageEncoder(ImageEncoder):
    """ImageEncoder (conv blocks with GroupNorm, spatial softmax, projection) whose every block is
    FiLM-modulated by a conditioning vector: h = relu(norm(conv(x)) * (1 + scale) + shift), with
    (scale, shift) a linear map of it, initialised to zero (the plain encoder at the start)."""

    def __init__(self, image_shape: tuple[int, int] | list[int], condition_dim: int, **kwargs: Any):
        super().__init__(image_shape, **kwargs)
        blocks = list(self.convs)
        self.blocks = [tuple(blocks[k : k + 3]) for k in range(0, len(blocks), 3)]  # conv, norm, act
        self.film = nn.ModuleList(nn.Linear(condition_dim, 2 * conv.out_channels) for conv, _, _ in self.blocks)
        for layer in self.film:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, pixels: Tensor, condition: Tensor) -> Tensor:
        if tuple(pixels.shape[1:3]) != self.image_shape:
            h, w = self.image_shape
            raise UserError(f"the policy reads {h}x{w} images, got {pixels.shape[1]}x{pixels.shape[2]}")
        x = self.crop_images(pixels).permute(0, 3, 1, 2).float() / 255.0
        for (conv, norm, act), film in zip(self.blocks, self.film, strict=True):
            scale, shift = film(condition)[:, :, None, None].chunk(2, dim=1)
            x = act(norm(conv(x)) * (1 + scale) + shift)
        return self.project(self.keypoints(x))


class VLAPolicy(FlowPolicy):
    policy_type = "vla"

    def __init__(self, *args: Any, text_encoder: str = "minilm", text_encoder_source: dict | None = None,
                 **kwargs: Any):
        if not kwargs.get("instructions"):
            raise UserError("the vla policy needs a task with instructions (a language-conditioned task "
                            "such as tabletop, reach_choice or metaworld/MT10)")
        super().__init__(*args, text_encoder=text_encoder, **kwargs)
        # what made the embedding table: recorded on creation, kept as recorded when loaded
        self.config["text_encoder_source"] = dict(text_encoder_source or text.text_encoder_source(text_encoder))
        if self.image_encoder is not None:
            language_dim = self.instruction_embeddings.shape[1]
            self.image_encoder = FiLMImageEncoder(self.config["image_shape"], language_dim,
                                                  **self.config["vision_kwargs"])

    # ------------------------------------------------------------------ language
    def add_instruction(self, instruction: str) -> int:
        """The id of `instruction` among the policy's instructions, appending it (encoded now with the
        policy's text encoder) when it is new. For evaluation: the appended rows are not part of
        the checkpoint the policy was loaded from and are refused by save_policy's shape check."""
        if not isinstance(instruction, str) or not instruction.strip():
            raise UserError("an instruction must be a non-empty string")
        if instruction in self.instructions:
            return self.instructions.index(instruction)
        row = text.embed_instructions([instruction], self.config["text_encoder"])
        self.instruction_embeddings = torch.cat((self.instruction_embeddings, row.to(self.instruction_embeddings)))
        self.instructions.append(instruction)
        return len(self.instructions) - 1

    # ------------------------------------------------------------------ observations
    def _check_state(self, obs: Obs, shape: tuple[int, ...]) -> Tensor:
        state = self._entry(obs, "state")
        if tuple(state.shape[1:]) != shape:
            raise ValueError(f"obs['state'] must be [N, {', '.join(map(str, shape))}], got {list(state.shape)}")
        return state

    def encode_obs(self, obs: Obs) -> Tensor:
        """Obs history {"state": [N, To, D], "pixels": u8 [N, To, h, w, 3], "instruction": [N, To]}
        -> [N, cond_dim]: every step's normalised state and language-conditioned image features,
        then the latest instruction's embedding."""
        state = self._check_state(obs, (self.n_obs_steps, self.obs_dim))
        n = len(state)
        language = self._instruction_embedding(self._entry(obs, "instruction")[:, -1])
        steps = [self.normalizer.normalize("obs", state.float())]
        if self.image_encoder is not None:
            pixels = self._entry(obs, "pixels").flatten(0, 1)
            features = self.image_encoder(pixels, language.repeat_interleave(self.n_obs_steps, dim=0))
            steps.append(features.view(n, self.n_obs_steps, -1))
        return torch.cat([torch.cat(steps, dim=-1).flatten(1), language], dim=-1)

    def obs_features(self, obs: Obs) -> Tensor:
        """One observation per env -> [N, feature_dim]: normalised state, language-conditioned
        image features, instruction embedding."""
        state = self._check_state(obs, (self.obs_dim,))
        language = self._instruction_embedding(self._entry(obs, "instruction"))
        parts = [self.normalizer.normalize("obs", state.float())]
        if self.image_encoder is not None:
            parts.append(self.image_encoder(self._entry(obs, "pixels"), language))
        return torch.cat([*parts, language], dim=-1)

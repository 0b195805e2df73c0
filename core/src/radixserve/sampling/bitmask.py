"""Token bitmasks: int32 ``[B, ceil(V / 32)]``, bit ``t % 32`` of word ``t // 32`` set
when token ``t`` is allowed (the layout xgrammar and llguidance fill)."""

from __future__ import annotations

import torch


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed int32 bitmask ``[batch_size, ceil(vocab_size / 32)]`` on CPU."""
    return torch.full((batch_size, bitmask_width(vocab_size)), -1, dtype=torch.int32)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set ``logits`` [B, V] to -inf wherever ``bitmask`` [B, W] forbids the token; in place.

    ``bitmask`` may live on the CPU; it is moved to the logits' device. Tokens beyond
    ``32 * W`` are forbidden."""
    batch, vocab = logits.shape
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = _BIT_SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _BIT_SHIFTS.setdefault(
            logits.device, torch.arange(32, dtype=torch.int32, device=logits.device))
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(batch, -1)  # [B, 32 * W]
    width = min(vocab, allowed.shape[1])
    logits[:, :width].masked_fill_(allowed[:, :width] == 0, float("-inf"))
    if width < vocab:
        logits[:, width:] = float("-inf")
    return logits


def set_bit(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Allow ``token`` in row ``row`` of an int32 token bitmask ``[B, ceil(V / 32)]``."""
    bit = 1 << (token % 32)
    if bit >= 1 << 31:  # int32 words: bit 31 is the sign bit
        bit -= 1 << 32
    bitmask[row, token // 32] |= bit

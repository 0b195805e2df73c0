"""Prompt logprobs: rows of logits reduced at once to the logprob of the token each row
predicts and the row's top-k, so no ``[T, V]`` log-softmax outlives the step."""

from __future__ import annotations

import torch


def prompt_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[list[float], list[tuple[list[int], list[float]]]]:
    """``log_softmax(logits)[i, targets[i]]`` per row, and (when ``k``) the row's ``k``
    most likely (ids, logprobs), highest first. ``logits`` is ``[M, V]`` float32,
    ``targets`` ``[M]`` int64 on the same device; ``logits`` is not modified."""
    lse = torch.logsumexp(logits, dim=-1)  # [M]
    chosen = logits.gather(1, targets.view(-1, 1)).view(-1) - lse  # [M]
    tops: list[tuple[list[int], list[float]]] = []
    if k:
        values, ids = logits.topk(k, dim=-1)  # [M, k]
        values = values - lse.view(-1, 1)
        tops = list(zip(ids.tolist(), values.tolist(), strict=True))
    return chosen.tolist(), tops

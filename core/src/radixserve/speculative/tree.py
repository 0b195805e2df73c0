"""Draft trees: tokens with parent indices, validated and turned into masks and depths.

A draft for one request is a list of tokens, each with the index of its parent; ``-1``
means the root, which is the request's last token (sampled but not yet run through the
model). A chain is the tree where token ``i``'s parent is ``i - 1``. Parents always come
before their children, so index order is a topological order.

In a verify step the root and the drafts are run as one extend of ``1 + len(tokens)`` new
tokens: node 0 is the root and node ``i + 1`` is draft token ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: `radixserve.speculative` (and a proposer plugin) loads without torch
    import torch


class DraftError(ValueError):
    """A proposer returned a draft that is not a valid tree."""


@dataclass
class Draft:
    """What a proposer suggests for one request.

    ``tokens``: the draft token ids. ``parents``: for each token, the index of its parent
    token in ``tokens`` or ``-1`` for the root (the request's last token); ``None`` means a
    chain (``[-1, 0, 1, ...]``).
    """

    tokens: list[int]
    parents: list[int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def node_parents(self) -> list[int]:
        """Parents over the verify nodes (node 0 the root, node i + 1 token i); root: -1."""
        if self.parents is None:
            return [-1] + list(range(len(self.tokens)))
        return [-1] + [p + 1 for p in self.parents]


def validate(draft: Draft, vocab_size: int, max_tokens: int) -> Draft:
    """``draft`` checked (token ids, parent order) and cut to ``max_tokens`` tokens (a cut
    keeps every kept token's ancestors, since parents come first)."""
    tokens = list(draft.tokens)
    parents = None if draft.parents is None else list(draft.parents)
    if parents is not None and len(parents) != len(tokens):
        raise DraftError(f"a draft has {len(tokens)} tokens but {len(parents)} parents")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise DraftError(f"draft token {i} is {t!r}, not a token id in [0, {vocab_size})")
        if parents is not None:
            p = parents[i]
            if isinstance(p, bool) or not isinstance(p, int) or not -1 <= p < i:
                raise DraftError(f"draft token {i} has parent {p!r}; parents must be -1 (the root) "
                                 f"or the index of an earlier token")
    tokens = tokens[:max_tokens]
    if parents is not None:
        parents = parents[:max_tokens]
        if parents == list(range(-1, len(parents) - 1)):
            parents = None  # a chain after all
    return Draft(tokens, parents)


def depths(node_parents: list[int]) -> list[int]:
    """Depth of every node (the root is 0)."""
    out = []
    for p in node_parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def ancestor_mask(node_parents: list[int]) -> torch.Tensor:
    """``[N, N]`` bool: row ``a`` marks ``a`` and its ancestors."""
    import torch

    n = len(node_parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for a, p in enumerate(node_parents):
        if p >= 0:
            mask[a] = mask[p]
        mask[a, a] = True
    return mask


def children(node_parents: list[int]) -> list[list[int]]:
    """The child nodes of every node, in index order."""
    kids: list[list[int]] = [[] for _ in node_parents]
    for a, p in enumerate(node_parents):
        if p >= 0:
            kids[p].append(a)
    return kids


def path_tokens(node_parents: list[int], node_tokens: list[int], node: int) -> list[int]:
    """Tokens from the root's first child down to ``node`` (empty for the root)."""
    out = []
    while node > 0:
        out.append(node_tokens[node])
        node = node_parents[node]
    return out[::-1]

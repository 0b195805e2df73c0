"""The draft-model base's bookkeeping: which positions of a request have draft K/V, the nodes
of its last draft already computed, and one drafting level's forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Computed:
    """Nodes of a request's last draft whose draft K/V exist (the root's excluded)."""

    root: int  # the root's position
    epoch: int  # scratch epoch of the draft (-1: every slot is the target's)
    children: dict[tuple[int, int], tuple[int, int]]  # (parent node, token) -> (node, slot); root = -1


@dataclass
class _State:
    valid: int  # positions [0, valid) have draft K/V
    computed: _Computed | None = None


@dataclass
class _Level:
    """One drafting level's forward: which requests ran, their nodes and slots."""

    act: list[int]  # batch indices of the requests that ran
    nodes: torch.Tensor  # [A, K] candidate index of each node run
    slots: torch.Tensor  # [A, K] its K/V slot

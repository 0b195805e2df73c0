"""The ``torch_native`` LoRA backend (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from radixserve.plugin_api.lora import LoRABackend


@dataclass
class _Groups:
    """Per adapter slot in the step: the rows that use it, as a slice when they are contiguous
    (the usual case: one request, or requests of one adapter side by side), else an index."""

    groups: list[tuple[int, slice | torch.Tensor]]


class TorchNativeLoRA(LoRABackend):
    name = "torch_native"

    def prepare(self, token_slots: torch.Tensor) -> _Groups:
        groups = []
        slots = token_slots.tolist()
        start = 0
        for t in range(1, len(slots) + 1):  # runs of equal slots
            if t == len(slots) or slots[t] != slots[start]:
                if slots[start] >= 0:
                    groups.append((slots[start], slice(start, t)))
                start = t
        by_slot: dict[int, list] = {}
        for s, rows in groups:
            by_slot.setdefault(s, []).append(rows)
        out = []
        for s, runs in by_slot.items():
            if len(runs) == 1:
                out.append((s, runs[0]))
            else:
                idx = torch.cat([torch.arange(r.start, r.stop) for r in runs]).to(token_slots.device)
                out.append((s, idx))
        return _Groups(out)

    def apply(self, x, out, a, b, scaling, info: _Groups) -> None:
        for s, rows in info.groups:
            xs = x[rows]
            if xs.dtype != a.dtype:
                xs = xs.to(a.dtype)
            delta = (xs @ a[s].T) @ b[s].T  # [n, R] then [n, N]
            delta.mul_(scaling[s])
            if isinstance(rows, slice):
                out[rows] += delta.to(out.dtype)
            else:
                out.index_add_(0, rows, delta.to(out.dtype))

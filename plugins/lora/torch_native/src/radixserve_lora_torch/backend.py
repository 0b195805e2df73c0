"""The ``torch_native`` LoRA backend (see the package docstring).

On CPU in float32, steps of up to :data:`KERNEL_MAX_ROWS` rows (decode, small mixed steps) take
each layer's deltas from the backend's C kernel (``lora_kernel.c``, :mod:`.kernel`) in one call:
per row its adapter's shrink and expands, rows split over threads. The step's work items sit
in fixed buffers, so the CPU decode graphs (kernel tapes) record these calls and replay them
with each step's adapters (``supports_cuda_graph``). Larger steps (prefill), other devices, or
no kernel: the PyTorch path below, whose matmuls are GEMMs at that size.

``prepare`` sorts the step's rows by slot once. A step whose adapter rows are one contiguous run
of one adapter (a single request, or a batch of one adapter) takes two plain matmuls per part.
Otherwise the rows are laid out as ``[U, M, K]`` (U adapters in the step, M the most rows of one,
shorter groups padded with row 0) and every layer runs one batched shrink for all its parts and
one batched expand per part, whatever U is: a few large calls instead of U small ones each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from radixserve.plugin_api.kernels import tape_recording
from radixserve.plugin_api.lora import LoRABackend


@dataclass
class _Plan:
    kernel: bool  # the C kernel's items are in the backend's buffers (kernel.Items)
    single: tuple[int, slice] | None  # (slot, rows): every adapter row in one run of one slot
    slots: torch.Tensor | None = None  # [U] the step's slots, ascending
    slot_range: slice | None = None  # the same as a slice when they are 0..U-1 (no gather of the stacks)
    index: torch.Tensor | None = None  # [U, M] rows of each slot, padded with row 0
    rows: torch.Tensor | None = None  # [n] the real rows, in [U, M] order with the padding left out
    keep: torch.Tensor | None = None  # [U * M] bool: which of the [U, M] places are real (None: all)


#: most rows a step may have for the C kernel (it reads each row's adapter once per row: at
#: prefill sizes the PyTorch path's GEMMs are faster)
KERNEL_MAX_ROWS = 64


class TorchNativeLoRA(LoRABackend):
    name = "torch_native"

    def __init__(self, ctx, use_kernel: bool = True) -> None:
        super().__init__(ctx)
        from radixserve_lora_torch import kernel

        self.kernel = kernel.load() if use_kernel and ctx.device.type == "cpu" else None
        self.items = kernel.Items(KERNEL_MAX_ROWS, self.kernel.item_rows) if self.kernel is not None else None
        self.supports_cuda_graph = self.kernel is not None  # a tape records the kernel's calls

    def prepare(self, token_slots: torch.Tensor) -> _Plan:
        slots = token_slots.tolist()
        items = self.items is not None and len(slots) <= KERNEL_MAX_ROWS
        if items:
            self.items.fill(slots)
        runs = []  # (slot, start, end) of each run of equal slots
        start = 0
        for t in range(1, len(slots) + 1):
            if t == len(slots) or slots[t] != slots[start]:
                if slots[start] >= 0:
                    runs.append((slots[start], start, t))
                start = t
        if len(runs) <= 1:  # (no run: no adapter row, nothing to add)
            return _Plan(items, (runs[0][0], slice(runs[0][1], runs[0][2])) if runs else None)
        by_slot: dict[int, list[int]] = {}
        for s, lo, hi in runs:
            by_slot.setdefault(s, []).extend(range(lo, hi))
        used = sorted(by_slot)
        width = max(len(v) for v in by_slot.values())
        dev = token_slots.device
        index = torch.tensor([by_slot[s] + [0] * (width - len(by_slot[s])) for s in used], dtype=torch.int64,
                             device=dev)
        keep = torch.tensor([[j < len(by_slot[s]) for j in range(width)] for s in used], device=dev).reshape(-1)
        rows = torch.tensor([r for s in used for r in by_slot[s]], dtype=torch.int64, device=dev)
        contiguous = used == list(range(len(used)))
        return _Plan(items, None, torch.tensor(used, dtype=torch.int64, device=dev),
                     slice(0, len(used)) if contiguous else None, index, rows, None if bool(keep.all()) else keep)

    def apply(self, x, outs, a, bs, scaling, info: _Plan) -> None:
        nothing = info.single is None and info.index is None  # no adapter row in the step
        if info.kernel and scaling.dtype == torch.float32 and self.kernel.fits(x, outs, a, bs):
            if nothing and not tape_recording():  # (a recorded call replays later steps' items)
                return
            if self.kernel.apply(x, outs, a, bs, scaling, self.items):
                return
        if nothing:
            return
        if info.single is not None:
            s, rows = info.single
            xs = x[rows].to(a.dtype)
            h = (xs @ a[s].T) * scaling[s]  # [n, P * R]
            r = a.shape[1] // len(bs)
            for p, (out, b) in enumerate(zip(outs, bs)):
                out[rows] += (h[:, p * r:(p + 1) * r] @ b[s]).to(out.dtype)
            return
        if info.index is None:
            return
        pick = info.slot_range if info.slot_range is not None else info.slots

        xg = x[info.index].to(a.dtype)  # [U, M, K]
        h = torch.bmm(xg, a[pick].transpose(1, 2))  # [U, M, P * R]
        h.mul_(scaling[pick].view(-1, 1, 1))
        r = a.shape[1] // len(bs)
        for p, (out, b) in enumerate(zip(outs, bs)):
            d = torch.bmm(h[..., p * r:(p + 1) * r], b[pick])  # [U, M, N_p]
            d = d.reshape(-1, d.shape[-1])
            if info.keep is not None:
                d = d[info.keep]
            out.index_add_(0, info.rows, d.to(out.dtype))

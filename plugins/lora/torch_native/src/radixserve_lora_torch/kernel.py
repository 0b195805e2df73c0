"""The backend's own CPU kernel (``lora_kernel.c``), built on first use with the core's kernel
builder; None where it cannot be (no compiler, kernels disabled, a build that fails), and the
backend keeps its PyTorch path.

A step's work items live in fixed buffers (:class:`Items`, one per backend) that ``prepare``
rewrites in place, count included, and every call passes plain addresses: so a kernel tape
(the CPU decode graph) that recorded the calls replays each later step's items."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from radixserve.plugin_api.kernels import load_cpu_library, tape_recording

SOURCE = Path(__file__).with_name("lora_kernel.c")


class Items:
    """A step's work items (see lora_kernel.c), for up to ``max_rows`` rows: ``order`` (the
    adapter rows grouped by slot), ``bounds`` (each item's first place in it, and the end),
    each item's slot, and how many items (``count[0]``; 0: no adapter row in the step)."""

    def __init__(self, max_rows: int, item_rows: int) -> None:
        self.max_rows, self.item_rows = max_rows, item_rows
        self.order = torch.zeros(max_rows, dtype=torch.int64)
        self.bounds = torch.zeros(max_rows + 1, dtype=torch.int64)
        self.slots = torch.zeros(max_rows, dtype=torch.int64)
        self.count = torch.zeros(1, dtype=torch.int64)
        self.ptrs = tuple(t.data_ptr() for t in (self.order, self.bounds, self.slots, self.count))

    def fill(self, token_slots: list[int]) -> int:
        """Write the items of a step whose rows use ``token_slots`` (at most ``max_rows``); their count."""
        by_slot: dict[int, list[int]] = {}
        for t, s in enumerate(token_slots):
            if s >= 0:
                by_slot.setdefault(s, []).append(t)
        order, bounds, slots = [], [0], []
        for s, rows in sorted(by_slot.items()):
            for i in range(0, len(rows), self.item_rows):
                order.extend(rows[i:i + self.item_rows])
                bounds.append(len(order))
                slots.append(s)
        if order:
            self.order[:len(order)] = torch.tensor(order, dtype=torch.int64)
            self.bounds[:len(bounds)] = torch.tensor(bounds, dtype=torch.int64)
            self.slots[:len(slots)] = torch.tensor(slots, dtype=torch.int64)
        self.count[0] = len(slots)
        return len(slots)


class LoRAKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.rs_lora_apply.argtypes = [p, i64, i64, p, p, p, p, p, i64, i64, p, p, p, i64, p]
        lib.rs_lora_apply.restype = None
        lib.rs_lora_item_rows.restype = ctypes.c_int
        lib.rs_lora_max_pr.restype = ctypes.c_int
        self.item_rows = lib.rs_lora_item_rows()
        self.max_pr = lib.rs_lora_max_pr()
        self.lib = lib
        self._stacks: dict[int, tuple] = {}  # id(a) -> (a, the bs' pointers, their widths): built once per layer
        self._kept: list = []  # output pointer arrays a recorded call reads at every replay

    def fits(self, x: torch.Tensor, outs: list[torch.Tensor], a: torch.Tensor, bs: list[torch.Tensor]) -> bool:
        """float32 CPU tensors in the layouts the kernel reads: x and the outputs with contiguous
        rows (one row stride for every part; the parts of one output), the stacks contiguous
        (the pool makes them so: checked once per layer, see :meth:`apply`), P * R within the
        kernel's limit."""
        out = outs[0]
        return (x.dtype == torch.float32 and out.dtype == torch.float32 and x.device.type == "cpu"
                and x.stride(1) == 1 and out.stride(1) == 1 and a.shape[1] <= self.max_pr)

    def apply(self, x, outs, a, bs, scaling, items: Items) -> bool:
        """Add the deltas in place (see lora_kernel.c) for the step's ``items``; False when the
        kernel cannot take it."""
        parts = len(bs)
        cached = self._stacks.get(id(a))
        if cached is None or cached[0] is not a:
            stacks = [a, *bs]
            if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in stacks):
                return False
            cached = (a, (ctypes.c_void_p * parts)(*[b.data_ptr() for b in bs]),
                      (ctypes.c_int64 * parts)(*[b.shape[2] for b in bs]))
            self._stacks[id(a)] = cached
        if any(o.stride(0) != outs[0].stride(0) for o in outs):
            return False
        o_ptrs = (ctypes.c_void_p * parts)(*[o.data_ptr() for o in outs])
        if tape_recording():
            self._kept.append(o_ptrs)
        order, bounds, slots, count = items.ptrs
        self.lib.rs_lora_apply(x.data_ptr(), x.stride(0), x.shape[1], order, bounds, slots, count, a.data_ptr(),
                               a.shape[1], parts, ctypes.addressof(cached[1]), ctypes.addressof(cached[2]),
                               ctypes.addressof(o_ptrs), outs[0].stride(0), scaling.data_ptr())
        return True


@functools.cache
def load() -> LoRAKernel | None:
    lib = load_cpu_library("torch_native_lora", [SOURCE])
    return LoRAKernel(lib) if lib is not None else None

"""The backend's own CPU kernel (``lora_kernel.c``), built on first use with the core's kernel
builder; None where it cannot be (no compiler, kernels disabled, a build that fails), and the
backend keeps its PyTorch path."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from radixserve.plugin_api.kernels import load_cpu_library

SOURCE = Path(__file__).with_name("lora_kernel.c")


class LoRAKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.rs_lora_apply.argtypes = [p, i64, i64, p, p, p, i64, p, i64, i64, p, p, p, i64, p]
        lib.rs_lora_apply.restype = ctypes.c_int
        lib.rs_lora_item_rows.restype = ctypes.c_int
        self.item_rows = lib.rs_lora_item_rows()
        self.lib = lib
        self._stacks: dict[int, tuple] = {}  # id(a) -> (a, the bs' pointers, their widths): built once per layer

    @staticmethod
    def fits(x: torch.Tensor, outs: list[torch.Tensor], a: torch.Tensor, bs: list[torch.Tensor]) -> bool:
        """float32 CPU tensors in the layouts the kernel reads: x and the outputs with contiguous
        rows (one row stride for every part; the parts of one output), the stacks contiguous
        (the pool makes them so: checked once per layer, see :meth:`apply`)."""
        out = outs[0]
        return (x.dtype == torch.float32 and out.dtype == torch.float32 and x.device.type == "cpu"
                and x.stride(1) == 1 and out.stride(1) == 1)

    def items(self, token_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's work items (see lora_kernel.c): ``order`` (the adapter rows grouped by slot),
        ``bounds`` (each item's first place in it, and the end) and each item's slot."""
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
        return (torch.tensor(order, dtype=torch.int64), torch.tensor(bounds, dtype=torch.int64),
                torch.tensor(slots, dtype=torch.int64))

    def apply(self, x, outs, a, bs, scaling, items) -> bool:
        """Add the deltas in place (see lora_kernel.c) for ``items`` (:meth:`items`); False when
        the kernel cannot take it."""
        parts = len(bs)
        cached = self._stacks.get(id(a))
        if cached is None or cached[0] is not a:
            stacks = [a, *bs]
            if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in stacks) \
                    or any(o.stride(0) != outs[0].stride(0) for o in outs):
                return False
            cached = (a, (ctypes.c_void_p * parts)(*[b.data_ptr() for b in bs]),
                      (ctypes.c_int64 * parts)(*[b.shape[2] for b in bs]))
            self._stacks[id(a)] = cached
        o_ptrs = (ctypes.c_void_p * parts)(*[o.data_ptr() for o in outs])
        order, bounds, slots = items
        return self.lib.rs_lora_apply(x.data_ptr(), x.stride(0), x.shape[1], order.data_ptr(), bounds.data_ptr(),
                                      slots.data_ptr(), slots.shape[0], a.data_ptr(), a.shape[1], parts, cached[1],
                                      cached[2], o_ptrs, outs[0].stride(0), scaling.data_ptr()) == 0


@functools.cache
def load() -> LoRAKernel | None:
    lib = load_cpu_library("torch_native_lora", [SOURCE])
    return LoRAKernel(lib) if lib is not None else None

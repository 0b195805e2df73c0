"""The runner's own CPU kernel (``grouped_linear.c``), built on first use with the core's kernel
builder; None where it cannot be (no compiler, kernels disabled, a build that fails), and the
runner keeps its PyTorch path. Weights are packed by the core's kernels
(``cpu_kernels.load().pack_grouped``)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from radixserve.plugin_api.kernels import load_cpu_library

SOURCE = Path(__file__).with_name("grouped_linear.c")


class GroupedLinearKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.rs_grouped_linear.argtypes = [p, p, i64, p, i64, i64, p]
        lib.rs_grouped_linear.restype = None
        self.lib = lib

    def grouped_linear(self, x: torch.Tensor, offsets: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """Rows ``offsets[g]:offsets[g + 1]`` of ``x  # [P, K]`` times group ``g`` of
        ``packed`` (from ``pack_grouped``) -> ``# [P, N]``; ``offsets  # [G + 1]`` int64,
        non-decreasing, ``offsets[-1] <= P`` (rows past it are left unwritten)."""
        m, k = x.shape
        y = torch.empty(m, n, dtype=torch.float32)
        self.lib.rs_grouped_linear(x.data_ptr(), offsets.data_ptr(), packed.shape[0], packed.data_ptr(), k, n,
                                   y.data_ptr())
        return y


@functools.cache
def load() -> GroupedLinearKernel | None:
    lib = load_cpu_library("torch_native_moe", [SOURCE])
    return GroupedLinearKernel(lib) if lib is not None else None

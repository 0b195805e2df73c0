"""The backend's own CPU kernel (``decode_attention.c``), built on first use with the core's
kernel builder; None where it cannot be (no compiler, kernels disabled, a build that fails),
and the backend keeps its PyTorch path."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from radixserve.plugin_api.kernels import load_cpu_library

SOURCE = Path(__file__).with_name("decode_attention.c")


class DecodeAttentionKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        lib.rs_decode_attention.argtypes = [p, i64, p, i64, p, i64, p, p, p, p, i64, p, p,
                                            i64, i64, i64, i64, f32, p]
        lib.rs_decode_attention.restype = None
        self.lib = lib

    def decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor,
                         v_buf: torch.Tensor, loc: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                         lens: torch.Tensor, scale: float) -> torch.Tensor:
        """Write ``k, v  # [B, Hkv, D]`` to the pool buffers ``[slots, Hkv, D]`` at ``loc``,
        then attend ``q  # [B, H, D]`` over each request's first ``lens[b]`` slots of
        ``table[rows[b]]``. q, k, v may be row views of a wider tensor (rows strided, heads
        contiguous); ``table`` and the int64 index tensors are contiguous. -> ``# [B, H, D]``."""
        b, h, d = q.shape
        out = torch.empty(b, h, d, dtype=torch.float32)
        self.lib.rs_decode_attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                     k_buf.data_ptr(), v_buf.data_ptr(), loc.data_ptr(), table.data_ptr(),
                                     table.stride(0), rows.data_ptr(), lens.data_ptr(), b, h, k.shape[1], d,
                                     scale, out.data_ptr())
        return out

    @staticmethod
    def rows_fit(*tensors: torch.Tensor) -> bool:
        """Whether each ``[N, heads, D]`` tensor has contiguous heads (only its rows strided),
        as the kernel expects (dtype and device are the caller's to check)."""
        for t in tensors:
            if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
                return False
        return True


@functools.cache
def load() -> DecodeAttentionKernel | None:
    lib = load_cpu_library("torch_native_attention", [SOURCE])
    return DecodeAttentionKernel(lib) if lib is not None else None

"""Linear layers and embedding lookups over GGUF-quantized weights (``gguf_kernels.c``).

:meth:`GGUFMatrix.prepare` rewrites an ``[N, K]`` weight stored as GGUF blocks, once at load,
into the kernels' layout: every type becomes ``w = s * q + o`` per group of 32 k (16 for
Q6_K) with float32 ``s, o`` and 4-, 5- or 8-bit ``q``, rows interleaved in panels of
``NR`` rows (see the C file; ``rs_gguf_pack`` builds it, :func:`pack_reference` is the same
layout in numpy, kept as its reference). Nothing is dequantised to memory: small batches (M <= 8)
read the quantized bytes once and multiply in registers; larger ones dequantise one
``[K, NR]`` panel at a time into a per-thread buffer and run the float32 panel product.
Every dequantised weight equals ``gguf.quants.dequantize``'s value to the bit; results
differ from a float64 ``x @ w.T`` only by float32 accumulation (~1e-7 relative to
``|x| @ |w|.T``; the tests allow 1e-5). The float32 ``s, o`` per group cost some bytes
over the file's: resident size / GGUF size is 1.33 (Q4_0, Q4_K), 1.2 (Q4_1), 1.27 (Q5_0,
Q5_K), 1.17 (Q5_1), 1.06 (Q8_0), 1.52 (Q6_K, kept as int8).

:func:`dequant_rows` reads rows of the raw GGUF data as stored (an embedding table).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from radixserve.kernels import tape
from radixserve.kernels.cpu import CpuKernels

# GGMLQuantizationType values (gguf.constants), kept here so the kernels need no gguf import.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
KERNEL_TYPES: frozenset[int] = frozenset({Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K})
# float16/bfloat16 weights stay 16-bit too (radixserve.kernels.woq.F16Matrix / BF16Matrix widen
# them in registers; the token embedding widens the rows it looks up)
F16, BF16 = 1, 30
HALF_TYPES = {F16: torch.float16, BF16: torch.bfloat16}

# qtype -> (weights per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES
_BLOCK = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
          Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
_FMT_U4, _FMT_U5, _FMT_I8 = 0, 1, 2
_FORMAT = {Q4_0: (_FMT_U4, 32), Q4_1: (_FMT_U4, 32), Q4_K: (_FMT_U4, 32),
           Q5_0: (_FMT_U5, 32), Q5_1: (_FMT_U5, 32), Q5_K: (_FMT_U5, 32),
           Q8_0: (_FMT_I8, 32), Q6_K: (_FMT_I8, 16)}


# bit of k = 8c + j's fifth bit in a U5 row word: 4 (j % 4) + 4 + shift[2c + (j >= 4)]
_U5_SHIFT = (-4, -3, -2, -1, 12, 13, 14, 15)
_U5_BIT = np.array([4 * (j % 4) + 4 + _U5_SHIFT[2 * c + j // 4] for c in range(4) for j in range(8)], np.uint32)
assert sorted(_U5_BIT.tolist()) == list(range(32))


def _bind(kernels: CpuKernels) -> ctypes.CDLL:
    lib = kernels.lib
    if not getattr(lib, "_rs_gguf_bound", False):
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.rs_gguf_linear.argtypes = [i32, i64, p, i64, i64, p, i64, p, p]
        lib.rs_gguf_linear.restype = None
        lib.rs_gguf_dequant_rows.argtypes = [i32, p, i64, p, i64, i64, p]
        lib.rs_gguf_dequant_rows.restype = None
        lib.rs_gguf_panel_bytes.argtypes = [i32, i64, i64]
        lib.rs_gguf_panel_bytes.restype = i64
        lib.rs_gguf_pack.argtypes = [i32, p, i64, i64, i64, p]
        lib.rs_gguf_pack.restype = i32
        lib._rs_gguf_bound = True
    return lib


def _check(qtype: int, data: torch.Tensor, k: int) -> None:
    if qtype not in KERNEL_TYPES:
        raise ValueError(f"no GGUF kernel for quantization type {qtype}")
    block, size = _BLOCK[qtype]
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the type's block of {block}")
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != k // block * size:
        raise ValueError(f"expected uint8 [N, {k // block * size}] blocks, got {data.dtype} {list(data.shape)}")


def _f16(b: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] -> float32 [...] (every float16 is exact in float32)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _scale_min_k(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 packed bytes [..., 12] -> 6-bit scales and mins [..., 8]."""
    lo, mid, top = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([lo & 63, (top & 15) | (lo >> 6) << 4], axis=-1)
    mins = np.concatenate([mid & 63, (top >> 4) | (mid >> 6) << 4], axis=-1)
    return scale, mins


def _unpack(qtype: int, raw: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """raw uint8 [N, row_bytes] -> (q [N, K] uint8 (int8 for the I8 types), s [N, G], o [N, G])
    with w[n, g*GS + j] = s[n, g] * q[n, g*GS + j] + o[n, g] exactly as gguf computes it."""
    n = raw.shape[0]
    block, size = _BLOCK[qtype]
    b = raw.reshape(n, k // block, size)
    if qtype in (Q4_0, Q4_1, Q5_0, Q5_1):
        d = _f16(b[..., 0:2])
        off = 4 if qtype in (Q4_1, Q5_1) else 2
        if qtype in (Q5_0, Q5_1):
            qh = b[..., off:off + 4].copy().view(np.uint32)  # [N, G, 1]
            hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, G, 32]
            off += 4
        else:
            hi = 0
        qs = b[..., off:off + 16]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1) | (hi << 4) if qtype in (Q5_0, Q5_1) \
            else np.concatenate([qs & 15, qs >> 4], axis=-1)
        if qtype in (Q4_1, Q5_1):
            o = _f16(b[..., 2:4])
        else:
            o = d * np.float32(-8 if qtype == Q4_0 else -16)
        return q.reshape(n, k).astype(np.uint8), d, o
    if qtype == Q8_0:
        return b[..., 2:].copy().view(np.int8).reshape(n, k), _f16(b[..., 0:2]), None
    if qtype in (Q4_K, Q5_K):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        scale, mins = _scale_min_k(b[..., 4:16])
        qs = b[..., 48:176] if qtype == Q5_K else b[..., 16:144]  # [N, S, 128]
        q = np.stack([qs.reshape(n, -1, 4, 32) & 15, qs.reshape(n, -1, 4, 32) >> 4], axis=3)  # [N,S,4,2,32]
        q = q.reshape(n, -1, 8, 32)
        if qtype == Q5_K:
            qh = b[..., 16:48]  # [N, S, 32]
            q = q | (((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
        s = (d[..., None] * scale.astype(np.float32)).reshape(n, -1)
        o = -(dmin[..., None] * mins.astype(np.float32)).reshape(n, -1)
        return q.reshape(n, k).astype(np.uint8), s, o
    # Q6_K: ql [128], qh [64], int8 scales [16], d
    ql, qh = b[..., 0:128].reshape(n, -1, 2, 64), b[..., 128:192].reshape(n, -1, 2, 32)
    sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    lo = np.stack([ql & 15, ql >> 4], axis=3).reshape(n, -1, 2, 128)
    hi = np.stack([(qh >> sh) & 3 for sh in (0, 2, 4, 6)], axis=3).reshape(n, -1, 2, 128)
    q = ((lo | hi << 4).astype(np.int16) - 32).astype(np.int8).reshape(n, k)
    return q, (d[..., None] * sc).reshape(n, -1), None


def _pack(fmt: int, gs: int, q: np.ndarray, s: np.ndarray, o: np.ndarray | None, nr: int) -> np.ndarray:
    """(q, s, o) -> panels [P, G, group bytes] as gguf_kernels.c reads them."""
    n, k = q.shape
    groups, panels = k // gs, -(-n // nr)
    pad = panels * nr - n
    if pad:
        q = np.concatenate([q, np.zeros((pad, k), q.dtype)])
        s = np.concatenate([s, np.zeros((pad, groups), np.float32)])
        o = None if o is None else np.concatenate([o, np.zeros((pad, groups), np.float32)])

    def header(v: np.ndarray) -> np.ndarray:  # [Np, G] -> [P, G, NR * 4] bytes
        v = np.ascontiguousarray(v.astype(np.float32).reshape(panels, nr, groups).transpose(0, 2, 1))
        return v.view(np.uint8)

    parts = [header(s)]
    if fmt == _FMT_I8:
        qq = q.view(np.uint8).reshape(panels, nr, groups, gs).transpose(0, 2, 3, 1)
        parts.append(qq.reshape(panels, groups, gs * nr))
    else:
        parts.append(header(o))
        # one uint32 per row and 8 k: nibble j = the low 4 bits of q[k = 8c + j]
        qq = (q.reshape(panels, nr, groups, gs // 8, 8) & 15).astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))
        words = np.ascontiguousarray(qq.sum(axis=-1, dtype=np.uint32).transpose(0, 2, 3, 1))  # [P, G, c, NR]
        parts.append(words.view(np.uint8).reshape(panels, groups, -1))
        if fmt == _FMT_U5:  # a row's 32 fifth bits in one uint32, at gguf_kernels.c's u5_high positions
            hb = (q.reshape(panels, nr, groups, gs) >> 4).astype(np.uint32)
            words = (hb << _U5_BIT).sum(axis=-1, dtype=np.uint32).transpose(0, 2, 1)  # [P, G, NR]
            parts.append(np.ascontiguousarray(words).view(np.uint8).reshape(panels, groups, -1))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1))


_checked: set[int] = set()  # qtypes whose C packing was compared with pack_reference


def pack_reference(qtype: int, raw: np.ndarray, k: int, nr: int) -> np.ndarray:
    """The prepared layout built in numpy (what ``rs_gguf_pack`` must reproduce byte for byte):
    raw uint8 ``[N, row_bytes]`` -> uint8 ``[ceil(N / nr) * panel bytes]``."""
    fmt, gs = _FORMAT[qtype]
    n = raw.shape[0]
    step = max(nr, (1 << 24) // max(k, 1) // nr * nr)  # rows per slice: bounded temporaries
    parts = [_pack(fmt, gs, *_unpack(qtype, raw[r0:r0 + step], k), nr).reshape(-1) for r0 in range(0, n, step)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


class GGUFMatrix:
    """An [N, K] weight in GGUF blocks, ready for the kernels."""

    def __init__(self, kernels: CpuKernels, qtype: int, packed: torch.Tensor, n: int, k: int) -> None:
        self._lib = _bind(kernels)
        self.qtype, self.n, self.k = qtype, n, k
        self._fmt, self._gs = _FORMAT[qtype]
        self._packed = packed  # uint8, panels of NR rows (see gguf_kernels.c)

    @classmethod
    def prepare(cls, kernels: CpuKernels, qtype: int, data: torch.Tensor, k: int) -> GGUFMatrix:
        """``data``: uint8 ``[N, row_bytes]`` exactly as stored in the GGUF file. Packed in C
        (``rs_gguf_pack``); the first time each type is packed in a process, its first and last
        panels are checked against the numpy reference :func:`pack_reference`."""
        _check(qtype, data, k)
        lib = _bind(kernels)
        nr = kernels.panel_width
        fmt, gs = _FORMAT[qtype]
        n = data.shape[0]
        data = data.detach().cpu().contiguous()
        panel_bytes = lib.rs_gguf_panel_bytes(fmt, gs, k)
        # torch's allocator aligns to 64 bytes, so panels start on cache lines
        packed = torch.empty(-(-n // nr) * panel_bytes, dtype=torch.uint8)
        if n:
            got = lib.rs_gguf_pack(qtype, data.data_ptr(), data.shape[1], n, k, packed.data_ptr())
            if got != fmt:
                raise RuntimeError(f"rs_gguf_pack: format {got} for type {qtype}, expected {fmt}")
            if qtype not in _checked:  # Python and C layouts must agree
                raw = data.numpy()
                last = (n - 1) // nr * nr
                for r0 in sorted({0, last}):
                    ref = pack_reference(qtype, raw[r0:r0 + nr], k, nr)
                    if ref.size != panel_bytes or not np.array_equal(
                            ref, packed[r0 // nr * panel_bytes:(r0 // nr + 1) * panel_bytes].numpy()):
                        raise RuntimeError(f"GGUF panel layout mismatch (type {qtype}) at rows {r0}..")
                _checked.add(qtype)
        return cls(kernels, qtype, packed, n, k)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x  # [M, K]`` float32 contiguous -> ``# [M, N]`` (+ ``bias  # [N]``)."""
        m, k = x.shape
        if k != self.k:
            raise ValueError(f"x has K={k}, the weight K={self.k}")
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.to(torch.float32).contiguous()
        y = torch.empty(m, self.n, dtype=torch.float32)
        if m:
            self._lib.rs_gguf_linear(self._fmt, self._gs, self._packed.data_ptr(), self.n, k, x.data_ptr(), m,
                                     None if bias is None else bias.data_ptr(), y.data_ptr())
        return y

    def nbytes(self) -> int:
        """Bytes this object keeps resident."""
        return self._packed.numel()


def dequant_rows(kernels: CpuKernels, qtype: int, data: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ``ids  # [T]`` int64 of the raw GGUF ``data  # [N, row_bytes]`` -> float32 ``# [T, K]``,
    each value equal to gguf's ``dequantize``. ``ids`` must lie in ``[0, N)`` (checked)."""
    _check(qtype, data, k)
    lib = _bind(kernels)
    ids = ids.to(torch.int64).contiguous()
    if not tape.recording() and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= data.shape[0]):
        raise IndexError(f"row ids out of range [0, {data.shape[0]})")
    data = data.contiguous()
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    lib.rs_gguf_dequant_rows(qtype, data.data_ptr(), data.shape[1], ids.data_ptr(), ids.numel(), k, out.data_ptr())
    return out

"""Weight-only quantised linear layers on the CPU: float32 activations, weights stored as
per-channel int8, per-group int4 or bfloat16 (kernels in ``woq_kernels.c``).

Each matrix class quantises and packs a float32 ``[N, K]`` weight once (:meth:`prepare`) and then
multiplies float32 activations by it (:meth:`linear`). :meth:`dequantize` gives the float32
weight the kernel effectively multiplies by, the reference for tests. Stored formats:

- :class:`Int8Matrix`: ``q = round(w / scale)`` clamped to [-127, 127], one ``scale =
  absmax / 127`` per output row (float32); ``W = q * scale``.
- :class:`Int4Matrix`: per row and per group of ``group_size`` input columns (the last group of
  a row may be shorter when K is not a multiple), ``min`` = the group's minimum, ``scale =
  (max - min) / 15``, ``q = round((w - min) / scale)`` clamped to [0, 15]; ``W = q * scale + min``
  (scale and min float32). torchao's int4 weight-only form ``(q - 8) * scale + zero`` is the same
  with ``zero = min + 8 * scale``.
- :class:`BF16Matrix`: ``W = bfloat16(w)`` rounded to nearest even; activations stay float32
  (each panel row stores rows ``j`` and ``NR/2 + j`` side by side, so the kernel widens a pair
  with one shift and one mask).

Weights are packed in panels of ``NR`` output rows (the C library's panel width; 16 when there
are no kernels) so that a panel is one sequential stream, as for float32 ``rs_pack``. With
``kernels=None`` :meth:`linear` dequantises and calls ``F.linear``: the same stored values,
slower.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from radixserve.kernels.cpu import CpuKernels

_FALLBACK_PANEL_WIDTH = 16
INT4_GROUP_SIZES = (32, 64, 128, 256)


def _bind(kernels: CpuKernels) -> ctypes.CDLL:
    """The library with the ``rs_woq_*`` signatures declared (idempotent)."""
    lib = kernels.lib
    if not getattr(lib, "_woq_bound", False):
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.rs_woq_int8_linear.argtypes = [p, i64, i64, p, p, p, i64, p]
        lib.rs_woq_int4_linear.argtypes = [p, i64, i64, p, p, p, i64, p, i64, p]
        lib.rs_woq_bf16_linear.argtypes = [p, i64, i64, p, p, i64, p]
        lib.rs_woq_f16_linear.argtypes = [p, i64, i64, p, p, i64, p]
        lib.rs_half_rows.argtypes = [ctypes.c_int, p, i64, i64, i64, p, i64, p]
        for fn in (lib.rs_woq_int8_linear, lib.rs_woq_int4_linear, lib.rs_woq_bf16_linear, lib.rs_woq_f16_linear,
                   lib.rs_half_rows):
            fn.restype = None
        lib._woq_bound = True
    return lib


def _panel_width(kernels: CpuKernels | None) -> int:
    return _FALLBACK_PANEL_WIDTH if kernels is None else int(kernels.lib.rs_woq_panel_width())


def _check_weight(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    return weight.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _to_panels(rows: torch.Tensor, nr: int) -> torch.Tensor:
    """``[N, K, ...]`` -> ``[ceil(N / nr), K, nr, ...]`` (zero padded rows), contiguous."""
    n = rows.shape[0]
    pad = -n % nr
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])])
    return rows.reshape(-1, nr, *rows.shape[1:]).transpose(1, 2).contiguous()


def _from_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`_to_panels`: ``[P, K, nr, ...]`` -> ``[N, K, ...]``."""
    p, k, nr = panels.shape[:3]
    return panels.transpose(1, 2).reshape(p * nr, k, *panels.shape[3:])[:n]


class _WoqMatrix:
    """Shared parts: shape, kernels handle, argument checks."""

    n: int
    k: int

    def __init__(self, kernels: CpuKernels | None, n: int, k: int) -> None:
        self.kernels = kernels
        self._lib = None if kernels is None else _bind(kernels)
        self.n, self.k = n, k
        self.panel_width = _panel_width(kernels)

    def _check_x(self, x: torch.Tensor, bias: torch.Tensor | None) -> None:
        if x.dim() != 2 or x.shape[1] != self.k or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"x must be contiguous float32 [M, {self.k}], got {x.dtype} {tuple(x.shape)}")
        if bias is not None and (bias.shape != (self.n,) or bias.dtype != torch.float32
                                 or not bias.is_contiguous()):
            raise ValueError(f"bias must be contiguous float32 [{self.n}]")

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x  # [M, K]`` float32 contiguous -> ``# [M, N]`` float32."""
        self._check_x(x, bias)
        if self._lib is None:
            return F.linear(x, self.dequantize(), bias)
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        self._call(x, None if bias is None else bias.data_ptr(), y)
        return y

    def _call(self, x: torch.Tensor, bias_ptr: int | None, y: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define _call (see _WoqMatrix)")

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define dequantize (see _WoqMatrix)")

    def _stored(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError(f"{type(self).__name__} must define _stored (see _WoqMatrix)")

    def nbytes(self) -> int:
        """Resident bytes of the stored weight (packed values plus scales)."""
        return sum(t.numel() * t.element_size() for t in self._stored())

    def __repr__(self) -> str:
        path = "c" if self._lib is not None else "torch"
        return f"{type(self).__name__}(n={self.n}, k={self.k}, path={path}, nbytes={self.nbytes()})"


class Int8Matrix(_WoqMatrix):
    """Per-output-channel symmetric int8: ``W = q * scale[n]``, ``scale = absmax / 127``."""

    @classmethod
    def prepare(cls, kernels: CpuKernels | None, weight: torch.Tensor) -> Int8Matrix:
        w = _check_weight(weight)  # [N, K]
        self = cls(kernels, *w.shape)
        scale = w.abs().amax(dim=1) / 127  # [N]
        q = torch.round(w / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-127, 127).to(torch.int8)
        self.q = _to_panels(q, self.panel_width)  # [P, K, NR]
        self.scales = torch.zeros(self.q.shape[0] * self.panel_width)  # [P * NR], zero padded
        self.scales[: self.n] = scale
        return self

    def _call(self, x, bias_ptr, y):
        self._lib.rs_woq_int8_linear(x.data_ptr(), x.shape[0], self.k, self.q.data_ptr(),
                                     self.scales.data_ptr(), bias_ptr, self.n, y.data_ptr())

    def dequantize(self) -> torch.Tensor:
        return _from_panels(self.q, self.n).float() * self.scales[: self.n, None]

    def _stored(self):
        return self.q, self.scales


class Int4Matrix(_WoqMatrix):
    """Per-group asymmetric 4-bit: ``W = q * scale + min`` per (row, group of ``group_size``
    columns), ``q`` in 0..15, ``min`` the group minimum, ``scale = (max - min) / 15``."""

    @classmethod
    def prepare(cls, kernels: CpuKernels | None, weight: torch.Tensor, group_size: int = 128) -> Int4Matrix:
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
        w = _check_weight(weight)  # [N, K]
        self = cls(kernels, *w.shape)
        n, k, nr = self.n, self.k, self.panel_width
        self.group_size = group_size
        groups = -(-k // group_size)
        pad = groups * group_size - k
        # pad the last group with a copy of its last column: min and max stay those of the real columns
        wp = torch.cat([w, w[:, -1:].expand(n, pad)], dim=1) if pad else w
        wg = wp.view(n, groups, group_size)  # [N, G, gs]
        mn, mx = wg.amin(dim=2), wg.amax(dim=2)  # [N, G]
        scale = (mx - mn) / 15
        safe = torch.where(scale > 0, scale, 1.0)
        q = torch.round((wg - mn[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
        q = q.view(n, -1)[:, :k]  # [N, K]
        qp = _to_panels(q, nr)  # [P, K, NR]
        half = nr // 2
        self.q = (qp[..., :half] | (qp[..., half:] << 4)).contiguous()  # [P, K, NR/2]
        self.scales = _to_panels(scale, nr)  # [P, G, NR]
        self.mins = _to_panels(mn, nr)  # [P, G, NR]
        return self

    def _call(self, x, bias_ptr, y):
        self._lib.rs_woq_int4_linear(x.data_ptr(), x.shape[0], self.k, self.q.data_ptr(), self.scales.data_ptr(),
                                     self.mins.data_ptr(), self.group_size, bias_ptr, self.n, y.data_ptr())

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q  # [N, K]`` uint8 in 0..15, ``scale, min  # [N, G]`` float32."""
        q = torch.cat([self.q & 15, self.q >> 4], dim=2)  # [P, K, NR]
        return (_from_panels(q, self.n), _from_panels(self.scales, self.n), _from_panels(self.mins, self.n))

    def dequantize(self) -> torch.Tensor:
        q, scale, mn = self.unpacked()
        gs, k = self.group_size, self.k
        return q.float() * scale.repeat_interleave(gs, dim=1)[:, :k] + mn.repeat_interleave(gs, dim=1)[:, :k]

    def _stored(self):
        return self.q, self.scales, self.mins


class BF16Matrix(_WoqMatrix):
    """Weights as bfloat16 (round to nearest even); float32 activations and accumulation."""

    @classmethod
    def prepare(cls, kernels: CpuKernels | None, weight: torch.Tensor) -> BF16Matrix:
        # a bfloat16 weight (a bf16 checkpoint) is taken as it is, without a float32 copy
        w = weight.detach().cpu() if weight.dtype == torch.bfloat16 and weight.dim() == 2 else _check_weight(weight)
        self = cls(kernels, *w.shape)
        nr = self.panel_width
        # [P, K, NR] -> [P, K, NR/2, 2]: rows j and NR/2 + j side by side (one 32-bit lane in C)
        panels = _to_panels(w.to(torch.bfloat16), nr)
        self.q = panels.view(*panels.shape[:2], 2, nr // 2).transpose(2, 3).contiguous()
        return self

    def take_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids  # [T]`` of the weight as stored: ``# [T, K]`` bfloat16 (a tied token
        embedding looks its rows up here instead of keeping its own table)."""
        nr = self.panel_width
        j = ids % nr
        return self.q[ids // nr, :, j % (nr // 2), j // (nr // 2)]

    def _call(self, x, bias_ptr, y):
        self._lib.rs_woq_bf16_linear(x.data_ptr(), x.shape[0], self.k, self.q.data_ptr(), bias_ptr, self.n,
                                     y.data_ptr())

    def dequantize(self) -> torch.Tensor:
        panels = self.q.transpose(2, 3).reshape(*self.q.shape[:2], -1)  # [P, K, NR]
        return _from_panels(panels, self.n).float()

    def _stored(self):
        return (self.q,)


class F16Matrix(_WoqMatrix):
    """Weights kept as float16 (a float16 checkpoint's own values: nothing is rounded), widened
    to float32 in registers; float32 activations and accumulation. Half the bytes of float32."""

    @classmethod
    def prepare(cls, kernels: CpuKernels | None, weight: torch.Tensor) -> F16Matrix:
        if weight.dim() != 2:
            raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
        w = weight.detach().to(device="cpu", dtype=torch.float16)  # exact for a float16 weight
        self = cls(kernels, *w.shape)
        self.q = _to_panels(w, self.panel_width)  # [P, K, NR] float16
        return self

    def _call(self, x, bias_ptr, y):
        self._lib.rs_woq_f16_linear(x.data_ptr(), x.shape[0], self.k, self.q.data_ptr(), bias_ptr, self.n,
                                    y.data_ptr())

    def dequantize(self) -> torch.Tensor:
        return _from_panels(self.q, self.n).float()

    def take_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids  # [T]`` of the weight as stored: ``# [T, K]`` float16."""
        return self.q[ids // self.panel_width, :, ids % self.panel_width]

    def _stored(self):
        return (self.q,)


_HALF_FMT = {torch.float16: 3, torch.bfloat16: 2}  # WOQ_F16, WOQ_BF16 in woq_kernels.c


def half_rows(kernels: CpuKernels, source, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids  # [T]`` (int64) of a 16-bit weight widened to float32 ``# [T, K]``, in C: from
    an :class:`F16Matrix`/:class:`BF16Matrix`'s panels or a row-major float16/bfloat16 table
    ``[N, K]``. Ids outside ``[0, N)`` give zeros (callers check them first)."""
    lib = _bind(kernels)
    if isinstance(source, torch.Tensor):
        table, n, k, panels, dtype = source.contiguous(), source.shape[0], source.shape[1], 0, source.dtype
    else:
        table, n, k, panels = source.q, source.n, source.k, 1
        dtype = torch.float16 if isinstance(source, F16Matrix) else torch.bfloat16
    out = torch.empty(ids.shape[0], k, dtype=torch.float32)
    lib.rs_half_rows(_HALF_FMT[dtype], table.data_ptr(), n, k, panels, ids.data_ptr(), ids.shape[0], out.data_ptr())
    return out


# the matrix that keeps a 16-bit float weight as it is stored
HALF_MATRICES = {torch.float16: F16Matrix, torch.bfloat16: BF16Matrix}


def half_kernel_missing(dtype: torch.dtype) -> str | None:
    """Why this CPU's kernel build has no vectorised widening of ``dtype`` weights (float16 needs
    F16C or AVX-512, bfloat16 AVX2 or AVX-512; the build is ``-march=native``); None: it has."""
    flags = _cpu_flags()
    if isinstance(flags, str):
        return flags
    if dtype == torch.float16 and not ({"avx512f"} <= flags or {"avx", "f16c"} <= flags):
        return "the CPU has neither F16C nor AVX-512 (float16 would be widened one value at a time)"
    if dtype == torch.bfloat16 and not flags & {"avx2", "avx512f"}:
        return "the CPU has neither AVX2 nor AVX-512"
    return None


def _cpu_flags() -> set[str] | str:
    """The x86 flags of /proc/cpuinfo, or why there are none."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags: set[str] = set()
            for line in fh:
                if line.startswith("flags"):
                    flags.update(line.partition(":")[2].split())
    except OSError as exc:
        return f"cannot read /proc/cpuinfo: {exc}"
    return flags or "no x86 flags line in /proc/cpuinfo"


def cpu_has_native_bf16() -> tuple[bool, str]:
    """Whether this CPU has native bfloat16 dot products (AVX512_BF16 or AMX_BF16), from the
    flags in /proc/cpuinfo, with the reason."""
    flags = _cpu_flags()
    if isinstance(flags, str):
        return False, flags
    found = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if found:
        return True, f"/proc/cpuinfo flags include {', '.join(found)}"
    return False, "/proc/cpuinfo flags have neither avx512_bf16 nor amx_bf16"

"""Dense linear layer with CPU fast paths.

Weights are stored as ``[out, in]`` like ``nn.Linear``. On CPU in float32, :meth:`pack`
reorders them once for a faster kernel and frees the plain weight:

* radixserve's own kernel (:mod:`radixserve.kernels.cpu`) when it builds on this machine:
  weights in column panels that stream sequentially, ~1.8x oneDNN's read rate at batch 1
  and on par or better at batch 32 (measured in BENCHMARKS.md);
* otherwise oneDNN's blocked layout through ``torch.ops.mkldnn._linear_pointwise``
  (~1.2x BLAS at batch 1, ~2x at batches of 8-32).

Elsewhere (CUDA, half precision) the layer is plain ``F.linear``.

Tensor parallelism (:mod:`radixserve.distributed`) splits a layer over the ranks of a
replica; each rank holds and packs only its shard, so the fast paths above apply per rank:

* :class:`Linear`: replicated, every rank holds the whole layer (routers, small gates);
* :class:`ColumnParallelLinear`: output rows split; a fused layer (QKV, gate/up) splits each
  of its parts on its own, so a rank's shard is its q rows, k rows, v rows stacked;
* :class:`RowParallelLinear`: input columns split; each rank's output is a partial sum and
  one ``tp_all_reduce`` makes it whole (or the caller does, to share one reduction).

Every layer loads from the *full* checkpoint tensor (``load(name, tensor, part)``) and
keeps the rank's shard of it. On a single rank the shards are the whole layer and the
reduction is the identity: the same kernels run as without tensor parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed import get_parallel_state, split_range, tp_all_reduce
from radixserve.kernels import cpu as cpu_kernels


def _onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._packed: torch.Tensor | None = None  # oneDNN layout, replaces weight once packed
        self._panels: torch.Tensor | None = None  # radixserve kernel layout, ditto
        self._kernels: cpu_kernels.CpuKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._panels is not None:
            if x.dim() != 2 or not x.is_contiguous():
                x = x.reshape(-1, self.in_features).contiguous()
            return self._kernels.linear(x, self._panels, self.bias, self.out_features)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def path(self) -> str:
        """Which kernel runs the layer: 'radixserve', 'onednn' or 'torch'."""
        return "radixserve" if self._panels is not None else "onednn" if self._packed is not None else "torch"

    @torch.no_grad()
    def pack(self, use_kernels: bool = True) -> bool:
        """Switch to a CPU fast path when one applies (radixserve's kernel first, unless
        ``use_kernels`` is false, then oneDNN); frees the plain weight. Returns whether it
        did. Call once, after the weights are loaded and placed."""
        w = self.weight
        if w is None or w.device.type != "cpu" or w.dtype != torch.float32:
            return False
        probe = torch.randn(3, self.in_features)
        ref = F.linear(probe, w)
        tol = dict(rtol=1e-4, atol=1e-4 * float(ref.abs().max()) + 1e-6)
        kernels = cpu_kernels.load() if use_kernels else None
        if kernels is not None:
            panels = kernels.pack(w)
            if torch.allclose(kernels.linear(probe, panels, None, self.out_features), ref, **tol):
                self._panels, self._kernels, self.weight = panels, kernels, None
                return True
        if not _onednn_usable(w.device, w.dtype):
            return False
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        if not torch.allclose(got, ref, **tol):
            return False  # an unexpected oneDNN build: keep the plain path
        self._packed = packed
        self.weight = None
        return True

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, part: str | None = None) -> None:
        """Copy a checkpoint tensor (``[out, in]`` weight or ``[out]`` bias) into the layer.
        ``part`` names a part of a fused layer (:class:`ColumnParallelLinear`); a plain
        layer has none."""
        if part is not None:
            raise ValueError(f"checkpoint {name} part {part!r}: this layer is not fused")
        self._copy_rows(name, tensor, (0, self.out_features))

    def _copy_rows(self, name: str, tensor: torch.Tensor, rows: tuple[int, int]) -> None:
        """Copy ``tensor`` into output rows ``rows = (start, size)`` of this rank's layer."""
        start, size = rows
        dst = (self.bias if name == "bias" else self.weight).narrow(0, start, size)
        if dst.shape != tensor.shape:
            raise ValueError(f"checkpoint {name} of shape {tuple(tensor.shape)} does not fit "
                             f"{self.out_features}x{self.in_features} rows {start}:{start + size}")
        dst.copy_(tensor)


def even_shard(full: int) -> tuple[int, int, int]:
    """``(full, start, size)``: this rank's share of ``full`` rows or columns, split as evenly
    as possible over the tensor-parallel ranks in rank order."""
    state = get_parallel_state()
    return (full, *split_range(full, state.tp_size, state.tp_rank))


class ColumnParallelLinear(Linear):
    """Output rows split over the tensor-parallel ranks; the output stays split.

    The full layer is a stack of named ``parts`` (one part, or ``q_proj``/``k_proj``/``v_proj``
    of a fused QKV projection, ``gate_proj``/``up_proj`` of a fused gate/up); ``parts[name] =
    (full rows, first row held, rows held)``, and this rank's weight stacks the rows it holds
    of each part in that order. A one-part layer may use the empty name."""

    def __init__(self, in_features: int, parts: dict[str, tuple[int, int, int]], bias: bool = False) -> None:
        super().__init__(in_features, sum(size for _, _, size in parts.values()), bias)
        self.parts = dict(parts)
        self._offsets, offset = {}, 0
        for name, (full, start, size) in self.parts.items():
            if not (0 <= start and size >= 0 and start + size <= full):
                raise ValueError(f"part {name!r}: rows {start}:{start + size} outside its {full} rows")
            self._offsets[name] = offset
            offset += size

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, part: str | None = None) -> None:
        """Copy this rank's rows of the full checkpoint tensor of ``part`` (the only part
        when None)."""
        if part is None:
            if len(self.parts) != 1:
                raise ValueError(f"checkpoint {name}: a fused layer loads by part ({', '.join(self.parts)})")
            part = next(iter(self.parts))
        full, start, size = self.parts[part]
        if tensor.dim() == 0 or tensor.shape[0] != full:
            raise ValueError(f"checkpoint {name}{' (' + part + ')' if part else ''} of shape {tuple(tensor.shape)}: "
                             f"expected {full} rows")
        self._copy_rows(name, tensor.narrow(0, start, size), (self._offsets[part], size))


class RowParallelLinear(Linear):
    """Input columns split over the tensor-parallel ranks: the input is a column-parallel
    layer's split output, each rank's product is a partial sum, and ``tp_all_reduce`` adds
    them up. ``shard = (full columns, first column held, columns held)`` (default: an even
    split). The bias counts once: rank 0 holds it, the other ranks hold zeros.

    ``reduce_results=False`` leaves the sum to the caller, so a block whose output adds
    several row-parallel partial sums (shared and routed experts) reduces once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shard: tuple[int, int, int] | None = None, reduce_results: bool = True) -> None:
        full, start, size = shard if shard is not None else even_shard(in_features)
        if full != in_features or not (0 <= start and start + size <= full):
            raise ValueError(f"shard {shard} does not fit {in_features} input columns")
        super().__init__(size, out_features, bias)
        self.full_in_features, self.in_start = full, start
        self.reduce = reduce_results and get_parallel_state().tp_size > 1
        self._holds_bias = get_parallel_state().tp_rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # [T, out], this rank's partial sum
        return tp_all_reduce(y) if self.reduce else y

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, part: str | None = None) -> None:
        """Copy this rank's columns of the full checkpoint weight ``[out, in]`` (the bias
        on rank 0 only)."""
        if part is not None:
            raise ValueError(f"checkpoint {name} part {part!r}: this layer is not fused")
        if name == "bias":
            self._copy_rows(name, tensor if self._holds_bias else torch.zeros_like(tensor), (0, self.out_features))
            return
        if tensor.dim() != 2 or tensor.shape[1] != self.full_in_features:
            raise ValueError(f"checkpoint {name} of shape {tuple(tensor.shape)}: expected "
                             f"[{self.out_features}, {self.full_in_features}]")
        self._copy_rows(name, tensor.narrow(1, self.in_start, self.in_features), (0, self.out_features))

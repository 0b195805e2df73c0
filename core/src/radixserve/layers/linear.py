"""Dense linear layer with CPU fast paths.

Weights are stored as ``[out, in]`` like ``nn.Linear``. On CPU in float32, :meth:`pack`
reorders them once for a faster kernel and frees the plain weight:

* radixserve's own kernel (:mod:`radixserve.kernels.cpu`) when it builds on this machine:
  weights in column panels that stream sequentially, ~1.8x oneDNN's read rate at batch 1
  and on par or better at batch 32 (measured in BENCHMARKS.md);
* otherwise oneDNN's blocked layout through ``torch.ops.mkldnn._linear_pointwise``
  (~1.2x BLAS at batch 1, ~2x at batches of 8-32).

Elsewhere (CUDA, half precision) the layer is plain ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
    def load(self, name: str, tensor: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Copy a checkpoint tensor (``[out, in]`` weight or ``[out]`` bias) into output
        rows ``rows = (start, size)`` of this layer (the whole layer when None)."""
        start, size = rows if rows is not None else (0, self.out_features)
        dst = (self.bias if name == "bias" else self.weight).narrow(0, start, size)
        if dst.shape != tensor.shape:
            raise ValueError(f"checkpoint {name} of shape {tuple(tensor.shape)} does not fit "
                             f"{self.out_features}x{self.in_features} rows {start}:{start + size}")
        dst.copy_(tensor)

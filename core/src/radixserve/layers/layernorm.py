"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch
from torch import nn

from radixserve.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """``RMSNorm(x)``; with ``residual``, ``(RMSNorm(x + residual), x + residual)``.

    The CPU kernel normalises ``[T, dim]`` rows and updates ``residual`` in place; a norm over
    other shapes (Qwen3's per-head q/k norms, ``[T, H, D]``) is built with
    ``kernel=False`` and stays native."""

    def __init__(self, dim: int, eps: float, kernel: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = kernel

    def kernel_applies(self) -> bool:
        return self.kernel

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.kernels.rmsnorm(x, self.weight, self.eps)
        return self.kernels.rmsnorm(x, self.weight, self.eps, residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

"""Dense linear layer that stores its weight transposed, ``[in, out]``.

On CPU, BLAS multiplies a row vector by an ``[in, out]`` row-major matrix about 1.4x faster
than by the ``[out, in]`` layout of ``nn.Linear`` (decode at batch 1 is bound by reading
the weights, and the transposed layout streams them better), so every projection keeps
this layout. Checkpoints still use ``[out, in]``; :meth:`load` transposes.
"""

from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))  # [in, out]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight
        return torch.addmm(self.bias, x, self.weight)

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Copy a checkpoint tensor (``[out, in]`` weight or ``[out]`` bias) into
        output rows ``rows = (start, size)`` of this layer (the whole layer when None)."""
        start, size = rows if rows is not None else (0, self.out_features)
        if name == "bias":
            dst = self.bias.narrow(0, start, size)
            src = tensor
        else:
            dst = self.weight.narrow(1, start, size)
            src = tensor.t()
        if dst.shape != src.shape:
            raise ValueError(f"checkpoint {name} of shape {tuple(tensor.shape)} does not fit "
                             f"{self.out_features}x{self.in_features} rows {start}:{start + size}")
        dst.copy_(src)

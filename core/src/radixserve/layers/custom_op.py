"""Layers that choose their implementation once: :class:`CustomOp`.

A custom op has a plain PyTorch path (``forward_native``, the reference, on any device) and a
path over radixserve's compiled CPU kernels (``forward_cpu``, :mod:`radixserve.kernels.cpu`,
for float32 on CPU). :meth:`CustomOp.place` picks one when the model's weights are placed on
their device and dtype, and ``forward`` *is* that path from then on: no branch per call, and
the model that holds the op reads like a model definition. Before ``place`` (or where the
kernels do not build, or an op says they do not apply) the native path runs.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.kernels import cpu as cpu_kernels


class CustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kernels: cpu_kernels.CpuKernels | None = None
        self.forward = self.forward_native

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} defines no native path")

    def forward_cpu(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def kernel_applies(self) -> bool:
        """Whether the compiled CPU path can serve this instance (its shapes, its options)."""
        return True

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Choose the implementation for ``device`` and ``dtype``, once."""
        kernels = cpu_kernels.load() if device.type == "cpu" and dtype == torch.float32 else None
        self.kernels = kernels if kernels is not None and self.kernel_applies() else None
        self.forward = self.forward_cpu if self.kernels is not None else self.forward_native


def place_ops(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """:meth:`CustomOp.place` every custom op of ``model``."""
    for module in model.modules():
        if isinstance(module, CustomOp):
            module.place(device, dtype)

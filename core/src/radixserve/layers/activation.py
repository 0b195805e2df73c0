"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """``silu(gate) * up`` of a fused ``[T, 2I]`` gate/up output (gate first) -> ``[T, I]``."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)

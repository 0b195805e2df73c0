"""The ``triton`` MoE runner: :func:`~radixserve_moe_triton.fused_moe.fused_moe` behind the
:class:`~radixserve.layers.moe.MoERunner` contract."""

from __future__ import annotations

import torch
from radixserve.plugin_api.moe import ExpertWeights, MoEContext, MoERunner

from radixserve_moe_triton import kernels
from radixserve_moe_triton.fused_moe import MAX_PAIRS, BlockConfig, fused_moe


class TritonMoERunner(MoERunner):
    """Fused MoE in Triton. ``config`` fixes the block sizes (tests use it to put expert
    segments on block boundaries); by default they follow the batch (fused_moe.py)."""

    name = "triton"

    def __init__(self, ctx: MoEContext, *, config: BlockConfig | None = None,
                 max_pairs: int = MAX_PAIRS) -> None:
        super().__init__(ctx)
        if ctx.device.type == "cpu" and not kernels.INTERPRETED:
            raise RuntimeError(
                "the triton MoE runner got a CPU model, but its kernels were not built for "
                "Triton's interpreter: set TRITON_INTERPRET=1 before radixserve starts (before "
                "the triton kernels are imported), run on a GPU, or use "
                "--moe-runner-backend torch_native"
            )
        if ctx.activation != "silu":
            raise ValueError(f"the triton MoE runner fuses SiLU * up; activation "
                             f"{ctx.activation!r} is not supported (use torch_native)")
        self.config = config
        self.max_pairs = max_pairs

    def prepare(self, weights: ExpertWeights) -> ExpertWeights:
        """The kernels read the core's layout as it is (rows contiguous along the reduction
        dimension, which the tiles load through strides); only contiguity is ensured."""
        return ExpertWeights(weights.w13.contiguous(), weights.w2.contiguous())

    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, state: ExpertWeights) -> torch.Tensor:
        x = hidden_states
        if x.dtype != state.w13.dtype:
            return self.forward(x.to(state.w13.dtype), topk_ids, topk_weights, state).to(x.dtype)
        return fused_moe(x, state.w13, state.w2, topk_ids, topk_weights, self.config,
                         self.max_pairs)

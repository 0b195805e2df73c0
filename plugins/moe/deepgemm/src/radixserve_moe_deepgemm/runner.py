"""The ``deep_gemm`` MoE runner: two grouped GEMMs per layer with SwiGLU between.

A forward over ``N`` dispatched rows:

1. the valid (row, choice) pairs go into one of DeepGEMM's grouped layouts (:mod:`.layout`):
   the **masked** layout when ``N <= masked_max_rows`` (decode-sized batches: fixed shapes,
   no host sync), else the **contiguous** layout (prefill: no padding beyond the alignment,
   one host sync for the per-expert counts);
2. FP8: the rows are quantised per token and 128 channels (torch, :mod:`.layout`);
3. grouped GEMM 1: ``[rows, H] x w13[e].T -> [rows, 2I]`` (gate and up);
4. SwiGLU ``silu(gate) * up`` in float32 (torch), rows outside the layout's valid set zeroed
   (the library leaves them unspecified), re-quantised for FP8;
5. grouped GEMM 2: ``[rows, I] x w2[e].T -> [rows, H]``;
6. each pair's output times its routing weight, summed back per dispatched row (float32
   ``index_add_``), cast to the activations' dtype.

``prepare`` repacks a layer's weights once: BF16 casts them to ``bfloat16`` (the core's
``[E, 2I, H]`` / ``[E, H, I]`` layout is already DeepGEMM's K-major "NT" ``B``); FP8
quantises them to ``float8_e4m3fn`` with 128x128 block scales and hands the scales to the
kernels' :meth:`weight_scales`, which puts them in the layout the library reads.

The GEMMs come from a kernels object (:mod:`.kernels`): DeepGEMM's in production, a torch
loop with the same semantics in the CPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from radixserve.plugin_api.moe import ExpertWeights, MoEContext, MoERunner

from radixserve_moe_deepgemm import layout as L


@dataclass
class DeepGemmExperts:
    """One layer's experts as ``prepare`` left them."""

    w13: Any  # bf16 [E, 2I, H], or (fp8 [E, 2I, H], scales in the library's layout)
    w2: Any  # bf16 [E, H, I], or (fp8 [E, H, I], scales)
    num_experts: int
    intermediate_size: int


class DeepGemmMoERunner(MoERunner):
    name = "deep_gemm"

    def __init__(self, ctx: MoEContext, kernels: Any, *, masked_max_rows: int = 128) -> None:
        super().__init__(ctx)
        self.kernels = kernels
        self.fp8 = kernels.fp8
        self.masked_max_rows = masked_max_rows
        self.name = "deep_gemm" if self.fp8 else "deep_gemm_bf16"

    # ----------------------------------------------------------------- load time
    def _pack(self, w: torch.Tensor) -> Any:
        if not self.fp8:
            return w.to(torch.bfloat16).contiguous()
        q, scale = L.quantize_per_block(w, self.kernels.round_scale_pow2)
        return q, self.kernels.weight_scales(scale, w.shape[1], w.shape[2])

    def prepare(self, weights: ExpertWeights) -> DeepGemmExperts:
        return DeepGemmExperts(self._pack(weights.w13), self._pack(weights.w2), weights.w13.shape[0],
                               weights.intermediate_size)

    # --------------------------------------------------------------------- forward
    def _lhs(self, a: torch.Tensor) -> Any:
        """The GEMM's left operand from bf16 rows (``[..., K]``)."""
        return L.quantize_per_token_group(a, self.kernels.round_scale_pow2) if self.fp8 else a

    def forward(self, hidden_states, topk_ids, topk_weights, state: DeepGemmExperts):
        n, h = hidden_states.shape
        if n == 0:
            return hidden_states.new_zeros(0, h)
        x = hidden_states.to(torch.bfloat16)
        if n <= self.masked_max_rows:
            out = self._forward_masked(x, topk_ids, topk_weights, state)
        else:
            out = self._forward_contiguous(x, topk_ids, topk_weights, state)
        return out.to(hidden_states.dtype)

    def _swiglu(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        g = gate_up[..., :inter].float()
        return (F.silu(g) * gate_up[..., inter:].float()).to(torch.bfloat16)

    def _forward_contiguous(self, x, topk_ids, topk_weights, state: DeepGemmExperts) -> torch.Tensor:
        lay = L.to_contiguous(topk_ids, state.num_experts, self.kernels.alignment)
        if lay.num_rows == 0:
            return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        inter, h = state.intermediate_size, x.shape[1]
        a = L.gather_contiguous(x, lay)  # [M, H]
        gate_up = torch.empty(lay.num_rows, 2 * inter, dtype=torch.bfloat16, device=x.device)
        self.kernels.contiguous(self._lhs(a), state.w13, gate_up, lay.m_indices)  # [M, 2I]
        act = self._swiglu(gate_up, inter)  # [M, I]
        act = torch.where((lay.m_indices >= 0).unsqueeze(1), act, torch.zeros_like(act))
        down = torch.empty(lay.num_rows, h, dtype=torch.bfloat16, device=x.device)
        self.kernels.contiguous(self._lhs(act), state.w2, down, lay.m_indices)  # [M, H]
        return L.scatter_contiguous(down, lay, topk_weights, x.shape[0])

    def _forward_masked(self, x, topk_ids, topk_weights, state: DeepGemmExperts) -> torch.Tensor:
        n, h = x.shape
        e, inter = state.num_experts, state.intermediate_size
        align = self.kernels.alignment
        max_m = L.ceil_div(n, align) * align  # a row meets an expert at most once
        lay = L.to_masked(topk_ids, e, max_m)
        expected_m = max(1, L.ceil_div(n * topk_ids.shape[1], e))  # mean pairs per expert
        a = L.gather_masked(x, lay)  # [E, max_m, H]
        gate_up = torch.empty(e, max_m, 2 * inter, dtype=torch.bfloat16, device=x.device)
        self.kernels.masked(self._lhs(a), state.w13, gate_up, lay.masked_m, expected_m)  # [E, max_m, 2I]
        act = self._swiglu(gate_up, inter)  # [E, max_m, I]
        act = torch.where(L.masked_row_mask(lay), act, torch.zeros_like(act))
        down = torch.empty(e, max_m, h, dtype=torch.bfloat16, device=x.device)
        self.kernels.masked(self._lhs(act), state.w2, down, lay.masked_m, expected_m)  # [E, max_m, H]
        return L.scatter_masked(down, lay, topk_weights, n)

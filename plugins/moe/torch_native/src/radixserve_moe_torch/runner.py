"""The ``torch_native`` MoE runner: experts over dispatched tokens, with no Python
loop over tokens.

Every forward sorts the (token, choice) pairs by expert once (``-1`` choices, experts on
another rank, sort first and are dropped) and gathers the tokens' rows in that order, so
each expert's tokens are one contiguous slice. Then, by where the layer runs:

* **CPU, float32, radixserve's CPU kernels built** (the core's for packing and SiLU * up, this
  plugin's ``grouped_linear.c`` for the products; the
  default on CPU): ``prepare`` packs every expert's ``w13`` and ``w2`` once into column
  panels; a forward is two grouped-linear kernel calls (gate/up, down) over all experts at
  once, each expert's panels streamed once for all of its tokens and the work split over
  (expert, row block, panel) across torch's threads, with the kernels' SiLU * up in between.
  Batch-1 decode therefore reads just the chosen experts' weights at streaming bandwidth,
  and a decode batch reads each chosen expert once however many of its tokens there are.
* **Anywhere else** (GPU, bfloat16/float16, kernels unavailable or disabled with
  ``RADIXSERVE_CPU_KERNELS=0``): plain PyTorch, one ``F.linear`` pair per expert with
  tokens over its slice (one host sync per layer for the per-expert counts).

Either way the routing-weighted rows are summed back per token with one ``index_add_``.
Which path a layer takes is decided once in ``prepare`` (``state.path``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from radixserve.plugin_api.kernels import cpu_kernels
from radixserve.plugin_api.moe import ExpertWeights, MoEContext, MoERunner

from radixserve_moe_torch import kernel as grouped_kernel


@dataclass
class PackedExperts:
    """One layer's experts as ``prepare`` left them."""

    path: str  # "kernels" (packed panels, CPU float32) or "torch"
    w13: torch.Tensor  # kernels: [E, panels, H, NR]; torch: [E, 2I, H]
    w2: torch.Tensor  # kernels: [E, panels, I, NR]; torch: [E, H, I]
    num_experts: int
    hidden_size: int
    intermediate_size: int


class TorchNativeMoERunner(MoERunner):
    name = "torch_native"

    def __init__(self, ctx: MoEContext, use_kernels: bool = True) -> None:
        super().__init__(ctx)
        self.use_kernels = use_kernels

    def prepare(self, weights: ExpertWeights) -> PackedExperts:
        w13, w2 = weights.w13, weights.w2
        e, two_i, h = w13.shape
        kernels = None
        if self.use_kernels and w13.device.type == "cpu" and w13.dtype == torch.float32:
            kernels = cpu_kernels.load() if grouped_kernel.load() is not None else None  # else the torch path
        if kernels is not None:
            return PackedExperts("kernels", kernels.pack_grouped(w13), kernels.pack_grouped(w2), e, h, two_i // 2)
        return PackedExperts("torch", w13, w2, e, h, two_i // 2)

    def forward(self, hidden_states, topk_ids, topk_weights, state: PackedExperts):
        x = hidden_states  # [N, H]
        k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # [N*K]; -1 choices first
        counts = torch.bincount(flat_ids.long() + 1, minlength=state.num_experts + 1)  # [1 + E]
        if state.path == "kernels" and x.dtype == torch.float32 and x.device.type == "cpu":
            return self._forward_kernels(x, order, counts, k, topk_weights, state)
        return self._forward_torch(x, order, counts, k, topk_weights, state)

    @staticmethod
    def _forward_kernels(x, order, counts, k, topk_weights, state: PackedExperts):
        kernels, grouped = cpu_kernels.load(), grouped_kernel.load()
        skip = int(counts[0])  # choices with id -1
        offsets = torch.zeros(state.num_experts + 1, dtype=torch.int64)
        torch.cumsum(counts[1:], 0, out=offsets[1:])  # [E + 1]
        pairs = order[skip:]  # [P] sorted (token, choice) pairs with a local expert
        tok = pairs // k  # [P]
        xs = x.index_select(0, tok).contiguous()  # [P, H]
        gate_up = grouped.grouped_linear(xs, offsets, state.w13, 2 * state.intermediate_size)  # [P, 2I]
        h = kernels.silu_mul(gate_up)  # [P, I]
        y = grouped.grouped_linear(h, offsets, state.w2, state.hidden_size)  # [P, H]
        y.mul_(topk_weights.reshape(-1).index_select(0, pairs).unsqueeze(1))
        out = torch.zeros_like(x)
        out.index_add_(0, tok, y)
        return out

    @staticmethod
    def _forward_torch(x, order, counts, k, topk_weights, state: PackedExperts):
        inter = state.intermediate_size
        out = torch.zeros_like(x)
        counts = counts.tolist()  # one host sync per layer
        start = counts[0]  # choices with id -1 sort first and are skipped
        weights = topk_weights.reshape(-1)[order]
        rows = order // k  # token of each sorted pair
        for e, c in enumerate(counts[1:]):
            if c == 0:
                continue
            sl = slice(start, start + c)
            start += c
            tok = rows[sl]
            gate_up = F.linear(x[tok], state.w13[e])  # [c, 2I]
            h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            y = F.linear(h, state.w2[e]) * weights[sl, None].to(x.dtype)  # [c, H]
            out.index_add_(0, tok, y)
        return out


def make_runner(ctx: MoEContext, use_kernels: bool = True) -> TorchNativeMoERunner:
    """The runner; ``use_kernels=False`` forces the plain PyTorch path (tests, comparisons)."""
    return TorchNativeMoERunner(ctx, use_kernels=use_kernels)

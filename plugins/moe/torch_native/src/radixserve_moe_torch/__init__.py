"""radixserve MoE runner ``torch_native``: experts over dispatched tokens in plain PyTorch.

The (token, choice) pairs are sorted by expert once per layer; each expert that has tokens
then runs its gate/up projection, SiLU * up and down projection over one contiguous slice,
and the routing-weighted rows are summed back per token with one ``index_add_``. The
Python loop is over experts with tokens, never over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from radixserve.hookspecs import hookimpl
from radixserve.layers.moe import ExpertWeights, MoEContext, MoERunner


class TorchNativeMoERunner(MoERunner):
    name = "torch_native"

    def __init__(self, ctx: MoEContext) -> None:
        super().__init__(ctx)

    def prepare(self, weights: ExpertWeights) -> ExpertWeights:
        return weights

    def forward(self, hidden_states, topk_ids, topk_weights, state: ExpertWeights):
        x = hidden_states
        n, k = topk_ids.shape
        inter = state.intermediate_size
        out = torch.zeros_like(x)
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        sorted_ids = flat_ids[order]
        counts = torch.bincount(sorted_ids[sorted_ids >= 0].long(), minlength=state.w13.shape[0]).tolist()
        start = int((sorted_ids < 0).sum())  # ids of -1 sort first and are skipped
        rows = order // k  # token of each sorted pair
        weights = topk_weights.reshape(-1)[order]
        for e, c in enumerate(counts):
            if c == 0:
                continue
            sl = slice(start, start + c)
            start += c
            tok = rows[sl]
            gate_up = F.linear(x[tok], state.w13[e])
            h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            y = F.linear(h, state.w2[e]) * weights[sl, None].to(x.dtype)
            out.index_add_(0, tok, y)
        return out


@hookimpl
def register_moe_runners(register):
    register("torch_native", TorchNativeMoERunner,
             description="plain PyTorch: tokens sorted by expert, a GEMM per expert slice (runs anywhere)")

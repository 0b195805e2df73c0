"""The MoE contracts (runner and all-to-all transport) and the core's sparse MoE layer.

A sparse MoE block runs in four steps; the core owns the first and the model, the plugins
the rest::

    router logits -> select_experts (core)          top-k ids and weights per token
                  -> a2a.dispatch  (--moe-a2a-backend)    the tokens each local expert sees
                  -> runner.forward (--moe-runner-backend) weighted expert output per row
                  -> a2a.combine   (--moe-a2a-backend)    back to token order, summed

**Dispatched layout** (what :meth:`MoEA2ABackend.dispatch` returns and a runner reads):
``hidden_states  # [N, H]`` rows this rank computes, ``topk_ids  # [N, K] int32`` each row's
experts as *local* expert indices in ``[0, num_local_experts)``, with ``-1`` for a choice
whose expert lives on another rank, and ``topk_weights  # [N, K] float32``. A runner returns
``# [N, H]`` in the activations' dtype: for each row, the sum over its valid choices of
``topk_weights[n, k] * expert(topk_ids[n, k])(hidden_states[n])`` (choices with id ``-1``
contribute nothing), where ``expert(e)(x) = w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))``.
:meth:`MoEA2ABackend.combine` then returns each original token's sum over the rows that
carried it, ``# [T, H]`` in token order. The single-rank transport (``none``) passes the
tokens through unchanged, so ``N == T`` and ids are global ids.

**Expert weights** (:class:`ExpertWeights`), handed to :meth:`MoERunner.prepare` once per
layer after loading, on the model's device and dtype: ``w13  # [E_local, 2 * I, H]``, the
gate projection (``w1``) in rows ``[0, I)`` and the up projection (``w3``) in rows
``[I, 2I)``, and ``w2  # [E_local, H, I]`` the down projection. ``prepare`` may repack them
into any layout it likes; what it returns is passed back to every ``forward`` of that layer
and the layer keeps no other reference to the weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixserve.layers.linear import Linear


@dataclass(frozen=True)
class MoEContext:
    """Facts a runner or transport factory receives (one object serves every MoE layer)."""

    num_experts: int  # experts per layer, over all ranks
    top_k: int  # experts chosen per token
    hidden_size: int  # H
    intermediate_size: int  # I, per expert
    dtype: torch.dtype
    device: torch.device
    num_moe_layers: int = 1
    activation: str = "silu"
    ep_rank: int = 0  # expert-parallel rank of this process
    ep_size: int = 1  # expert-parallel world size; experts are split evenly in rank order
    max_num_tokens: int = 16384  # most tokens one forward step carries (workspace sizing)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_local_expert(self) -> int:
        return self.ep_rank * self.num_local_experts


@dataclass
class ExpertWeights:
    """One layer's local experts, in the core's layout (see the module docstring)."""

    w13: torch.Tensor  # [E_local, 2I, H]: gate rows [0, I), up rows [I, 2I)
    w2: torch.Tensor  # [E_local, H, I]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]


@dataclass
class DispatchOutput:
    """The tokens this rank's experts must see, in the dispatched layout."""

    hidden_states: torch.Tensor  # [N, H]
    topk_ids: torch.Tensor  # [N, K] int32 local expert ids, -1: not on this rank
    topk_weights: torch.Tensor  # [N, K] float32
    handle: Any = None  # the transport's own state, for combine


class MoERunner(ABC):
    """Computes the experts of one rank over dispatched tokens (``--moe-runner-backend``)."""

    #: set by the factory's class; shown in logs
    name: str = "?"

    def __init__(self, ctx: MoEContext) -> None:
        self.ctx = ctx

    def prepare(self, weights: ExpertWeights) -> Any:
        """Called once per layer after loading; returns the state ``forward`` receives
        (default: the weights as they are). May repack and must not keep ``weights``
        around otherwise."""
        return weights

    @abstractmethod
    def forward(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                state: Any) -> torch.Tensor:
        """``# [N, H]``: each row's routing-weighted sum of its valid experts' outputs."""


class MoEA2ABackend(ABC):
    """Moves tokens to the ranks that hold their experts and back (``--moe-a2a-backend``)."""

    name: str = "?"

    def __init__(self, ctx: MoEContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> DispatchOutput:
        """``hidden_states  # [T, H]``, ``topk_ids  # [T, K]`` (global expert ids, int64 or
        int32) and ``topk_weights  # [T, K] float32`` -> the dispatched layout."""

    @abstractmethod
    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        """The runner's ``# [N, H]`` -> ``# [T, H]`` in the order ``dispatch`` received."""


class NoA2A(MoEA2ABackend):
    """Single rank: every expert is local; dispatch and combine are the identity."""

    name = "none"

    def __init__(self, ctx: MoEContext) -> None:
        if ctx.ep_size != 1:
            raise ValueError(f"--moe-a2a-backend none serves a single rank; expert parallelism over "
                             f"{ctx.ep_size} ranks needs a multi-rank transport")
        super().__init__(ctx)

    def dispatch(self, hidden_states, topk_ids, topk_weights):
        return DispatchOutput(hidden_states, topk_ids.to(torch.int32), topk_weights.float())

    def combine(self, expert_output, dispatched):
        return expert_output


# --------------------------------------------------------------------------- routing
def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing as Mixtral and Qwen-MoE define it: softmax over all experts in
    float32, the ``top_k`` largest, renormalised to sum to one when ``renormalize``.
    Returns ``(topk_ids  # [T, K] int32, topk_weights  # [T, K] float32)``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32), weights


def reference_moe(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The runner contract in plain torch, one (token, choice) at a time in float32: the
    oracle of the conformance suite. Ids of ``-1`` are skipped."""
    x = hidden_states.float()
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for n in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[n, k])
            if e < 0:
                continue
            gate_up = w13[e].float() @ x[n]
            h = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[n] += float(topk_weights[n, k]) * (w2[e].float() @ h)
    return out.to(hidden_states.dtype)


# ---------------------------------------------------------------------- the layer
class ExpertLoadRecorder:
    """Per-layer, per-expert counts of routed (token, choice) pairs, accumulated on the
    model's device without a host sync; read with :meth:`snapshot`."""

    def __init__(self, num_layers: int, num_experts: int, device: torch.device) -> None:
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.layer_ids: list[int] = []  # model layer index of each row

    def record(self, row: int, topk_ids: torch.Tensor) -> None:
        ids = topk_ids.reshape(-1).long()
        self.counts[row].scatter_add_(0, ids, torch.ones_like(ids))

    def snapshot(self) -> dict[int, list[int]]:
        """``{model layer index: [tokens routed to expert e, ...]}`` since start."""
        rows = self.counts.cpu().tolist()
        return {layer: rows[i] for i, layer in enumerate(self.layer_ids)}


class SparseMoE(nn.Module):
    """Router + experts of one layer. The router is the core's; the expert computation is
    the runner's and the token movement the transport's (set by :meth:`bind`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate = Linear(hidden_size, num_experts)  # router, [E, H]
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.runner: MoERunner | None = None
        self.a2a: MoEA2ABackend | None = None
        self.state: Any = None
        self.recorder: ExpertLoadRecorder | None = None
        self.recorder_row = 0

    def bind(self, runner: MoERunner, a2a: MoEA2ABackend, recorder: ExpertLoadRecorder | None = None,
             row: int = 0) -> None:
        """Hand the weights to ``runner`` (which may repack them) and keep its state; the
        plain parameters are dropped."""
        ctx = runner.ctx
        lo = ctx.first_local_expert
        w13, w2 = self.w13.data, self.w2.data
        if ctx.num_local_experts != self.num_experts:
            w13, w2 = w13[lo:lo + ctx.num_local_experts], w2[lo:lo + ctx.num_local_experts]
        self.state = runner.prepare(ExpertWeights(w13.contiguous(), w2.contiguous()))
        self.w13 = self.w2 = None
        self.runner, self.a2a = runner, a2a
        self.recorder, self.recorder_row = recorder, row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x  # [T, H]`` -> ``# [T, H]``."""
        topk_ids, topk_weights = select_experts(self.gate(x), self.top_k, self.renormalize)
        if self.recorder is not None:
            self.recorder.record(self.recorder_row, topk_ids)
        d = self.a2a.dispatch(x, topk_ids, topk_weights)
        out = self.runner.forward(d.hidden_states, d.topk_ids, d.topk_weights, self.state)
        return self.a2a.combine(out, d)


def moe_layers(model: nn.Module) -> list[tuple[int, SparseMoE]]:
    """``(decoder layer index, layer)`` of every :class:`SparseMoE` in ``model``, in order
    (the index is read from the module path's ``layers.N``)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE):
            parts = name.split(".")
            idx = next((int(parts[i + 1]) for i, p in enumerate(parts[:-1]) if p == "layers"
                        and parts[i + 1].isdigit()), len(found))
            found.append((idx, module))
    return found

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

**Expert parallelism** (``--ep-size``, under :mod:`radixserve.distributed`): a layer's
``num_experts`` (physical) experts are split evenly over the ``ep_size`` expert-parallel
ranks in rank order (``first_local_expert``, ``num_local_experts``), and each expert's
intermediate dimension over the ``moe_tp_size = tp_size / ep_size`` ranks that share the
same experts (``intermediate_size`` in the context is this rank's slice). Every rank of the
replica holds the same tokens (attention is tensor-parallel) and routes them identically
(the router is replicated). ``combine`` returns each token's sum over *all* experts of
every EP rank, for this rank's intermediate slice; :class:`SparseMoE` then sums the slices
over the moe-tp group (folded into one all-reduce over all ranks where the transport
offers :meth:`MoEA2ABackend.combine_partial`), so its output is the whole layer's on every
rank.

**Redundant experts** (EPLB, :mod:`radixserve.engine.eplb`): with
``--ep-num-redundant-experts N`` a layer has ``E + N`` physical experts; an
:class:`ExpertLocation` says which logical expert each physical slot holds, and the layer
maps the router's logical ids to physical ones (spreading an expert's tokens over its
copies) before ``dispatch``. Runners and transports only ever see physical ids; the
expert load counters stay per logical expert.

**Expert weights** (:class:`ExpertWeights`), handed to :meth:`MoERunner.prepare` once per
layer after loading, on the model's device and dtype: ``w13  # [E_local, 2 * I, H]``, the
gate projection (``w1``) in rows ``[0, I)`` and the up projection (``w3``) in rows
``[I, 2I)``, and ``w2  # [E_local, H, I]`` the down projection. ``prepare`` may repack them
into any layout it likes; what it returns is passed back to every ``forward`` of that layer
and the layer keeps no other reference to the weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from radixserve.distributed import all_reduce_in, get_parallel_state, moe_all_reduce, split_range, tp_all_reduce
from radixserve.distributed.dp_attention import current_step
from radixserve.layers.linear import Linear
from radixserve.layers.moe_a2a import DispatchOutput, MoEA2ABackend, NoA2A, Pending, PendingDispatch

__all__ = ["DispatchOutput", "ExpertLoadRecorder", "ExpertLocation", "ExpertWeights", "MoEA2ABackend", "MoEContext",
           "MoERunner", "NoA2A", "Pending", "PendingDispatch", "SparseMoE", "moe_layers", "reference_moe",
           "select_experts"]


@dataclass(frozen=True)
class MoEContext:
    """Facts a runner or transport factory receives (one object serves every MoE layer)."""

    num_experts: int  # physical experts per layer over all EP ranks (logical + redundant copies)
    top_k: int  # experts chosen per token
    hidden_size: int  # H
    intermediate_size: int  # I: this rank's slice of each expert's intermediate dim (all of it at moe-tp 1)
    dtype: torch.dtype
    device: torch.device
    num_moe_layers: int = 1
    activation: str = "silu"
    ep_rank: int = 0  # expert-parallel rank of this process
    ep_size: int = 1  # expert-parallel world size; experts are split evenly in rank order
    max_num_tokens: int = 16384  # most tokens one forward step carries (workspace sizing)
    moe_tp_rank: int = 0  # which slice of each expert's intermediate dim this rank holds
    moe_tp_size: int = 1  # ranks sharing the same experts (tp_size // ep_size)
    num_redundant_experts: int = 0  # of num_experts, the extra copies of hot experts (EPLB)
    # the options the chosen transport declares (radixserve.options), e.g. deepep's --deepep-mode;
    # None for one that declares none
    options: Any = field(default=None, compare=False)
    # torch.distributed groups: the EP ranks (group rank == ep_rank; None: the default
    # group) and the moe-tp ranks; only multi-rank transports and the layer use them
    ep_group: Any = field(default=None, compare=False, repr=False)
    moe_tp_group: Any = field(default=None, compare=False, repr=False)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_local_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    @property
    def num_logical_experts(self) -> int:
        return self.num_experts - self.num_redundant_experts

    def ep_group_or_default(self) -> Any:
        """The group a multi-rank transport talks over (the default group when unset)."""
        return self.ep_group if self.ep_group is not None else dist.group.WORLD


@dataclass
class ExpertWeights:
    """One layer's local experts, in the core's layout (see the module docstring)."""

    w13: torch.Tensor  # [E_local, 2I, H]: gate rows [0, I), up rows [I, 2I)
    w2: torch.Tensor  # [E_local, H, I]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]


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


class ExpertLocation:
    """Where one layer's logical experts live when some have redundant copies (EPLB).

    ``physical_to_logical[p]`` is the logical expert held in physical slot ``p`` (the
    physical slots are split over the EP ranks in rank order like any experts); every
    logical expert has at least one slot. :meth:`to_physical` sends the ``t``-th token of a
    batch that chose logical expert ``l`` to copy ``t mod copies(l)`` of it: deterministic,
    the same on every rank, and an expert's tokens spread evenly over its copies."""

    def __init__(self, physical_to_logical: list[int], num_logical: int) -> None:
        copies: list[list[int]] = [[] for _ in range(num_logical)]
        for p, logical in enumerate(physical_to_logical):
            if not 0 <= logical < num_logical:
                raise ValueError(f"physical expert {p} holds logical expert {logical}, outside [0, {num_logical})")
            copies[logical].append(p)
        missing = [e for e, c in enumerate(copies) if not c]
        if missing:
            raise ValueError(f"logical experts {missing} have no physical slot; every expert needs one")
        width = max(len(c) for c in copies)
        self.physical_to_logical = list(physical_to_logical)
        self.replicas = torch.tensor([c + c[:1] * (width - len(c)) for c in copies])  # [E, width] physical ids
        self.num_copies = torch.tensor([len(c) for c in copies])  # [E]

    @property
    def num_physical(self) -> int:
        return len(self.physical_to_logical)

    def to(self, device: torch.device) -> ExpertLocation:
        self.replicas, self.num_copies = self.replicas.to(device), self.num_copies.to(device)
        return self

    def to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Logical ``topk_ids  # [T, K]`` -> physical ids ``# [T, K] int32``."""
        ids = topk_ids.long()
        token = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)  # [T, 1]
        slot = token % self.num_copies[ids]  # [T, K]
        return self.replicas[ids, slot].to(torch.int32)


class SparseMoE(nn.Module):
    """Router + experts of one layer. The router is the core's (replicated on every rank);
    the expert computation is the runner's and the token movement the transport's (set by
    :meth:`bind`). Under expert parallelism the layer keeps only this rank's experts and,
    of each, this rank's intermediate slice; its output is the whole layer's on every rank."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate = Linear(hidden_size, num_experts, quantize=False)  # router, [E, H]: stays exact
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.runner: MoERunner | None = None
        self.a2a: MoEA2ABackend | None = None
        self.state: Any = None
        self.recorder: ExpertLoadRecorder | None = None
        self.recorder_row = 0
        self.location: ExpertLocation | None = None

    def local_expert_weights(self, ctx: MoEContext, location: ExpertLocation | None = None) -> ExpertWeights:
        """This rank's share of the loaded weights: the physical experts
        ``[first_local_expert, + num_local_experts)`` (through ``location`` when given) and,
        of each, intermediate slice ``moe_tp_rank`` of ``moe_tp_size`` (the gate rows, the
        matching up rows, the matching ``w2`` columns)."""
        lo, n = ctx.first_local_expert, ctx.num_local_experts
        experts = location.physical_to_logical[lo:lo + n] if location is not None else list(range(lo, lo + n))
        inter = self.intermediate_size
        start, size = split_range(inter, ctx.moe_tp_size, ctx.moe_tp_rank)
        if size != ctx.intermediate_size:
            raise ValueError(f"MoEContext.intermediate_size is {ctx.intermediate_size}, but slice {ctx.moe_tp_rank} of "
                             f"{ctx.moe_tp_size} of this layer's {inter} is {size}")
        w13, w2 = self.w13.data, self.w2.data
        if experts == list(range(self.num_experts)) and size == inter:
            return ExpertWeights(w13.contiguous(), w2.contiguous())
        idx = torch.tensor(experts, device=w13.device)
        gate, up = w13[idx, start:start + size], w13[idx, inter + start:inter + start + size]
        return ExpertWeights(torch.cat([gate, up], dim=1).contiguous(), w2[idx, :, start:start + size].contiguous())

    def bind(self, runner: MoERunner, a2a: MoEA2ABackend, recorder: ExpertLoadRecorder | None = None,
             row: int = 0, location: ExpertLocation | None = None) -> None:
        """Hand this rank's share of the weights to ``runner`` (which may repack them) and
        keep its state; the plain parameters are dropped. ``location``: the layer's
        physical experts when some are replicated (EPLB)."""
        ctx = runner.ctx
        if location is not None and location.num_physical != ctx.num_experts:
            raise ValueError(f"the expert location has {location.num_physical} physical experts, the MoE context "
                             f"{ctx.num_experts}")
        if ctx.moe_tp_size > 1 and ctx.moe_tp_group is None:
            raise ValueError(f"moe_tp_size {ctx.moe_tp_size} needs the moe-tp group in the MoE context to sum the "
                             "intermediate slices over")
        self.state = runner.prepare(self.local_expert_weights(ctx, location))
        self.w13 = self.w2 = None
        self.runner, self.a2a = runner, a2a
        self.recorder, self.recorder_row = recorder, row
        self.location = location.to(ctx.device) if location is not None else None

    def forward(self, x: torch.Tensor, add_partial: torch.Tensor | None = None) -> torch.Tensor:
        """``x  # [T, H]`` -> ``# [T, H]`` (the same tokens on every rank).

        ``add_partial  # [T, H]``: a tensor whose sum over all the replica's ranks is added
        to the output (a tensor-parallel shared expert's partial output); its sum shares
        the layer's own all-reduce. One collective per layer on several ranks, the
        transport's own aside: an all-reduce over all ranks of this rank's share (the
        ``none`` transport's, or, from a transport that combines itself, its output counted
        on EP rank 0 only), or with nothing to add and nothing split, none at all.

        With DP attention ``x`` is this rank's attention group's tokens: every group's are
        gathered first, the layer runs over all of them on all ranks, and this group's rows
        come back (``add_partial`` is then summed over the attention group only)."""
        step = current_step()
        if step is None:
            return self._forward(x, add_partial)
        out = step.mine(self._forward(step.gather(x), None))
        return out if add_partial is None else out + tp_all_reduce(add_partial)

    #: single-batch overlap (``--enable-single-batch-overlap``, set by the engine): a block with
    #: shared experts computes them while its routed tokens are being dispatched
    single_batch_overlap = False

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """This rank's partial output of the block's shared experts for ``x`` (None: none);
        :meth:`forward_with_shared` adds their sum over the ranks in the layer's all-reduce."""
        return None

    def forward_with_shared(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output, its shared experts included: computed before the routed part,
        or (single-batch overlap, without DP attention) while the routed tokens are dispatched."""
        if self.single_batch_overlap and current_step() is None:
            return run_stages(self._stages(x, None, overlap=lambda: self.shared_output(x)))
        return SparseMoE.forward(self, x, add_partial=self.shared_output(x))  # (subclasses' forward calls this)

    def stages(self, x: torch.Tensor):
        """The block (shared experts included) as a generator that yields while its tokens
        travel, once after starting the dispatch and once after starting the combine's last
        collective, and returns the output: two-batch overlap runs the other micro-batch's
        layers at each yield (:mod:`radixserve.engine.two_batch`). Not with DP attention."""
        if self.single_batch_overlap:
            return (yield from self._stages(x, None, overlap=lambda: self.shared_output(x)))
        return (yield from self._stages(x, self.shared_output(x)))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_ids  # [T, K] int32 logical, topk_weights  # [T, K] float32)`` of ``x  # [T, H]``:
        softmax top-k here; a model with another router overrides it (DeepSeek's grouped top-k)."""
        return select_experts(self.gate(x), self.top_k, self.renormalize)

    def _forward(self, x: torch.Tensor, add_partial: torch.Tensor | None) -> torch.Tensor:
        return run_stages(self._stages(x, add_partial))

    def _stages(self, x: torch.Tensor, add_partial: torch.Tensor | None, overlap=None):
        """The routed part (plus ``add_partial``, or what ``overlap()`` returns, computed while
        the tokens are dispatched), yielding while communication is in flight (see :meth:`stages`)."""
        topk_ids, topk_weights = self.route(x)  # [T, K] logical
        if self.recorder is not None:
            self.recorder.record(self.recorder_row, topk_ids)
        if self.location is not None:
            topk_ids = self.location.to_physical(topk_ids)  # [T, K] physical
        pending = self.a2a.dispatch_async(x, topk_ids, topk_weights)
        if overlap is not None:
            add_partial = overlap()  # while the tokens travel
        yield
        d = pending.wait()
        out = self.runner.forward(d.hidden_states, d.topk_ids, d.topk_weights, self.state)  # [N, H]
        ctx = self.runner.ctx
        num_ranks = ctx.ep_size * ctx.moe_tp_size
        if num_ranks == 1:
            out = self.a2a.combine(out, d)
            return out if add_partial is None else out + add_partial
        whole = get_parallel_state().moe_world_size == num_ranks  # the MoE groups tile the replica's ranks
        share = self.a2a.combine_partial(out, d) if whole else None  # [T, H], summed over all ranks
        if share is None:
            pending = self.a2a.combine_async(out, d)
            yield
            out = pending.wait()  # [T, H]: all experts, this rank's intermediate slice
            if add_partial is None or not whole:
                out = all_reduce_in(out, ctx.moe_tp_group, ctx.moe_tp_size)
                return out if add_partial is None else out + tp_all_reduce(add_partial)
            # the same on every rank of the EP group: count it once in the sum over all ranks
            share = out if ctx.ep_rank == 0 else torch.zeros_like(out)
        pending = moe_all_reduce_async(share if add_partial is None else share + add_partial)
        yield
        return pending.wait()


def run_stages(stages):
    """Run a generator of :meth:`SparseMoE.stages` (or a layer's) to its end; its return value."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


def moe_all_reduce_async(x: torch.Tensor) -> Pending:
    """:func:`~radixserve.distributed.moe_all_reduce` started asynchronously."""
    ps = get_parallel_state()
    if ps.moe_world_size == 1:
        return Pending(moe_all_reduce(x))
    work = dist.all_reduce(x, group=ps.moe_group, async_op=True)
    return Pending(finish=lambda: (work.wait(), x)[1])


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

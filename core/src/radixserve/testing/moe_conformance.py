"""Conformance suites for the two MoE contracts of :mod:`radixserve.layers.moe`: any MoE
runner, and any all-to-all transport, ours or a third party's, run on random experts and
routings and compared with :func:`~radixserve.layers.moe.reference_moe`.

Runners (``--moe-runner-backend``)::

    from radixserve.testing.moe_conformance import CASES, run_case

    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_conforms(case):
        run_case(MyRunner, case)  # raises AssertionError with the max error on mismatch

Each case builds one :class:`~radixserve.layers.moe.MoEContext`, one runner from the
factory, and two layers' random experts; ``prepare`` is called once per layer and its state
reused for several forwards of both layers, interleaved (a runner that keeps per-call or
per-layer results on ``self`` fails). Every output must match the oracle within the case's
tolerance (``max |out - ref| <= atol + rtol * |ref|`` elementwise; :data:`TOLERANCES`),
have the activations' shape, dtype and device, and the inputs (hidden states, ids, weights,
the expert weights handed to ``prepare``) must come back unmodified.

The routings cover uneven expert loads, experts that get no tokens, every token on one
expert, choices with id ``-1`` (experts on another rank, including rows with no local
choice at all), routing weights that do not sum to one, and no rows at all (a rank that
receives no tokens), at top-k 1, 2 and 8, batch 1 and 256, several expert counts and sizes,
in float32 and bfloat16.

Transports (``--moe-a2a-backend``)::

    from radixserve.testing.moe_conformance import A2A_CASES, run_a2a_case

    @pytest.mark.parametrize("case", A2A_CASES, ids=str)
    def test_transport(case):
        run_a2a_case(MyTransport, case)

checks the dispatched layout (shapes, int32 local ids in ``[-1, E_local)``, float32
weights), that inputs are not modified, that ``combine`` of a runner whose expert ``e`` is
``x -> (e + 1) * x`` gives each token ``sum_k w_k * (id_k + 1) * x``, and that
``combine(runner(dispatch(x)))`` with a reference runner equals ``reference_moe`` over all
experts; where the transport offers ``combine_partial``, the same for its shares summed
over the EP group. A multi-rank transport runs the same function on every rank of an initialised
process group with ``ep_rank`` and ``ep_size`` (the MoE context's ``ep_group`` is the
default group): the experts, the tokens and their routing are the same on every rank (as
in a model, whose attention is tensor-parallel), each rank's runner computes only its
``E / ep_size`` experts, and every rank checks that ``combine`` gives all ``T`` tokens
their sum over every rank's experts; both again as two micro-batches whose dispatches (then
combines) are all started before any is waited for (two-batch overlap). :func:`run_a2a_cases_on_ranks` spawns the ranks
(gloo, CPU) and runs a list of cases on each::

    def test_transport_on_two_ranks():
        run_a2a_cases_on_ranks(MyTransport, ep_size=2)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.layers.moe import (
    ExpertWeights,
    MoEContext,
    MoERunner,
    reference_moe,
    select_experts,
)

#: ``dtype -> (atol, rtol)`` for outputs of magnitude about one (the cases' scaling).
#: float32: a different summation order only. bfloat16: inputs and experts are bfloat16, the
#: oracle computes in float32 from those values, and a runner may round its intermediate
#: activations (gate/up, SiLU * up) to bfloat16 on the way.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (5e-3, 5e-3),
}

ROUTINGS = ("softmax", "uneven", "empty_experts", "one_expert", "remote", "unnormalized")


@dataclass(frozen=True)
class Case:
    num_tokens: int  # N, dispatched rows
    num_experts: int  # E (local experts: the runner sees ids in [0, E))
    top_k: int
    hidden_size: int
    intermediate_size: int
    routing: str = "softmax"  # one of ROUTINGS
    dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (f"n{self.num_tokens}-e{self.num_experts}-top{self.top_k}-h{self.hidden_size}"
                f"-i{self.intermediate_size}-{self.routing}-{dt}")


def _cases() -> list[Case]:
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 256):
            for e, k in ((8, 1), (8, 2), (16, 8)):
                out.append(Case(n, e, k, 64, 32, "softmax", dtype))
        out.append(Case(256, 8, 8, 64, 32, "softmax", dtype))  # top-k == E: every expert, every token
        out.append(Case(256, 16, 2, 64, 48, "uneven", dtype))
        out.append(Case(64, 16, 2, 64, 32, "empty_experts", dtype))
        out.append(Case(128, 8, 1, 64, 32, "one_expert", dtype))
        out.append(Case(128, 8, 2, 64, 32, "one_expert", dtype))
        out.append(Case(96, 16, 4, 64, 32, "remote", dtype))
        out.append(Case(33, 8, 2, 64, 32, "unnormalized", dtype))
        out.append(Case(0, 8, 2, 64, 32, "softmax", dtype))  # a rank that receives no tokens
    # sizes: widths that are not multiples of a SIMD vector, a wide intermediate, many experts
    out.append(Case(17, 4, 2, 80, 24, "softmax"))
    out.append(Case(40, 8, 2, 128, 192, "softmax"))
    out.append(Case(100, 60, 4, 96, 40, "uneven"))
    out.append(Case(7, 64, 8, 64, 16, "softmax"))
    out.append(Case(256, 60, 8, 48, 24, "remote"))
    return out


CASES: list[Case] = _cases()


def random_experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13  # [E, 2I, H]`` and ``w2  # [E, H, I]``, scaled so an expert's output is O(1)."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def random_routing(case: Case, gen: torch.Generator,
                   num_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids  # [N, K] int32, topk_weights  # [N, K] float32)`` for ``case.routing``."""
    n = case.num_tokens if num_tokens is None else num_tokens
    e, k = case.num_experts, case.top_k
    logits = torch.randn(n, e, generator=gen)
    if case.routing == "uneven":  # expert 0 gets nearly every token, the last ones few
        logits += torch.linspace(4.0, -2.0, e)
    elif case.routing == "empty_experts":  # experts 0 and E-1 and every odd expert get none
        logits[:, 0] = logits[:, -1] = float("-inf")
        logits[:, 1::2] = float("-inf")
        if int(torch.isfinite(logits[0]).sum()) < k:
            raise ValueError(f"{case}: too few experts left for top-{k} after emptying some")
    elif case.routing == "one_expert":  # every token chooses the same k experts (3, 4, ..)
        first = min(3, e - k)
        logits = torch.zeros(n, e)
        logits[:, first:first + k] = torch.linspace(2.0, 1.0, k)
        logits += torch.rand(n, e, generator=gen) * 0.01
    ids, weights = select_experts(logits, k, renormalize=case.routing != "unnormalized")
    if case.routing == "unnormalized":
        weights = weights * (torch.rand(n, 1, generator=gen) * 3.0 + 0.5)
    if case.routing == "remote" and n:  # about a third of the choices live on another rank
        ids = torch.where(torch.rand(n, k, generator=gen) < 0.35, torch.full_like(ids, -1), ids)
        ids[0] = -1  # a row with no local choice at all
    return ids.to(torch.int32).contiguous(), weights.float().contiguous()


def _check(out: torch.Tensor, ref: torch.Tensor, like: torch.Tensor, what: str,
           tolerance: tuple[float, float] | None = None) -> float:
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise AssertionError(f"{what}: expected a {tuple(like.shape)} {like.dtype} tensor on {like.device}, "
                             f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    atol, rtol = tolerance or TOLERANCES[like.dtype]
    if out.numel() == 0:
        return 0.0
    o, r = out.float().cpu(), ref.float().cpu()
    if not torch.isfinite(o).all():
        raise AssertionError(f"{what}: output has non-finite values")
    err = (o - r).abs()
    bad = err > atol + rtol * r.abs()
    max_err = float(err.max())
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise AssertionError(f"{what}: max abs error {max_err:.3g} (tolerance {atol} + {rtol} * |ref|), "
                             f"{int(bad.sum())} elements outside it, first in row {row}")
    return max_err


def _unchanged(before: torch.Tensor, after: torch.Tensor, what: str) -> None:
    if before.shape != after.shape or not torch.equal(before, after):
        raise AssertionError(f"{what} was modified by the call; inputs must be left as they are")


def run_case(factory, case: Case, *, device: str = "cpu", seed: int = 0,
             tolerance: tuple[float, float] | None = None) -> float:
    """Run ``factory(ctx)``'s runner over ``case`` (two layers, several forwards each,
    interleaved) and compare every output with the oracle. Returns the max abs error;
    raises AssertionError on a mismatch or a contract breach. ``tolerance`` overrides
    :data:`TOLERANCES` for the case's dtype as ``(atol, rtol)``."""
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    ctx = MoEContext(num_experts=case.num_experts, top_k=case.top_k, hidden_size=case.hidden_size,
                     intermediate_size=case.intermediate_size, dtype=case.dtype, device=dev,
                     num_moe_layers=2, max_num_tokens=max(case.num_tokens, 64))
    runner = factory(ctx)
    if not isinstance(runner, MoERunner):
        raise AssertionError(f"the factory returned {type(runner).__name__}, not a MoERunner")
    layers = []
    for _ in range(2):
        w13, w2 = random_experts(case.num_experts, case.hidden_size, case.intermediate_size, case.dtype, gen)
        given = ExpertWeights(w13.to(dev, copy=True).contiguous(), w2.to(dev, copy=True).contiguous())
        copies = (given.w13.clone(), given.w2.clone())
        state = runner.prepare(given)
        _unchanged(copies[0], given.w13, "ExpertWeights.w13 handed to prepare")
        _unchanged(copies[1], given.w2, "ExpertWeights.w2 handed to prepare")
        layers.append((w13, w2, state))
    # The two layers interleaved: the case's batch, a differently sized batch with another
    # routing, then the case's batches again (the same state must give the same answer).
    n, m = case.num_tokens, max(1, case.num_tokens // 3 + 5)
    calls = [(0, n), (1, n), (0, m), (1, m), (1, n), (0, n)]
    max_err = 0.0
    inputs: dict[tuple[int, int], tuple] = {}
    for i, (layer, n) in enumerate(calls):
        w13, w2, state = layers[layer]
        if (layer, n) not in inputs:
            x = (torch.randn(n, case.hidden_size, generator=gen)).to(case.dtype)
            ids, weights = random_routing(case, gen, n)
            inputs[(layer, n)] = (x, ids, weights, reference_moe(x, ids, weights, w13, w2))
        x, ids, weights, ref = inputs[(layer, n)]
        xd, idsd, wd = (t.to(dev, copy=True) for t in (x, ids, weights))  # never the originals
        out = runner.forward(xd, idsd, wd, state)
        what = f"{case}: call {i} (layer {layer}, {n} rows)"
        _unchanged(x.to(dev), xd, f"{what}: hidden_states")
        _unchanged(ids.to(dev), idsd, f"{what}: topk_ids")
        _unchanged(weights.to(dev), wd, f"{what}: topk_weights")
        max_err = max(max_err, _check(out, ref, xd, what, tolerance))
    return max_err


# ------------------------------------------------------------------ transports
@dataclass(frozen=True)
class A2ACase:
    num_tokens: int  # T, tokens this rank hands to dispatch
    num_experts: int  # E over all ranks
    top_k: int
    hidden_size: int = 64
    intermediate_size: int = 32
    dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return f"t{self.num_tokens}-e{self.num_experts}-top{self.top_k}-h{self.hidden_size}-{dt}"


A2A_CASES: list[A2ACase] = [
    A2ACase(1, 8, 2), A2ACase(37, 8, 1), A2ACase(256, 16, 8), A2ACase(64, 60, 4),
    A2ACase(0, 8, 2), A2ACase(50, 8, 2, dtype=torch.bfloat16),
]


class ScaledIdentityRunner(MoERunner):
    """Expert ``e`` (global id) is ``x -> (e + 1) * x``: a runner that shows where each row
    went without any weights."""

    name = "scaled_identity"

    def forward(self, hidden_states, topk_ids, topk_weights, state):
        ids = topk_ids.long()
        scale = torch.where(ids >= 0, (ids + self.ctx.first_local_expert + 1).float() * topk_weights,
                            torch.zeros_like(topk_weights))  # [N, K]
        return (hidden_states.float() * scale.sum(1, keepdim=True)).to(hidden_states.dtype)


class ReferenceRunner(MoERunner):
    """The oracle as a runner (the local experts, one (row, choice) at a time)."""

    name = "reference"

    def forward(self, hidden_states, topk_ids, topk_weights, state):
        return reference_moe(hidden_states, topk_ids, topk_weights, state.w13, state.w2)


def run_a2a_case(factory, case: A2ACase, *, ep_rank: int = 0, ep_size: int = 1, device: str = "cpu",
                 seed: int = 0) -> float:
    """Run ``factory(ctx)``'s transport over ``case`` on this rank (see the module
    docstring). Returns the max abs error; raises AssertionError on a mismatch."""
    dev = torch.device(device)
    ctx = MoEContext(num_experts=case.num_experts, top_k=case.top_k, hidden_size=case.hidden_size,
                     intermediate_size=case.intermediate_size, dtype=case.dtype, device=dev,
                     ep_rank=ep_rank, ep_size=ep_size, max_num_tokens=max(case.num_tokens, 64))
    a2a = factory(ctx)
    w13, w2 = random_experts(case.num_experts, case.hidden_size, case.intermediate_size, case.dtype,
                             torch.Generator().manual_seed(seed))  # the same on every rank
    gen = torch.Generator().manual_seed(seed + 1)  # the same tokens on every rank
    x = torch.randn(case.num_tokens, case.hidden_size, generator=gen).to(case.dtype)
    ids, weights = select_experts(torch.randn(case.num_tokens, case.num_experts, generator=gen), case.top_k, True)
    lo, num_local = ctx.first_local_expert, ctx.num_local_experts
    local = ExpertWeights(w13[lo:lo + num_local].to(dev).contiguous(), w2[lo:lo + num_local].to(dev).contiguous())
    max_err = 0.0
    for runner in (ScaledIdentityRunner(ctx), ReferenceRunner(ctx)):
        what = f"{case} rank {ep_rank}/{ep_size}, {runner.name} runner"
        xd, idsd, wd = (t.to(dev, copy=True) for t in (x, ids, weights))  # never the originals
        # the reference runner's pass goes through dispatch_async (the default wraps dispatch)
        d = a2a.dispatch(xd, idsd, wd) if isinstance(runner, ScaledIdentityRunner) else \
            a2a.dispatch_async(xd, idsd, wd).wait()
        _unchanged(x.to(dev), xd, f"{what}: dispatch's hidden_states")
        _unchanged(ids.to(dev), idsd, f"{what}: dispatch's topk_ids")
        _unchanged(weights.to(dev), wd, f"{what}: dispatch's topk_weights")
        n = d.hidden_states.shape[0]
        if d.hidden_states.shape[1:] != (case.hidden_size,) or d.topk_ids.shape != (n, case.top_k) \
                or d.topk_weights.shape != (n, case.top_k):
            raise AssertionError(f"{what}: dispatched shapes {tuple(d.hidden_states.shape)}, "
                                 f"{tuple(d.topk_ids.shape)}, {tuple(d.topk_weights.shape)}; expected "
                                 f"[N, {case.hidden_size}], [N, {case.top_k}], [N, {case.top_k}]")
        if d.topk_ids.dtype != torch.int32 or d.topk_weights.dtype != torch.float32:
            raise AssertionError(f"{what}: dispatched ids/weights are {d.topk_ids.dtype}/{d.topk_weights.dtype}; "
                                 "expected int32/float32")
        if n and (int(d.topk_ids.min()) < -1 or int(d.topk_ids.max()) >= num_local):
            raise AssertionError(f"{what}: dispatched ids outside [-1, {num_local})")
        if ep_size == 1 and n != case.num_tokens:
            raise AssertionError(f"{what}: a single rank must dispatch every token once, got {n} rows "
                                 f"for {case.num_tokens} tokens")
        # the reference runner's pass combines through combine_async (the default wraps combine)
        expert_out = runner.forward(d.hidden_states, d.topk_ids, d.topk_weights, local)
        out = a2a.combine(expert_out, d) if isinstance(runner, ScaledIdentityRunner) else \
            a2a.combine_async(expert_out, d).wait()
        if isinstance(runner, ScaledIdentityRunner):
            scale = ((ids.long() + 1).float() * weights).sum(1, keepdim=True)
            ref = (x.float() * scale).to(case.dtype)
        else:
            ref = reference_moe(x, ids, weights, w13, w2)
        max_err = max(max_err, _check(out, ref, xd, what))
        # combine_partial, where offered: its shares summed over the EP group are combine's result
        d = a2a.dispatch(*(t.to(dev, copy=True) for t in (x, ids, weights)))
        share = a2a.combine_partial(runner.forward(d.hidden_states, d.topk_ids, d.topk_weights, local), d)
        if share is not None:
            if ep_size > 1:
                import torch.distributed as dist

                share = share.clone()
                dist.all_reduce(share, group=ctx.ep_group_or_default())
            max_err = max(max_err, _check(share, ref, xd, f"{what}: combine_partial summed over the EP group"))
        max_err = max(max_err, _two_in_flight(a2a, runner, local, x, ids, weights, ref, dev, what))
    return max_err


def _two_in_flight(a2a, runner, local, x, ids, weights, ref, dev, what: str) -> float:
    """Two-batch overlap's order: the tokens as two micro-batches, both dispatches started before
    either is waited for, then both combines, each waited in the order started."""
    half = x.shape[0] // 2
    parts = [(0, half), (half, x.shape[0])]
    started = [a2a.dispatch_async(*(t[lo:hi].to(dev, copy=True) for t in (x, ids, weights))) for lo, hi in parts]
    dispatched = [p.wait() for p in started]
    started = [a2a.combine_async(runner.forward(d.hidden_states, d.topk_ids, d.topk_weights, local), d)
               for d in dispatched]
    out = torch.cat([p.wait() for p in started])
    return _check(out, ref, x.to(dev), f"{what}: two micro-batches in flight at once")


def _a2a_cases_rank(rank: int, world_size: int, init_method: str, factory, cases: list[A2ACase],
                    device: str) -> float:
    import torch.distributed as dist

    if device == "cuda":  # one GPU per rank
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world_size)
    dev = f"cuda:{rank}" if device == "cuda" else device
    return max((run_a2a_case(factory, case, ep_rank=rank, ep_size=world_size, device=dev, seed=i)
                for i, case in enumerate(cases)), default=0.0)


def run_a2a_cases_on_ranks(factory, ep_size: int, cases: list[A2ACase] | None = None, device: str = "cpu",
                           timeout_s: float = 120.0) -> float:
    """Run ``cases`` (default :data:`A2A_CASES`) on ``ep_size`` spawned ranks — CPU ranks
    over gloo, or with ``device="cuda"`` one GPU each over NCCL — and return the max abs
    error over every rank; raises AssertionError with the failing rank's traceback.
    ``factory`` must be importable by name (a module-level class or function) for the
    spawned processes."""
    from radixserve.testing.multi_rank import run_ranks

    cases = A2A_CASES if cases is None else cases
    return max(run_ranks(_a2a_cases_rank, ep_size, factory, cases, device, timeout_s=timeout_s))

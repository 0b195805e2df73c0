"""Parallel state of one model replica: which rank this process is, its groups, and the
collectives the model layers call.

A replica runs on ``tp_size`` ranks (``--tp-size``), all in one ``torch.distributed``
world (gloo on CPU, NCCL on GPUs; torch's TCPStore rendezvous, bound to the interface of
``--dist-init-addr``). Dense layers
split over all of them. MoE layers split the experts over ``ep_size`` expert-parallel
groups (``--ep-size``, which divides ``tp_size``, as in SGLang) and each expert's
intermediate size over the ``moe_tp_size = tp_size // ep_size`` ranks that share the same
experts::

    ep_rank     = tp_rank // moe_tp_size   (which slice of the experts)
    moe_tp_rank = tp_rank %  moe_tp_size   (which slice of each expert)

With pipeline parallelism (``--pp-size P``) the world holds ``P`` stages of ``tp_size`` ranks,
``rank = pp_rank * tp_size + tp_rank``: each stage holds a contiguous run of layers
(:mod:`radixserve.distributed.pipeline`), ``group`` is its own stage's TP group and
``cpu_group`` the whole world (rank 0's step messages reach every stage).

With DP attention (``--enable-dp-attention --dp-size D``) the ``--tp-size T`` ranks form ``D``
attention groups of ``T / D`` ranks, ``rank = attn_dp_rank * (T / D) + tp_rank``: here
``tp_size``/``tp_rank``/``group`` are the attention group's (attention, the embedding, dense
MLPs and the LM head split over it), while MoE layers split over all ``T`` ranks
(``moe_world_size``, ``moe_group``) after gathering every group's tokens
(:mod:`radixserve.distributed.dp_attention`).

The default state is a single rank: every collective is the identity, so layers call them
unconditionally. Data parallelism (``--dp-size``) runs whole replicas, each with its own
state, behind a router; it never appears here.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from radixserve.distributed.rendezvous import make_store, pin_interfaces, split_init_method


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    ep_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: Any = None  # the replica's world (all tp ranks); None on a single rank
    cpu_group: Any = None  # a gloo group over the same ranks, for Python objects
    ep_group: Any = None  # ranks holding the other expert slices (same moe_tp_rank)
    moe_tp_group: Any = None  # ranks holding the other slices of the same experts (same ep_rank)
    pp_rank: int = 0  # this rank's pipeline stage
    pp_size: int = 1
    cp_rank: int = 0  # this rank's slice of a long prefill's tokens (--attn-cp-size)
    cp_size: int = 1
    attn_dp_rank: int = 0  # this rank's attention group (--enable-dp-attention)
    attn_dp_size: int = 1
    attn_dp_group: Any = None  # the ranks with this tp_rank in every attention group (token gathers)
    moe_group: Any = None  # the ranks MoE layers split over: ``group``, or every rank with DP attention

    @property
    def rank(self) -> int:
        """This rank in the replica's world (stage-major, then context-parallel, then attention
        group, then TP)."""
        return ((self.pp_rank * self.cp_size + self.cp_rank) * self.attn_dp_size + self.attn_dp_rank) * self.tp_size \
            + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.attn_dp_size * self.pp_size * self.cp_size

    @property
    def moe_world_size(self) -> int:
        """Ranks one MoE layer splits over: the TP group, or all attention groups' ranks."""
        return self.tp_size * self.attn_dp_size

    @property
    def moe_rank(self) -> int:
        return self.attn_dp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def moe_tp_size(self) -> int:
        return self.moe_world_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.moe_rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.moe_rank % self.moe_tp_size

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and samples; the others follow its steps."""
        return self.rank == 0


_state = ParallelState()


def get_parallel_state() -> ParallelState:
    return _state


def set_parallel_state(state: ParallelState) -> None:
    global _state
    _state = state


@contextlib.contextmanager
def replicated_scope() -> Iterator[None]:
    """Inside this block modules are built and run as on a one-rank replica: for a module rank
    0 holds whole and runs alone (a draft model of speculative decoding), whose layers must
    neither shard nor call a collective. The scheduler thread uses it between steps; the other
    threads that reach the replica's groups (heartbeat, service calls) hold theirs already. A
    no-op on one rank."""
    global _state
    saved = _state
    if saved.world_size == 1:
        yield
        return
    _state = ParallelState(device=saved.device)
    try:
        yield
    finally:
        _state = saved


def init_parallel_state(*, tp_size: int, ep_size: int, tp_rank: int, init_method: str, device: torch.device,
                        timeout_s: float = 120.0, pp_size: int = 1, cp_size: int = 1,
                        attn_dp_size: int = 1) -> ParallelState:
    """Join the replica's ``torch.distributed`` world of ``tp_size * pp_size`` ranks as rank
    ``tp_rank`` (with one stage its TP rank; else ``pp_rank * tp_size + tp_rank``) and build
    the groups. ``init_method`` is a ``tcp://HOST:PORT`` rendezvous address, which rank 0
    serves on HOST's interface only (:mod:`radixserve.distributed.rendezvous`).
    ``attn_dp_size``: DP attention's groups (``--dp-size`` with ``--enable-dp-attention``),
    each of ``tp_size / attn_dp_size`` ranks."""
    if tp_size % ep_size:
        raise ValueError(f"--ep-size {ep_size} must divide --tp-size {tp_size}")
    if tp_size % attn_dp_size:
        raise ValueError(f"--dp-size {attn_dp_size} must divide --tp-size {tp_size} with --enable-dp-attention")
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    world, rank = tp_size * pp_size * cp_size, tp_rank
    pin_interfaces(split_init_method(init_method)[0])  # gloo/NCCL sockets on the rendezvous interface
    _reset_group_names()
    store = make_store(init_method, rank, world, timeout)  # rank 0 listens on that address only
    dist.init_process_group(backend, store=store, world_size=world, rank=rank, timeout=timeout)
    attn_tp = tp_size // attn_dp_size
    state = ParallelState(tp_rank=rank % attn_tp, tp_size=attn_tp, ep_size=ep_size, device=device,
                          group=dist.group.WORLD, pp_rank=rank // (tp_size * cp_size), pp_size=pp_size,
                          cp_rank=(rank // tp_size) % cp_size, cp_size=cp_size,
                          attn_dp_rank=(rank % tp_size) // attn_tp, attn_dp_size=attn_dp_size)
    state.cpu_group = dist.new_group(list(range(world)), backend="gloo", timeout=timeout) \
        if backend != "gloo" else state.group
    if attn_dp_size > 1:
        _attention_groups(state, tp_size, attn_tp, timeout)
        set_parallel_state(state)
        return state
    moe_tp = tp_size // ep_size
    # every rank creates every group, in the same order (torch.distributed's rule); a stage's
    # groups hold its own ranks only
    mine = rank // tp_size  # which block of tp_size ranks (a stage's, or a context slice's) is this one's
    for block in range(pp_size * cp_size):
        base = block * tp_size
        if world > tp_size:
            g = dist.new_group([base + i for i in range(tp_size)], timeout=timeout)
            if mine == block:
                state.group = g
        for e in range(ep_size):
            g = dist.new_group([base + e * moe_tp + i for i in range(moe_tp)], timeout=timeout)
            if mine == block and state.ep_rank == e:
                state.moe_tp_group = g
        for i in range(moe_tp):
            g = dist.new_group([base + e * moe_tp + i for e in range(ep_size)], timeout=timeout)
            if mine == block and state.moe_tp_rank == i:
                state.ep_group = g
    state.moe_group = state.group
    set_parallel_state(state)
    return state


def _attention_groups(state: ParallelState, tp_size: int, attn_tp: int, timeout) -> None:
    """DP attention's groups (one stage, one context slice): each attention group's TP group,
    the gather groups (one per TP rank, across the attention groups), and the MoE groups over
    all ``tp_size`` ranks (``moe_rank`` is the world rank)."""
    dp = tp_size // attn_tp
    for d in range(dp):
        g = dist.new_group([d * attn_tp + i for i in range(attn_tp)], timeout=timeout) if attn_tp > 1 else None
        if d == state.attn_dp_rank:
            state.group = g
    if attn_tp == 1:  # one rank per attention group: collectives over the TP group are identities
        state.group = None
    for i in range(attn_tp):
        g = dist.new_group([d * attn_tp + i for d in range(dp)], timeout=timeout)
        if i == state.tp_rank:
            state.attn_dp_group = g
    state.moe_group = dist.group.WORLD
    moe_tp = tp_size // state.ep_size
    for e in range(state.ep_size):
        g = dist.new_group([e * moe_tp + i for i in range(moe_tp)], timeout=timeout)
        if state.ep_rank == e:
            state.moe_tp_group = g
    for i in range(moe_tp):
        g = dist.new_group([e * moe_tp + i for e in range(state.ep_size)], timeout=timeout)
        if state.moe_tp_rank == i:
            state.ep_group = g


def _reset_group_names() -> None:
    """A process joining a new world names its groups from 0 again, as a fresh follower does:
    torch numbers them per process and only a clean destroy resets the count, so a rendezvous
    that failed half way (a rank that never came) would leave rank 0's next world's groups
    under other store keys than its peers', and the next rendezvous would time out."""
    c10d = dist.distributed_c10d
    if not dist.is_initialized() and hasattr(c10d, "_world") and hasattr(c10d._world, "group_count"):
        c10d._world.group_count = 0


def destroy_parallel_state() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    set_parallel_state(ParallelState())


# --------------------------------------------------------------------- collectives
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the replica's ranks, in place (identity on one rank)."""
    s = _state
    if s.tp_size > 1:
        dist.all_reduce(x, group=s.group)
    return x


def moe_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` in place over the ranks MoE layers split over (the TP group, or every rank
    with DP attention)."""
    s = _state
    if s.moe_world_size > 1:
        dist.all_reduce(x, group=s.moe_group)
    return x


def all_reduce_in(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """Sum ``x`` in place over ``group`` of ``size`` ranks (identity when ``size`` is 1)."""
    if size > 1:
        dist.all_reduce(x, group=group)
    return x


def tp_all_gather(x: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension, in rank order. ``sizes``:
    each rank's last-dimension size when they differ (default: all equal to ``x``'s)."""
    s = _state
    if s.tp_size == 1:
        return x
    sizes = sizes or [x.shape[-1]] * s.tp_size
    width = max(sizes)
    if x.shape[-1] < width:  # all_gather needs equal shapes: pad, then cut
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    parts = [torch.empty_like(x) for _ in range(s.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=s.group)
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, size)`` of part ``index`` when ``n`` items are split into ``parts`` as
    evenly as possible (the first ``n % parts`` parts get one more)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


def free_port() -> int:
    """A free TCP port on this host (for a local rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_init_method(dist_init_addr: str | None) -> str:
    """``tcp://HOST:PORT`` from ``--dist-init-addr HOST:PORT`` (default: a free local port)."""
    if dist_init_addr:
        host, _, port = dist_init_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--dist-init-addr: expected HOST:PORT, got {dist_init_addr!r}")
        return f"tcp://{host}:{port}"
    return f"tcp://127.0.0.1:{free_port()}"


__all__ = ["ParallelState", "get_parallel_state", "set_parallel_state", "init_parallel_state",
           "destroy_parallel_state", "replicated_scope", "tp_all_reduce", "moe_all_reduce", "all_reduce_in",
           "tp_all_gather", "split_range", "free_port", "local_init_method"]

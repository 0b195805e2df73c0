"""A stand-in for DeepEP's legacy ``Buffer`` over ``torch.distributed`` (gloo on CPU), for
tests of the transport without GPUs or ``deep_ep``.

It implements the methods the transport calls with the inputs, outputs and semantics that
``deep_ep/buffers/legacy.py`` documents (and ``tests/legacy/test_intranode.py`` /
``test_low_latency.py`` check): received rows grouped by source rank then token, local
expert ids with ``-1`` for other ranks' experts, ``combine`` summing without weights,
low-latency ``[E_local, C, H]`` rows of which only ``recv_count[e]`` are valid (the rest
NaN here, so reading them shows), ``low_latency_combine`` applying the weights. It moves
data with all-gathers and all-reduces of everything: a semantic model, not DeepEP's
algorithm, and it exercises none of DeepEP's kernels.

Its methods have DeepEP 2.1.0's signatures (``deep_ep/buffers/legacy.py``, commit dd758ca:
names, order, defaults) and refuse what DeepEP's host side refuses (``EP_HOST_ASSERT`` in
``csrc/legacy/buffer.hpp``: dtypes, ranks, contiguity, sizes; the low-latency kernels'
hidden sizes and top-k <= 11 from ``csrc/kernels/legacy/launch.cuh`` / ``internode_ll.cu``;
the normal kernels' bf16-only ``SWITCH_TYPES``) with :class:`DeepEPRefusal`. Options DeepEP
has and this model does not (FP8, cached handles, configs, events, statistics) raise
``NotImplementedError`` when set. The constructor is the fake's own: ranks, group, the
``topk_idx_t`` of the build (int64 by default) and whether the buffer was made in
low-latency mode.

Asynchronous calls (``async_finish=True``, ``return_recv_hook=True``) return their tensors
filled with NaN until the event's ``current_stream_wait()`` or the hook is called, which copies
the results in: a transport that reads them before waiting sees NaN.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from radixserve_a2a_deepep import LOW_LATENCY_HIDDEN_SIZES, LOW_LATENCY_MAX_TOPK


class DeepEPRefusal(RuntimeError):
    """What DeepEP's ``EP_HOST_ASSERT`` raises."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise DeepEPRefusal(f"DeepEP would refuse this call: {what}")


def _unmodelled(**options) -> None:
    """DeepEP options this fake does not model, each given as ``name=(value, default)``."""
    for name, (value, default) in options.items():
        if (value is not None) if default is None else (value != default):
            raise NotImplementedError(f"FakeDeepEPBuffer does not model {name}={value!r}")


def _check_2d(t: torch.Tensor, what: str, dtype: torch.dtype | None = None, rows: int | None = None) -> None:
    _require(t.dim() == 2 and t.is_contiguous(), f"{what} must be 2-D and contiguous, got {tuple(t.shape)}")
    if dtype is not None:
        _require(t.dtype == dtype, f"{what} must be {dtype}, got {t.dtype}")
    if rows is not None:
        _require(t.shape[0] == rows, f"{what} has {t.shape[0]} rows, expected {rows}")


class _Deferred:
    """Results withheld until waited for: ``tensors`` hold NaN (or -1) until :meth:`arrive`."""

    def __init__(self, buffer, name: str, results: list[torch.Tensor]) -> None:
        self.buffer, self.name = buffer, name
        self.results = [r.clone() for r in results]
        for r in results:
            r.fill_(-1 if not r.is_floating_point() else float("nan"))
        self.tensors = results

    def arrive(self) -> None:
        self.buffer.calls.append(self.name)
        for t, r in zip(self.tensors, self.results):
            t.copy_(r)

    def current_stream_wait(self) -> None:  # DeepEP's EventOverlap
        self.arrive()


class FakeDeepEPBuffer:
    def __init__(self, rank: int, num_ranks: int, group=None, *, topk_idx_dtype: torch.dtype = torch.int64,
                 low_latency_mode: bool = True) -> None:
        self.rank, self.num_ranks, self.group = rank, num_ranks, group
        self.topk_idx_dtype = topk_idx_dtype  # deep_ep.topk_idx_t of the build
        self.low_latency_mode = low_latency_mode
        self.calls: list[str] = []

    # ------------------------------------------------------------------ helpers
    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[n, ...]`` on every rank (equal shapes) -> ``[P, n, ...]``."""
        if self.num_ranks == 1:
            return t.unsqueeze(0)
        parts = [torch.empty_like(t) for _ in range(self.num_ranks)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.num_ranks > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def _gather_padded(self, x, ids, weights, width):
        """Every rank's tokens padded to ``width``: ``[P, width, H]``, ``[P, width, K]`` (-1 pad), weights."""
        n = x.shape[0]
        xp = torch.zeros(width, x.shape[1], dtype=torch.float32)
        xp[:n] = x.float()
        ip = torch.full((width, ids.shape[1]), -1, dtype=torch.int64)
        ip[:n] = ids.long()
        wp = torch.zeros(width, ids.shape[1], dtype=torch.float32)
        wp[:n] = weights.float()
        return self._all_gather(xp), self._all_gather(ip), self._all_gather(wp)

    def _width(self, n: int) -> int:
        return int(self._all_gather(torch.tensor([n])).max())

    def _check_topk(self, topk_idx, what: str, rows: int | None = None) -> None:
        _check_2d(topk_idx, what, self.topk_idx_dtype, rows)

    def _check_low_latency(self, hidden: int, num_topk: int) -> None:
        _require(self.low_latency_mode, "low-latency calls need a buffer made with low_latency_mode=True")
        _require(hidden % 128 == 0 and hidden in LOW_LATENCY_HIDDEN_SIZES,
                 f"the low-latency kernels take hidden sizes {LOW_LATENCY_HIDDEN_SIZES}, not {hidden}")
        _require(num_topk <= LOW_LATENCY_MAX_TOPK,
                 f"the low-latency kernels take top-k <= {LOW_LATENCY_MAX_TOPK}, not {num_topk}")

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        _unmodelled(previous_event=(previous_event, None), async_finish=(async_finish, False),
                    allocate_on_comm_stream=(allocate_on_comm_stream, False))
        self._check_topk(topk_idx, "topk_idx")
        _require(num_experts > 0, "num_experts must be positive")
        self.calls.append("get_dispatch_layout")
        num_local = num_experts // self.num_ranks
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // num_local, torch.full_like(topk_idx, self.num_ranks))
        in_rank = torch.zeros(topk_idx.shape[0], self.num_ranks + 1, dtype=torch.bool)
        in_rank.scatter_(1, dest.long(), True)
        in_rank = in_rank[:, :self.num_ranks].contiguous()
        per_expert = torch.bincount(topk_idx[valid].long(), minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0,
                 config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        _unmodelled(handle=(handle, None), expert_alignment=(expert_alignment, 1), config=(config, None),
                    num_worst_tokens=(num_worst_tokens, 0), previous_event=(previous_event, None),
                    allocate_on_comm_stream=(allocate_on_comm_stream, False))
        if isinstance(x, tuple) or topk_idx is None:
            raise NotImplementedError("FakeDeepEPBuffer models bf16 dispatch with topk_idx only")
        _require(None not in (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert),
                 "a dispatch without a handle needs get_dispatch_layout's tensors")
        _check_2d(x, "x", torch.bfloat16)
        _require(x.shape[1] * x.element_size() % 16 == 0, "a row of x must be a multiple of 16 bytes")
        n = x.shape[0]
        _check_2d(is_token_in_rank, "is_token_in_rank", torch.bool, n)
        _require(is_token_in_rank.shape[1] == self.num_ranks, "is_token_in_rank must be [num_tokens, num_ranks]")
        for what, t, size in (("num_tokens_per_rank", num_tokens_per_rank, self.num_ranks),
                              ("num_tokens_per_expert", num_tokens_per_expert, num_tokens_per_expert.numel())):
            _require(t.dim() == 1 and t.is_contiguous() and t.dtype == torch.int32 and t.numel() == size,
                     f"{what} must be a contiguous int32 vector of {size}, got {t.dtype} {tuple(t.shape)}")
        _require(num_tokens_per_expert.numel() % self.num_ranks == 0, "experts must split evenly over the ranks")
        _require((topk_idx is None) == (topk_weights is None), "topk_idx and topk_weights go together")
        self._check_topk(topk_idx, "topk_idx", n)
        _check_2d(topk_weights, "topk_weights", torch.float32, n)
        _require(topk_weights.shape == topk_idx.shape, "topk_weights must have topk_idx's shape")
        self.calls.append("dispatch")
        num_experts = num_tokens_per_expert.numel()
        num_local, lo = num_experts // self.num_ranks, self.rank * num_experts // self.num_ranks
        width = self._width(x.shape[0])
        all_x, all_ids, all_w = self._gather_padded(x, topk_idx, topk_weights, width)
        mine = (all_ids >= lo) & (all_ids < lo + num_local)  # [P, width, K]
        src_rank, src_token = mine.any(2).nonzero(as_tuple=True)  # by source rank, then token
        local = torch.where(mine[src_rank, src_token], all_ids[src_rank, src_token] - lo,
                            torch.full_like(all_ids[src_rank, src_token], -1))
        weights = torch.where(local >= 0, all_w[src_rank, src_token], torch.zeros_like(all_w[src_rank, src_token]))
        recv_x = all_x[src_rank, src_token].to(x.dtype)
        per_expert = [int((local == e).sum()) for e in range(num_local)]
        event = _Deferred(self, "dispatch_event", [recv_x, local, weights]) if async_finish else None
        return recv_x, local, weights, per_expert, (src_rank, src_token, width), event

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False,
                allocate_on_comm_stream=False):
        _unmodelled(topk_weights=(topk_weights, None), bias=(bias, None), config=(config, None),
                    previous_event=(previous_event, None), allocate_on_comm_stream=(allocate_on_comm_stream, False))
        src_rank, src_token, width = handle
        _check_2d(x, "x", torch.bfloat16, src_rank.numel())  # SWITCH_TYPES: bf16 only
        _require(x.shape[1] * x.element_size() % 16 == 0, "a row of x must be a multiple of 16 bytes")
        self.calls.append("combine")
        back = torch.zeros(self.num_ranks * width, x.shape[1], dtype=torch.float32)
        back.index_add_(0, src_rank * width + src_token, x.float())
        back = self._all_reduce(back).view(self.num_ranks, width, x.shape[1])
        out = back[self.rank].to(x.dtype)
        return out, None, _Deferred(self, "combine_event", [out]) if async_finish else None

    # ------------------------------------------------------------------ low-latency mode
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        _require(self.low_latency_mode, "clean_low_latency_buffer needs a buffer made with low_latency_mode=True")
        self.calls.append("clean_low_latency_buffer")

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8=True, round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):
        _unmodelled(cumulative_local_expert_recv_stats=(cumulative_local_expert_recv_stats, None),
                    dispatch_wait_recv_cost_stats=(dispatch_wait_recv_cost_stats, None), use_fp8=(use_fp8, False),
                    round_scale=(round_scale, False), use_ue8m0=(use_ue8m0, False), async_finish=(async_finish, False))
        cap, n = num_max_dispatch_tokens_per_rank, x.shape[0]
        _check_2d(x, "x", torch.bfloat16)
        self._check_topk(topk_idx, "topk_idx", n)
        self._check_low_latency(x.shape[1], topk_idx.shape[1])
        _require(n <= cap, f"{n} tokens exceed num_max_dispatch_tokens_per_rank {cap}")
        _require(num_experts % self.num_ranks == 0, "experts must split evenly over the ranks")
        _require(self.num_ranks * cap % 4 == 0, "num_ranks * num_max_dispatch_tokens_per_rank must be a multiple of 4")
        self.calls.append("low_latency_dispatch")
        num_local, lo = num_experts // self.num_ranks, self.rank * num_experts // self.num_ranks
        all_x, all_ids, _ = self._gather_padded(x, topk_idx, torch.zeros(topk_idx.shape), cap)
        recv_x = torch.full((num_local, self.num_ranks * cap, x.shape[1]), float("nan"), dtype=x.dtype)
        count = torch.zeros(num_local, dtype=torch.int32)
        sources = []
        for e in range(num_local):
            src_rank, src_token = (all_ids == lo + e).any(2).nonzero(as_tuple=True)
            recv_x[e, :src_rank.numel()] = all_x[src_rank, src_token].to(x.dtype)
            count[e] = src_rank.numel()
            sources.append((src_rank, src_token))
        hook = _Deferred(self, "dispatch_hook", [recv_x, count]).arrive if return_recv_hook else None
        return recv_x, count, (sources, all_ids, cap, lo), None, hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
        _unmodelled(use_logfmt=(use_logfmt, False), zero_copy=(zero_copy, False), async_finish=(async_finish, False),
                    out=(out, None), combine_wait_recv_cost_stats=(combine_wait_recv_cost_stats, None))
        sources, all_ids, cap, lo = handle
        _require(x.dim() == 3 and x.is_contiguous() and x.dtype == torch.bfloat16,
                 f"x must be a contiguous bfloat16 [E_local, P * C, H], got {x.dtype} {tuple(x.shape)}")
        _require(tuple(x.shape[:2]) == (len(sources), self.num_ranks * cap),
                 f"x is {tuple(x.shape)}; expected [{len(sources)}, {self.num_ranks * cap}, H]")
        self._check_topk(topk_idx, "topk_idx")
        _check_2d(topk_weights, "topk_weights", torch.float32, topk_idx.shape[0])
        _require(topk_weights.shape == topk_idx.shape, "topk_weights must have topk_idx's shape")
        _require(topk_idx.shape[0] <= cap, f"{topk_idx.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank {cap}")
        self._check_low_latency(x.shape[2], topk_idx.shape[1])
        self.calls.append("low_latency_combine")
        k = all_ids.shape[2]
        back = torch.zeros(self.num_ranks, cap, k, x.shape[2], dtype=torch.float32)
        for e, (src_rank, src_token) in enumerate(sources):
            choice = (all_ids[src_rank, src_token] == lo + e).int().argmax(1)  # which of the K it was
            back[src_rank, src_token, choice] = x[e, :src_rank.numel()].float()
        back = self._all_reduce(back.view(-1, x.shape[2])).view(self.num_ranks, cap, k, -1)[self.rank]
        n = topk_idx.shape[0]
        w = torch.where(topk_idx >= 0, topk_weights.float(), torch.zeros_like(topk_weights.float()))  # [n, K]
        combined = (back[:n] * w.unsqueeze(2)).sum(1).to(x.dtype)
        return combined, None, _Deferred(self, "combine_hook", [combined]).arrive if return_recv_hook else None

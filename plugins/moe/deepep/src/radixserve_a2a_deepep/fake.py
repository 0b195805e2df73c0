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

Asynchronous calls (``async_finish=True``, ``return_recv_hook=True``) return their tensors
filled with NaN until the event's ``current_stream_wait()`` or the hook is called, which copies
the results in: a transport that reads them before waiting sees NaN.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
    def __init__(self, rank: int, num_ranks: int, group=None) -> None:
        self.rank, self.num_ranks, self.group = rank, num_ranks, group
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

    # ------------------------------------------------------------------ normal mode
    def get_dispatch_layout(self, topk_idx, num_experts):
        self.calls.append("get_dispatch_layout")
        num_local = num_experts // self.num_ranks
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // num_local, torch.full_like(topk_idx, self.num_ranks))
        in_rank = torch.zeros(topk_idx.shape[0], self.num_ranks + 1, dtype=torch.bool)
        in_rank.scatter_(1, dest.long(), True)
        in_rank = in_rank[:, :self.num_ranks]
        per_expert = torch.bincount(topk_idx[valid].long(), minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(self, x, topk_idx=None, topk_weights=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, async_finish=False):
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

    def combine(self, x, handle, async_finish=False):
        self.calls.append("combine")
        src_rank, src_token, width = handle
        back = torch.zeros(self.num_ranks * width, x.shape[1], dtype=torch.float32)
        back.index_add_(0, src_rank * width + src_token, x.float())
        back = self._all_reduce(back).view(self.num_ranks, width, x.shape[1])
        out = back[self.rank].to(x.dtype)
        return out, None, _Deferred(self, "combine_event", [out]) if async_finish else None

    # ------------------------------------------------------------------ low-latency mode
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        self.calls.append("clean_low_latency_buffer")

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True,
                             async_finish=False, return_recv_hook=False):
        self.calls.append("low_latency_dispatch")
        if use_fp8:
            raise NotImplementedError("the fake buffer models use_fp8=False only")
        cap, n = num_max_dispatch_tokens_per_rank, x.shape[0]
        if n > cap:
            raise AssertionError(f"{n} tokens exceed num_max_dispatch_tokens_per_rank {cap}")
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

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, async_finish=False, return_recv_hook=False):
        self.calls.append("low_latency_combine")
        sources, all_ids, cap, lo = handle
        k = all_ids.shape[2]
        back = torch.zeros(self.num_ranks, cap, k, x.shape[2], dtype=torch.float32)
        for e, (src_rank, src_token) in enumerate(sources):
            choice = (all_ids[src_rank, src_token] == lo + e).int().argmax(1)  # which of the K it was
            back[src_rank, src_token, choice] = x[e, :src_rank.numel()].float()
        back = self._all_reduce(back.view(-1, x.shape[2])).view(self.num_ranks, cap, k, -1)[self.rank]
        n = topk_idx.shape[0]
        w = torch.where(topk_idx >= 0, topk_weights.float(), torch.zeros_like(topk_weights.float()))  # [n, K]
        out = (back[:n] * w.unsqueeze(2)).sum(1).to(x.dtype)
        return out, None, _Deferred(self, "combine_hook", [out]).arrive if return_recv_hook else None

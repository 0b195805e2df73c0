"""The ``deepep`` transport: expert parallelism over DeepEP's ``Buffer``.

Every rank of the EP group holds the same ``T`` tokens (attention is tensor-parallel), as
for ``torch_distributed``. Rank ``r`` hands DeepEP only its share of them,
``split_range(T, P, r)``, so each (token, expert) pair is computed once in the group;
after DeepEP's combine an all-gather over the EP group gives every rank all ``T`` tokens.

Per layer call the transport picks one of DeepEP's two modes (``--deepep-mode``):

``normal`` (prefill)
    ``Buffer.get_dispatch_layout`` then ``Buffer.dispatch`` (NVLink within a node, RDMA
    across nodes); the received rows are the dispatched layout as they are
    (:func:`.convert.normal_to_dispatch`); ``Buffer.combine`` sums each token's rows.
``low_latency`` (decode)
    ``Buffer.low_latency_dispatch`` (bf16, no host sync) into DeepEP's per-expert
    ``[E_local, C, H]`` layout, seen by the runner as ``E_local * C`` rows
    (:func:`.convert.masked_to_dispatch`); ``Buffer.low_latency_combine`` applies the
    routing weights and sums. A rank's share must not exceed
    ``num_max_dispatch_tokens_per_rank`` (the buffer is sized for it).
``auto``
    ``low_latency`` when every rank's share fits the low-latency buffer
    (``ceil(T / P) <= num_max_dispatch_tokens_per_rank``: decode batches), else ``normal``.
    SGLang decides by the batch's forward mode; the MoE layer does not see it, and the
    token count is the same on every EP rank, so all ranks pick the same mode (DeepEP's
    calls are collective). After a normal call the low-latency buffer is cleaned
    (``clean_low_latency_buffer``) before the next low-latency one, as DeepEP requires.

Every call starts asynchronously (``dispatch_async``, ``combine_async``: single- and two-batch
overlap): low-latency calls with ``return_recv_hook=True``, whose ``hook()`` receives the data
when the layer waits (DeepEP's overlap without SMs held), normal calls with
``async_finish=True``, whose event the current stream waits for.

On a single rank there is nothing to move: dispatch and combine are the identity (DeepEP's
intranode kernels take 2, 4 or 8 ranks only). API: DeepEP 2.1.0's legacy ``Buffer``
(github.com/deepseek-ai/DeepEP, commit dd758ca, 2026-07-14, ``deep_ep/buffers/legacy.py``;
usage as in ``tests/legacy/test_intranode.py``, ``tests/legacy/test_low_latency.py`` and
``docs/legacy.md``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from radixserve.plugin_api.moe import DispatchOutput, MoEA2ABackend, MoEContext, Pending, split_range

from radixserve_a2a_deepep.convert import dispatch_to_masked, masked_to_dispatch, normal_to_dispatch

DEEPEP_MODES = ("auto", "normal", "low_latency")
#: SGLang's default cap of tokens per rank in one low-latency dispatch
DEFAULT_LL_MAX_TOKENS_PER_RANK = 128


class DeepEPA2A(MoEA2ABackend):
    name = "deepep"

    def __init__(self, ctx: MoEContext, buffer: Any, *, mode: str = "auto", topk_idx_dtype: torch.dtype = torch.int64,
                 num_max_dispatch_tokens_per_rank: int = DEFAULT_LL_MAX_TOKENS_PER_RANK) -> None:
        super().__init__(ctx)
        if mode not in DEEPEP_MODES:
            raise ValueError(f"--deepep-mode: invalid value {mode!r}; choose from: {', '.join(DEEPEP_MODES)}")
        if ctx.num_experts % ctx.ep_size:
            raise ValueError(f"deepep: {ctx.num_experts} experts do not split evenly over {ctx.ep_size} EP ranks")
        self.buffer = buffer
        self.mode = mode
        self.topk_idx_dtype = topk_idx_dtype
        self.ll_max_tokens = num_max_dispatch_tokens_per_rank
        self.group = ctx.ep_group_or_default() if ctx.ep_size > 1 else None
        self.last_mode: str | None = None

    def resolve_mode(self, num_tokens: int) -> str:
        """``normal`` or ``low_latency`` for a layer call over ``num_tokens`` tokens."""
        if self.mode != "auto":
            return self.mode
        return "low_latency" if -(-num_tokens // self.ctx.ep_size) <= self.ll_max_tokens else "normal"

    def dispatch(self, hidden_states, topk_ids, topk_weights):
        return self.dispatch_async(hidden_states, topk_ids, topk_weights).wait()

    def dispatch_async(self, hidden_states, topk_ids, topk_weights):
        """The dispatch started: low-latency with ``return_recv_hook=True`` (the sends are issued,
        ``hook()`` in ``wait()`` receives, no SM held meanwhile), normal with ``async_finish=True``
        (``wait()`` makes the current stream wait for DeepEP's event)."""
        ctx = self.ctx
        if ctx.ep_size == 1:
            return Pending(DispatchOutput(hidden_states, topk_ids.to(torch.int32), topk_weights.float()))
        t = hidden_states.shape[0]
        start, n = split_range(t, ctx.ep_size, ctx.ep_rank)
        x = hidden_states[start:start + n].contiguous()  # [n, H]
        ids = topk_ids[start:start + n].to(self.topk_idx_dtype).contiguous()  # [n, K] global ids
        weights = topk_weights[start:start + n].float().contiguous()  # [n, K]
        mode = self.resolve_mode(t)
        if mode == "low_latency":
            if n > self.ll_max_tokens:
                raise ValueError(f"deepep low_latency: {n} tokens on EP rank {ctx.ep_rank}, more than the "
                                 f"{self.ll_max_tokens} the low-latency buffer holds; use --deepep-mode auto or normal")
            if self.last_mode == "normal":  # DeepEP: normal kernels leave the low-latency buffer dirty
                self.buffer.clean_low_latency_buffer(self.ll_max_tokens, ctx.hidden_size, ctx.num_experts)
            recv_x, recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
                x, ids, self.ll_max_tokens, ctx.num_experts, use_fp8=False, async_finish=False, return_recv_hook=True)
            self.last_mode = mode

            def received() -> DispatchOutput:
                hook()
                return masked_to_dispatch(recv_x, recv_count, ctx.top_k, ("low_latency", t, n, handle, ids, weights))

            return Pending(finish=received)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(ids, ctx.num_experts)
        recv_x, recv_ids, recv_weights, _, handle, event = self.buffer.dispatch(
            x, topk_idx=ids, topk_weights=weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            async_finish=True)
        self.last_mode = mode

        def finished() -> DispatchOutput:
            event.current_stream_wait()
            return normal_to_dispatch(recv_x, recv_ids, recv_weights, ("normal", t, n, handle))

        return Pending(finish=finished)

    def combine(self, expert_output, dispatched):
        return self.combine_async(expert_output, dispatched).wait()

    def combine_async(self, expert_output, dispatched):
        """The combine started as the dispatch was (hook or event); ``wait()`` receives, then
        all-gathers the ranks' shares."""
        ctx = self.ctx
        if ctx.ep_size == 1:
            return Pending(expert_output)
        mode, t, n, handle = dispatched.handle[:4]
        if mode == "low_latency":
            ids, weights = dispatched.handle[4:]
            share, _, hook = self.buffer.low_latency_combine(
                dispatch_to_masked(expert_output, ctx.num_local_experts), ids, weights, handle, async_finish=False,
                return_recv_hook=True)
            done = hook
        else:
            share, _, event = self.buffer.combine(expert_output.contiguous(), handle, async_finish=True)
            done = event.current_stream_wait

        def gathered() -> torch.Tensor:
            done()
            return self._gather(share[:n].to(expert_output.dtype), t, expert_output)

        return Pending(finish=gathered)

    def _gather(self, share: torch.Tensor, t: int, like: torch.Tensor) -> torch.Tensor:
        """Every rank's ``[n_r, H]`` share -> all ``[T, H]`` tokens in order on every rank."""
        p = self.ctx.ep_size
        sizes = [split_range(t, p, r)[1] for r in range(p)]
        padded = like.new_zeros(max(sizes), like.shape[1])
        padded[:share.shape[0]] = share
        parts = [torch.empty_like(padded) for _ in range(p)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)], dim=0)

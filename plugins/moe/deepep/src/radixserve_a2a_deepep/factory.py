"""The ``deepep`` factory: checks the context and builds one DeepEP ``Buffer`` over the EP
group (imported by the hook, so the entry point's module stays free of torch)."""

from __future__ import annotations

import torch

from radixserve_a2a_deepep import (
    LOW_LATENCY_HIDDEN_SIZES,
    LOW_LATENCY_MAX_TOPK,
    NORMAL_MAX_TOPK,
    unavailable_reason,
)
from radixserve_a2a_deepep.transport import DEEPEP_MODES, DEFAULT_LL_MAX_TOKENS_PER_RANK, DeepEPA2A


def _buffer_sizes(deep_ep, ctx, mode: str, ll_max_tokens: int) -> tuple[int, int]:
    """``(num_nvl_bytes, num_rdma_bytes)`` from DeepEP's own size hints (docs/legacy.md)."""
    p, nvl, rdma = ctx.ep_size, 0, 0
    hidden_bytes = ctx.hidden_size * 2  # bf16 rows
    if mode != "low_latency":
        if p not in (2, 4, 8) and p % 8:
            raise ValueError(f"--moe-a2a-backend deepep: DeepEP's normal kernels take 2, 4 or 8 ranks in a node "
                             f"(or a multiple of 8 across nodes), not --ep-size {p}")
        for config in (deep_ep.Buffer.get_dispatch_config(p), deep_ep.Buffer.get_combine_config(p)):
            nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, p))
            rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, p))
    if mode != "normal":
        rdma = max(rdma, deep_ep.Buffer.get_low_latency_rdma_size_hint(ll_max_tokens, ctx.hidden_size, p,
                                                                        ctx.num_experts))
    return nvl, rdma


def make_transport(ctx, num_max_dispatch_tokens_per_rank: int = DEFAULT_LL_MAX_TOKENS_PER_RANK) -> DeepEPA2A:
    """Factory: checks the context, builds one DeepEP ``Buffer`` over the EP group.

    Refused at start-up (``ValueError``, before DeepEP is looked at): a dtype other than
    bfloat16, a top-k over DeepEP's limits, and with ``--deepep-mode low_latency`` a hidden
    size or top-k the low-latency kernels do not take; ``auto`` then runs every call in
    normal mode instead."""
    mode = ctx.options.deepep_mode if ctx.options is not None else "auto"
    if mode not in DEEPEP_MODES:
        raise ValueError(f"--deepep-mode: invalid value {mode!r}; choose from: {', '.join(DEEPEP_MODES)}")
    if ctx.dtype != torch.bfloat16:
        raise ValueError(f"--moe-a2a-backend deepep: the model runs in {ctx.dtype}; DeepEP moves bfloat16 rows, "
                         "use --dtype bfloat16")
    if ctx.top_k > NORMAL_MAX_TOPK:
        raise ValueError(f"--moe-a2a-backend deepep: DeepEP's kernels take at most {NORMAL_MAX_TOPK} experts per "
                         f"token; this model's top-k is {ctx.top_k}; use --moe-a2a-backend torch_distributed")
    if ctx.hidden_size not in LOW_LATENCY_HIDDEN_SIZES:
        if mode == "low_latency":
            raise ValueError(f"--deepep-mode low_latency: DeepEP's low-latency kernels take hidden sizes "
                             f"{LOW_LATENCY_HIDDEN_SIZES}, not {ctx.hidden_size}; use --deepep-mode normal")
        mode = "normal"  # auto: every call in normal mode
    if ctx.top_k > LOW_LATENCY_MAX_TOPK:
        if mode == "low_latency":
            raise ValueError(f"--deepep-mode low_latency: DeepEP's low-latency kernels take top-k <= "
                             f"{LOW_LATENCY_MAX_TOPK} (kNumMaxTopK in its internode_ll.cu); this model routes each "
                             f"token to {ctx.top_k} experts (top-k {ctx.top_k}); use --deepep-mode normal or auto")
        mode = "normal"  # auto: every call in normal mode
    if ctx.ep_size == 1:  # nothing to move; DeepEP is never called
        return DeepEPA2A(ctx, None, mode=mode, num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank)
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"--moe-a2a-backend deepep is unavailable: {reason}")
    import deep_ep

    nvl, rdma = _buffer_sizes(deep_ep, ctx, mode, num_max_dispatch_tokens_per_rank)
    low_latency = mode != "normal"
    buffer = deep_ep.Buffer(ctx.ep_group_or_default(), nvl, rdma, low_latency_mode=low_latency,
                            num_qps_per_rank=ctx.num_local_experts if low_latency else 1)
    return DeepEPA2A(ctx, buffer, mode=mode, topk_idx_dtype=deep_ep.topk_idx_t,
                     num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank)

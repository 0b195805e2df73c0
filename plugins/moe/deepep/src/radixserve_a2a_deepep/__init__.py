"""radixserve MoE all-to-all transport ``deepep`` over DeepEP (deepseek-ai/DeepEP).

``--moe-a2a-backend deepep --deepep-mode auto|normal|low_latency`` (SGLang's flags): DeepEP's
high-throughput kernels for prefill, its low-latency kernels for decode (see
:mod:`.transport`). Needs NVIDIA GPUs (Hopper sm90 for DeepEP's SM90 build) linked by NVLink
within a node (RDMA across nodes), bf16 activations, and ``deep_ep`` installed (the PyPI name
``deep-ep`` is a placeholder; see the README). ``deep_ep`` is imported by the factory and,
on a GPU only, by the probe; :mod:`.convert` and :mod:`.transport` never import it.
"""

from __future__ import annotations

import importlib.util

import torch
from radixserve.hookspecs import hookimpl

from radixserve_a2a_deepep.transport import DEEPEP_MODES, DEFAULT_LL_MAX_TOKENS_PER_RANK, DeepEPA2A

__all__ = ["DEEPEP_MODES", "DeepEPA2A", "make_transport", "unavailable_reason"]

#: hidden sizes DeepEP's low-latency kernels are compiled for (SWITCH_HIDDEN in
#: csrc/kernels/legacy/launch.cuh)
LOW_LATENCY_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)


def unavailable_reason() -> str | None:
    """``None`` where DeepEP can run, else why not."""
    if not torch.cuda.is_available():
        return "needs CUDA: NVIDIA sm90 (Hopper) GPUs linked by NVLink, with deep_ep installed"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"needs an sm90 (Hopper) or newer GPU; this one is sm{major}{minor}"
    if importlib.util.find_spec("deep_ep") is None:
        return "deep_ep is not installed (see plugins/moe/deepep/README.md)"
    try:
        import deep_ep  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken build is reported, not raised
        return f"deep_ep failed to import: {type(e).__name__}: {e}"
    return None


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
    """Factory: checks the context, builds one DeepEP ``Buffer`` over the EP group."""
    mode = ctx.deepep_mode
    if mode not in DEEPEP_MODES:
        raise ValueError(f"--deepep-mode: invalid value {mode!r}; choose from: {', '.join(DEEPEP_MODES)}")
    if ctx.dtype != torch.bfloat16:
        raise ValueError(f"--moe-a2a-backend deepep: the model runs in {ctx.dtype}; DeepEP moves bfloat16 rows, "
                         "use --dtype bfloat16")
    if ctx.hidden_size not in LOW_LATENCY_HIDDEN_SIZES:
        if mode == "low_latency":
            raise ValueError(f"--deepep-mode low_latency: DeepEP's low-latency kernels take hidden sizes "
                             f"{LOW_LATENCY_HIDDEN_SIZES}, not {ctx.hidden_size}; use --deepep-mode normal")
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


@hookimpl
def register_moe_a2a_backends(register):
    register("deepep", make_transport, probe=unavailable_reason,
             description="DeepEP all-to-all: normal (prefill) and low-latency (decode) dispatch/combine, "
                         "--deepep-mode auto|normal|low_latency; NVLink/RDMA GPUs, bf16")

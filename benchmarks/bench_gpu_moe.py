"""MoE timings on a GPU (``bench_gpu.py moe`` and ``bench_gpu.py a2a``; they were "timing
tests" that asserted nothing, now benchmarks):

``moe``: each MoE runner available here (``deep_gemm``, ``deep_gemm_bf16``, ``triton``) against
``torch_native``, one layer's forward in bf16 at released MoE models' shapes and several batch
sizes (CUDA events, median of repeats), with the normwise error against torch_native.

``a2a``: one dispatch + combine of the ``deepep`` transport against ``torch_distributed``, one
rank per GPU over NCCL (2, 4 or 8 GPUs: DeepEP's intranode kernels take no other count).
"""

from __future__ import annotations

import time

import torch

#: (name, experts, top_k, hidden, intermediate): released MoE models' shapes (multiples of 128)
MOE_SHAPES = [("qwen2-moe-a2.7b", 60, 4, 2048, 1408), ("qwen3-moe-30b-a3b", 128, 8, 2048, 768),
              ("bench-0.5b", 48, 8, 1024, 512)]
MOE_RUNNERS = ("deep_gemm", "deep_gemm_bf16", "triton")


def _cuda_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return sorted(times)[len(times) // 2]


def bench_moe(batches: list[int], runners: tuple[str, ...] = MOE_RUNNERS) -> list[dict]:
    from radixserve.layers.moe import ExpertWeights, MoEContext, select_experts
    from radixserve.registry import get_registry

    registry = get_registry()
    rows = []
    for name, e, k, h, i in MOE_SHAPES:
        ctx = MoEContext(num_experts=e, top_k=k, hidden_size=h, intermediate_size=i, dtype=torch.bfloat16,
                         device=torch.device("cuda"))
        native = registry.get("moe_runner", "torch_native").factory(ctx)
        available = {}
        for rn in runners:
            entry = registry.entries["moe_runner"].get(rn)
            reason = "not installed" if entry is None else entry.unavailable_reason()
            if reason is None:
                available[rn] = entry.factory(ctx)
            else:
                rows.append({"shape": name, "runner": rn, "skipped": reason})
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) / h ** 0.5).to(torch.bfloat16)
        w2 = (torch.randn(e, h, i, device="cuda", generator=gen) / i ** 0.5).to(torch.bfloat16)
        base_state = native.prepare(ExpertWeights(w13, w2))
        states = {rn: r.prepare(ExpertWeights(w13, w2)) for rn, r in available.items()}
        for n in batches:
            x = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16)
            ids, weights = select_experts(torch.randn(n, e, device="cuda", generator=gen), k, True)
            ref = native.forward(x, ids, weights, base_state).float()
            base_ms = _cuda_ms(lambda: native.forward(x, ids, weights, base_state))  # noqa: B023
            for rn, runner in available.items():
                out = runner.forward(x, ids, weights, states[rn]).float()
                ms = _cuda_ms(lambda: runner.forward(x, ids, weights, states[rn]))  # noqa: B023
                rows.append({"shape": name, "runner": rn, "batch": n, "ms": ms, "torch_native_ms": base_ms,
                             "error": float((out - ref).norm() / ref.norm())})
    return rows


def moe_table(rows: list[dict]) -> str:
    lines = ["| shape | runner | batch | ms | torch_native ms | speedup | normwise error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['runner']} | | skipped: {r['skipped']} | | | |")
        else:
            lines.append(f"| {r['shape']} | {r['runner']} | {r['batch']} | {r['ms']:.3f} | {r['torch_native_ms']:.3f} "
                         f"| {r['torch_native_ms'] / r['ms']:.2f}x | {r['error']:.2e} |")
    return "\n".join(lines)


def _a2a_rank(rank: int, world_size: int, init_method: str, num_tokens: int) -> list[dict]:
    import torch.distributed as dist
    from radixserve.layers.moe import MoEContext, select_experts
    from radixserve.registry import get_registry

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world_size)
    ctx = MoEContext(num_experts=64, top_k=8, hidden_size=4096, intermediate_size=256, dtype=torch.bfloat16,
                     device=torch.device("cuda", rank), ep_rank=rank, ep_size=world_size)
    x = torch.randn(num_tokens, 4096, device="cuda").to(torch.bfloat16)
    ids, w = select_experts(torch.randn(num_tokens, 64, device="cuda"), 8, True)
    rows = []
    for name in ("deepep", "torch_distributed"):
        a2a = get_registry().get("moe_a2a", name).factory(ctx)

        def step():
            d = a2a.dispatch(x, ids, w)  # noqa: B023
            return a2a.combine(d.hidden_states, d)  # noqa: B023
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        rows.append({"tokens": num_tokens, "ranks": world_size, "transport": name,
                     "ms": (time.perf_counter() - t0) * 100})
    dist.destroy_process_group()
    return rows


def bench_a2a(token_counts: list[int]) -> tuple[list[dict], str | None]:
    """Rows, or a reason the transport cannot be timed here."""
    from radixserve.registry import get_registry
    from radixserve.testing.multi_rank import run_ranks

    entry = get_registry().entries["moe_a2a"].get("deepep")
    reason = "the deepep plugin is not installed" if entry is None else entry.unavailable_reason()
    count = torch.cuda.device_count()
    if reason is None and count < 2:
        reason = f"{count} GPU(s): DeepEP's intranode kernels need 2, 4 or 8 ranks, one GPU each"
    if reason is not None:
        return [], reason
    world = 8 if count >= 8 else 4 if count >= 4 else 2
    rows = []
    for n in token_counts:
        rows.extend(run_ranks(_a2a_rank, world, n, timeout_s=300)[0])
    return rows, None


def a2a_table(rows: list[dict]) -> str:
    lines = ["| tokens | ranks | transport | dispatch + combine ms |", "|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['ranks']} | {r['transport']} | {r['ms']:.3f} |" for r in rows]
    return "\n".join(lines)

"""The triton MoE runner on a GPU at real sizes: against a float32 torch reference (the
contract's math, one GEMM per expert), the MoE conformance suite on CUDA tensors, a CUDA
graph capture of a decode-sized forward (the alignment never syncs with the host), and
timings against the torch_native runner.

Bounded relative error, max |triton - reference| / max |reference|: 2e-2 in bfloat16, 3e-3
in float16 and 1e-4 in float32 (``ieee`` products, longer sums than on CPU).

Run with ``-s`` to see the timings (plugins/moe/triton/scripts/gpu_check.sh does).
"""

from __future__ import annotations

import functools

import pytest
import torch
from moe_cases import experts, hidden_states, reference, rel_error, routing
from radixserve.layers.moe import ExpertWeights, MoEContext
from radixserve_moe_triton import make_runner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA or ROCm GPU (CPU: test_moe_triton_kernels.py)",
    ),
]

GPU_BOUND = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}

#: (name, experts, top_k, hidden, intermediate): the shapes of released MoE models
MODELS = [
    ("mixtral-8x7b", 8, 2, 4096, 14336),
    ("qwen2-moe-a2.7b", 60, 4, 2048, 1408),
    ("qwen3-moe-30b-a3b", 128, 8, 2048, 768),
    ("bench-0.5b", 48, 8, 1024, 512),  # the shape of benchmarks/bench_moe.py
]
BATCHES = (1, 7, 32, 256, 2048)


@pytest.fixture(autouse=True)
def _compiled_kernels():
    from radixserve_moe_triton import kernels

    if kernels.INTERPRETED:
        pytest.skip("TRITON_INTERPRET is set: these tests run compiled kernels; unset it")


def _ctx(e, k, h, i, dtype) -> MoEContext:
    return MoEContext(num_experts=e, top_k=k, hidden_size=h, intermediate_size=i, dtype=dtype,
                      device=torch.device("cuda"))


def torch_reference(x, ids, weights, w13, w2) -> torch.Tensor:
    """The runner contract in float32 on the GPU, one GEMM per expert with tokens."""
    xf = x.float()
    out = torch.zeros_like(xf)
    inter = w2.shape[2]
    for e in torch.unique(ids[ids >= 0]).tolist():
        rows, cols = torch.nonzero(ids == e, as_tuple=True)
        gate_up = xf[rows] @ w13[e].float().T
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, rows, (h @ w2[e].float().T) * weights[rows, cols, None])
    return out


@functools.lru_cache(maxsize=2)
def _experts(e, h, i, dtype, seed):
    return experts(e, h, i, dtype, device="cuda", seed=seed)


def _setup(model, n, dtype, seed=0, **routing_kw):
    _, e, k, h, i = model
    w13, w2 = _experts(e, h, i, dtype, seed)
    ids, weights = routing(n, e, k, device="cuda", seed=seed, **routing_kw)
    x = hidden_states(n, h, dtype, device="cuda", seed=seed)
    return x, ids, weights, w13, w2


@pytest.mark.parametrize("n", BATCHES)
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m[0])
def test_real_sizes_bf16(model, n):
    x, ids, weights, w13, w2 = _setup(model, n, torch.bfloat16, skew=0.5)
    runner = make_runner(_ctx(*model[1:], torch.bfloat16))
    out = runner.forward(x, ids, weights, runner.prepare(ExpertWeights(w13, w2)))
    err = rel_error(out, torch_reference(x, ids, weights, w13, w2))
    assert err <= GPU_BOUND[torch.bfloat16], f"{model[0]} n={n}: relative error {err:.3g}"


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("n", (1, 100, 1000))
def test_dtypes_dropped_ids_and_empty_experts(dtype, n):
    model = ("qwen2-moe-a2.7b", 60, 4, 2048, 1408)
    x, ids, weights, w13, w2 = _setup(model, n, dtype, seed=1, skew=2.0, empty=(0, 7, 59),
                                      drop=0.3)
    runner = make_runner(_ctx(*model[1:], dtype))
    out = runner.forward(x, ids, weights, runner.prepare(ExpertWeights(w13, w2)))
    err = rel_error(out, torch_reference(x, ids, weights, w13, w2))
    assert err <= GPU_BOUND[dtype], f"{dtype} n={n}: relative error {err:.3g}"


def test_gpu_reference_is_the_oracle():
    """The float32 GPU reference used above agrees with ``reference_moe`` (small sizes)."""
    x, ids, weights, w13, w2 = _setup(("small", 8, 2, 256, 128), 20, torch.float32, drop=0.2)
    ref = reference(x, ids, weights, w13, w2)
    assert rel_error(torch_reference(x, ids, weights, w13, w2).cpu(), ref) <= 1e-5


def test_conformance_suite_on_cuda():
    from radixserve.testing.moe_conformance import CASES, run_case

    for case in CASES:
        if case.dtype == torch.bfloat16 and case.num_tokens * case.top_k > 1024:
            continue  # the CPU oracle's per-pair loop; the float32 twin runs
        run_case(make_runner, case, device="cuda")


def test_decode_forward_in_a_cuda_graph():
    """No host sync anywhere in a forward: a decode-sized batch is captured once and
    replayed with new routings and activations."""
    model = ("qwen3-moe-30b-a3b", 128, 8, 2048, 768)
    x, ids, weights, w13, w2 = _setup(model, 8, torch.bfloat16)
    runner = make_runner(_ctx(*model[1:], torch.bfloat16))
    state = runner.prepare(ExpertWeights(w13, w2))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: compile the kernels outside the capture
            runner.forward(x, ids, weights, state)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = runner.forward(x, ids, weights, state)
    for seed in (1, 2):
        new_x, new_ids, new_w, _, _ = _setup(model, 8, torch.bfloat16, seed=seed, drop=0.2)
        x.copy_(new_x)
        ids.copy_(new_ids)
        weights.copy_(new_w)
        graph.replay()
        torch.cuda.synchronize()
        err = rel_error(out, torch_reference(x, ids, weights, w13, w2))
        assert err <= GPU_BOUND[torch.bfloat16], f"replay {seed}: relative error {err:.3g}"


def _time_ms(runner, args: tuple, iters: int = 20) -> float:
    """Mean milliseconds of ``runner.forward(*args)``."""
    for _ in range(3):
        runner.forward(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        runner.forward(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m[0])
def test_timing_against_torch_native(model):
    """Prints one TIMING line per batch size (ms per layer forward, bf16); asserts nothing
    about speed, only that both runners agree."""
    from radixserve_moe_torch import TorchNativeMoERunner

    name, e, k, h, i = model
    ctx = _ctx(e, k, h, i, torch.bfloat16)
    triton_runner, native = make_runner(ctx), TorchNativeMoERunner(ctx)
    w13, w2 = _experts(e, h, i, torch.bfloat16, 0)
    t_state = triton_runner.prepare(ExpertWeights(w13, w2))
    n_state = native.prepare(ExpertWeights(w13, w2))
    for n in (1, 32, 256, 4096):
        ids, weights = routing(n, e, k, device="cuda", seed=n)
        x = hidden_states(n, h, torch.bfloat16, device="cuda", seed=n)
        ms_t = _time_ms(triton_runner, (x, ids, weights, t_state))
        ms_n = _time_ms(native, (x, ids, weights, n_state))
        out_t = triton_runner.forward(x, ids, weights, t_state)
        out_n = native.forward(x, ids, weights, n_state)
        # bytes of the experts actually read, for a bandwidth figure at decode sizes
        used = int(torch.unique(ids).numel())
        gbps = used * (w13[0].numel() + w2[0].numel()) * 2 / ms_t / 1e6
        print(f"TIMING {name:18s} n={n:5d} triton {ms_t:8.3f} ms  torch_native {ms_n:8.3f} ms  "
              f"speedup {ms_n / ms_t:6.2f}x  expert weights read {gbps:7.0f} GB/s")
        assert rel_error(out_t, out_n) <= 2 * GPU_BOUND[torch.bfloat16]

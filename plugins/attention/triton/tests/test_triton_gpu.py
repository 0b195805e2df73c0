"""The triton backend on a GPU at real sizes: the same comparisons with torch_native as the
interpreter tests, a CUDA-graph capture of a decode step, and timings of both kernels
against torch's scaled_dot_product_attention on dense (unpaged) K/V.

Bounded relative error, max |triton - torch_native| / max |torch_native|: 2e-2 in
bfloat16, 1e-2 in float16 and 1e-4 in float32 (longer sums than on CPU).

Run with ``-s`` to see the timings (plugins/attention/triton/scripts/gpu_check.sh does).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F
from radixserve.layers.attention import AttentionContext
from radixserve.testing.attention_conformance import KV_DTYPE_CASES, MLA_CASES, run_case
from radixserve_attention_triton import make_backend
from triton_paged_batch import build, compare, decode, extend, random_tree, run, verify

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA or ROCm GPU (CPU: test_triton_kernels.py)",
    ),
]

GPU_BOUND = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _compiled_kernels():
    from radixserve_attention_triton import kernels

    if kernels.INTERPRETED:
        pytest.skip("TRITON_INTERPRET is set: these tests time compiled kernels; unset it")


def _lens(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    rnd = random.Random(seed)
    return tuple(rnd.randint(lo, hi) for _ in range(n))


def _specs() -> list:
    out = []
    bf16 = torch.bfloat16
    for page in (1, 16):
        for heads, kv in ((32, 32), (24, 8), (32, 4)):  # GQA ratios 1, 3, 8
            for dim in (64, 128):
                # empty, mid-page and long prefixes; mixed extend lengths in one launch
                out.append(
                    extend(
                        page,
                        heads,
                        kv,
                        dim,
                        (0, 1000, 517, 2047, 0, 33),
                        (512, 37, 1, 300, 129, 700),
                        dtype=bf16,
                    )
                )
                out.append(
                    decode(
                        page,
                        heads,
                        kv,
                        dim,
                        (1, 17, 255, 256, 257, 4095) + _lens(26, 1, 8192, dim),
                        dtype=bf16,
                    )
                )
    for dim, heads, kv in ((96, 32, 8), (256, 16, 4)):
        out.append(extend(16, heads, kv, dim, (0, 700, 33), (300, 64, 1000), dtype=bf16))
        out.append(decode(16, heads, kv, dim, _lens(16, 1, 6000, dim), dtype=bf16))
    out.append(
        extend(16, 32, 8, 128, (0, 3000, 77), (2000, 500, 1), sliding_window=1024, dtype=bf16)
    )
    out.append(decode(16, 32, 8, 128, _lens(16, 1, 8192, 1), sliding_window=1024, dtype=bf16))
    out.append(extend(16, 32, 8, 128, (0, 1000, 33), (512, 100, 1), dtype=torch.float16))
    out.append(extend(16, 24, 8, 128, (0, 1000, 33), (512, 100, 1), dtype=torch.float32))
    out.append(decode(16, 24, 8, 128, _lens(16, 1, 8192, 2), dtype=torch.float32))
    # target verify: draft trees over long prefixes, several query blocks, any node order
    trees = (random_tree(64, 1), random_tree(8, 2), tuple(range(-1, 5)), (-1,))
    trees += (random_tree(129, 3, shuffled=True),)
    for page, dtype in ((1, bf16), (16, bf16), (16, torch.float32)):
        out.append(verify(page, 32, 8, 128, (1000, 0, 4000, 517, 33), trees, dtype=dtype))
    out.append(verify(16, 32, 8, 128, (3000, 77), trees[3:], sliding_window=1024, dtype=bf16))
    out.append(verify(16, 24, 8, 128, (300, 20), trees[:2], sliding_window=4, dtype=bf16))
    return out


@pytest.mark.parametrize("case", KV_DTYPE_CASES, ids=str)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=str)
def test_kv_dtypes_conform_on_gpu(case, act):
    """Narrow pools (--kv-cache-dtype) through compiled kernels, with float32 and bfloat16
    activations (bf16: the softmax weights round to bf16 too, hence the looser bound)."""
    ctx = AttentionContext(num_heads=1, num_kv_heads=1, head_dim=64, num_layers=1, dtype=act,
                           device=torch.device("cuda"), page_size=1, max_context_len=8,
                           max_batch_size=1, kv_dtype=case.kv_dtype)
    if case.kv_dtype not in make_backend(ctx).supported_kv_dtypes:
        pytest.skip(f"{case.kv_dtype} is not converted by Triton on this GPU")
    tol = 1e-4 if act == torch.float32 else 3e-2
    run_case(make_backend, dataclasses.replace(case, dtype=act), device="cuda", atol=tol, rtol=tol)


@pytest.mark.parametrize("case", MLA_CASES, ids=str)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=str)
def test_mla_conforms_on_gpu(case, act):
    """MLA through compiled kernels: the latent's two tiles with V from the first, DeepSeek-V3's
    512 + 64 included, and the expanded prefill."""
    tol = 1e-4 if act == torch.float32 else 3e-2
    run_case(make_backend, dataclasses.replace(case, dtype=act), device="cuda", atol=tol, rtol=tol)


@pytest.mark.parametrize("spec", _specs(), ids=str)
def test_matches_torch_native_real_sizes(spec):
    compare(make_backend, spec, device="cuda", bound=GPU_BOUND[spec.dtype])


def test_decode_step_in_a_cuda_graph():
    """Decode metadata and both stages capture in a CUDA graph; replaying with shorter
    sequence lengths written into the captured tensors gives the eager result."""
    built = build(
        decode(16, 32, 8, 128, (300, 4000, 17, 1000, 8000, 64, 2, 5000), dtype=torch.bfloat16),
        device="cuda",
    )
    batch = built.batch
    backend = make_backend(built.ctx)
    backend.init_cuda_graph_state(batch.batch_size)
    run(backend, built)  # compile the kernels before capturing
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(backend, built)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.init_forward_metadata_capture_cuda_graph(batch)
        out = backend.forward(built.q, built.k, built.v, built.layer, batch)
    # Shorter sequences: only the tensors the graph captured change.
    shorter = [max(1, n // 3) for n in batch.seq_lens_cpu]
    batch.seq_lens.copy_(torch.tensor(shorter, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    batch.seq_lens_cpu = shorter
    expected = run(backend, built)
    torch.testing.assert_close(replayed, expected, rtol=0, atol=0)


# ------------------------------------------------------------------ timings
def _ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100)


def _report(name: str, times: dict[str, float]) -> None:
    parts = "  ".join(f"{k} {v:.3f} ms" for k, v in times.items())
    print(f"\nTIMING {name}: {parts}")


def _dense_kv(batch, length: int):
    """Each request's first ``length`` K/V rows, dense and contiguous: ``[B, Hkv, L, D]`` each,
    what SDPA attends over without a paged pool."""
    slots = batch.req_to_token[batch.req_pool_indices, :length]  # [B, L]
    keys = batch.kv_pool.k_buffers[0][slots].transpose(1, 2).contiguous()
    values = batch.kv_pool.v_buffers[0][slots].transpose(1, 2).contiguous()
    return keys, values


def _check_and_time(triton_backend, built, out, ref, sdpa) -> dict[str, float]:
    """Check triton's output against dense SDPA's, then time triton, SDPA and torch_native
    on the same step (triton's metadata is restored on the batch afterwards)."""
    from radixserve_attention_torch import TorchNativeAttention

    rel = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert rel < GPU_BOUND[torch.bfloat16], rel
    batch = built.batch
    times = {
        "triton": _ms(lambda: triton_backend.forward(built.q, built.k, built.v, built.layer, batch)),
        "sdpa_dense": _ms(sdpa),
    }
    native = TorchNativeAttention(built.ctx)
    native.init_forward_metadata(batch)
    times["torch_native"] = _ms(lambda: native.forward(built.q, built.k, built.v, built.layer, batch))
    triton_backend.init_forward_metadata(batch)
    return times


@pytest.mark.parametrize("batch_size,seq_len", [(1, 32768), (8, 8192), (64, 2048), (256, 1024)])
def test_decode_timing_vs_sdpa(batch_size, seq_len):
    heads, kv, dim = 32, 8, 128
    built = build(
        decode(16, heads, kv, dim, (seq_len,) * batch_size, dtype=torch.bfloat16), device="cuda"
    )
    triton_backend = make_backend(built.ctx)
    out = run(triton_backend, built)
    keys, values = _dense_kv(built.batch, seq_len)
    q = built.q.view(batch_size, heads, 1, dim)

    def sdpa():
        return F.scaled_dot_product_attention(q, keys, values, scale=dim**-0.5, enable_gqa=True)

    times = _check_and_time(triton_backend, built, out, sdpa().view(batch_size, heads, dim), sdpa)
    _report(
        f"decode B={batch_size} L={seq_len} H={heads}/{kv} D={dim} bf16 "
        f"splits={triton_backend._num_splits[:batch_size].max().item()}",
        times,
    )


@pytest.mark.parametrize(
    "batch_size,prefix,new", [(1, 0, 8192), (4, 0, 2048), (4, 4096, 512), (16, 0, 512)]
)
def test_extend_timing_vs_sdpa(batch_size, prefix, new):
    heads, kv, dim = 32, 8, 128
    built = build(
        extend(
            16, heads, kv, dim, (prefix,) * batch_size, (new,) * batch_size, dtype=torch.bfloat16
        ),
        device="cuda",
    )
    triton_backend = make_backend(built.ctx)
    out = run(triton_backend, built)
    total = prefix + new
    keys, values = _dense_kv(built.batch, total)
    q = built.q.view(batch_size, new, heads, dim).transpose(1, 2)  # [B, H, new, D]
    mask = None
    if prefix:  # bottom-right aligned causal mask
        pos = torch.arange(total, device="cuda")
        mask = pos[None, :] <= pos[prefix:, None]

    def sdpa():
        return F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None,
            scale=dim**-0.5,
            enable_gqa=True,
        )

    ref = sdpa().transpose(1, 2).reshape(-1, heads, dim)
    times = _check_and_time(triton_backend, built, out, ref, sdpa)
    _report(f"extend B={batch_size} prefix={prefix} new={new} H={heads}/{kv} D={dim} bf16", times)

"""fa3 / fa2 with the real kernels on a GPU: the shared conformance suite at real sizes (head
dims 64/128/256, GQA, page sizes 1/16/64 (and 256 for FA2's own paged path), long prefixes,
sliding windows, target verify, mixed steps, an fp8 pool), a CUDA-graph capture of decode
replayed against eager, and timings against torch SDPA (``TIMING`` lines, run with ``-s``).

Each test skips with the backend's probe reason where it cannot run (no GPU, no library, not
Hopper for fa3). plugins/attention/flash_attn/scripts/gpu_check.sh runs them.
"""

from __future__ import annotations

import math
import random

import pytest
import radixserve_attention_flash_attn as plugin
import torch
import torch.nn.functional as F
from radixserve.layers.attention import AttentionContext, AttentionLayer, ForwardBatch, ForwardMode
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.testing.attention_conformance import Case, run_case

pytestmark = pytest.mark.gpu

PROBES = {"fa3": plugin.fa3_unavailable_reason, "fa2": plugin.fa2_unavailable_reason}
FACTORIES = {"fa3": plugin.make_fa3, "fa2": plugin.make_fa2}
BF16 = torch.bfloat16
TOL = 2e-2  # bf16 inputs and output, float32 reference over the same (rounded) inputs


@pytest.fixture(params=["fa3", "fa2"])
def version(request):
    reason = PROBES[request.param]()
    if reason is not None:
        pytest.skip(f"{request.param}: {reason}")
    return request.param


def _lens(n: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    rnd = random.Random(seed)
    return tuple(rnd.randint(lo, hi) for _ in range(n))


def _cases() -> list[Case]:
    out = []
    for page in (1, 16, 64):
        for heads, kv, dim in ((32, 8, 64), (32, 8, 128), (16, 4, 256), (16, 16, 128), (32, 1, 128)):
            out.append(Case("extend", page, heads, kv, dim, (0, 1000, 517, 2047, 33), (300, 37, 1, 129, 64),
                            dtype=BF16))
            decode = _lens(12, 1, 4096, dim + page)
            out.append(Case("decode", page, heads, kv, dim, decode, (1,) * len(decode), dtype=BF16))
    for page in (16, 256):
        out.append(Case("extend", page, 32, 8, 128, (0, 3000, 77), (600, 200, 1), sliding_window=1024, dtype=BF16))
        out.append(Case("decode", page, 32, 8, 128, _lens(8, 1, 4000, 1), (1,) * 8, sliding_window=1024,
                        dtype=BF16))
        out.append(Case("decode", page, 32, 8, 128, (2048, 4000, 2500, 7), (1,) * 4, shared_prefix=2048,
                        dtype=BF16))
        out.append(Case("mixed", page, 32, 8, 128, (0, 700, 1500, 30), (400, 1, 1, 1), dtype=BF16))
        out.append(Case("extend", page, 32, 8, 128, (0, 1000, 33), (512, 100, 1), dtype=torch.float16))
    tree = (-1, 0, 0, 1, 1, 2, 4, 6, 7, 7, 3, 3)
    chain = tuple(range(-1, 7))
    for page in (1, 16, 256):
        out.append(Case("verify", page, 32, 8, 128, (1000, 0, 3000), (12, 8, 1), trees=(tree, chain, (-1,)),
                        dtype=BF16))
    out.append(Case("verify", 16, 32, 8, 128, (3000, 77), (12, 8), sliding_window=1024, trees=(tree, chain),
                    dtype=BF16))
    out.append(Case("decode", 16, 32, 8, 128, _lens(8, 1, 4000, 2), (1,) * 8, kv_dtype=torch.float8_e4m3fn,
                    dtype=BF16))
    return out


@pytest.mark.parametrize("case", _cases(), ids=str)
def test_conforms_at_real_sizes(version, case):
    err = run_case(FACTORIES[version], case, device="cuda", atol=TOL, rtol=TOL)
    assert math.isfinite(err)


# ------------------------------------------------------------------ a decode batch on the GPU
def _decode_step(page: int, heads: int, kv: int, dim: int, seq_lens, *, seed=0, max_ctx=None):
    """A one-layer pool on the GPU holding each request's tokens, with the new tokens' q, k, v."""
    gen = torch.Generator().manual_seed(seed)
    n = len(seq_lens)
    max_ctx = max_ctx or max(seq_lens) + page
    num_pages = sum(math.ceil(s / page) for s in seq_lens) + 2
    pool = KVPool(num_layers=1, num_pages=num_pages, page_size=page, num_kv_heads=kv, head_dim=dim,
                  dtype=BF16, device="cuda")
    r2t = ReqToTokenPool(n + 1, max_ctx, "cuda")
    pages = pool.allocator.allocate(num_pages - 2)
    random.Random(seed).shuffle(pages)
    rows, last, start = [], [], 0
    for i, s in enumerate(seq_lens):
        own = pages[start:start + math.ceil(s / page)]
        start += len(own)
        r2t.write(i, own, page, 0, s)
        slots = r2t.req_to_token[i, :s]
        pool.k_buffers[0][slots] = torch.randn(s, kv, dim, generator=gen).to("cuda", BF16)
        pool.v_buffers[0][slots] = torch.randn(s, kv, dim, generator=gen).to("cuda", BF16)
        rows.append(i)
        last.append(int(slots[-1]))
    batch = ForwardBatch(
        mode=ForwardMode.DECODE, batch_size=n, input_ids=torch.zeros(n, dtype=torch.int64, device="cuda"),
        positions=torch.tensor(seq_lens, device="cuda") - 1, req_pool_indices=torch.tensor(rows, device="cuda"),
        seq_lens=torch.tensor(seq_lens, device="cuda"), out_cache_loc=torch.tensor(last, device="cuda"),
        seq_lens_cpu=list(seq_lens), prefix_lens_cpu=[s - 1 for s in seq_lens], extend_lens_cpu=[1] * n,
        req_to_token=r2t.req_to_token, kv_pool=pool, logits_indices=torch.arange(n, device="cuda"))
    ctx = AttentionContext(num_heads=heads, num_kv_heads=kv, head_dim=dim, num_layers=1, dtype=BF16,
                           device=torch.device("cuda"), page_size=page, max_context_len=max_ctx,
                           max_batch_size=n)
    q = torch.randn(n, heads, dim, generator=gen).to("cuda", BF16)
    k_new = pool.k_buffers[0][batch.out_cache_loc].clone()  # rewriting the last token's own K/V
    v_new = pool.v_buffers[0][batch.out_cache_loc].clone()
    return ctx, batch, AttentionLayer(0, heads, kv, dim, dim ** -0.5), q, k_new, v_new


def test_decode_step_in_a_cuda_graph(version):
    """Capture a decode step with the protocol's capture hook, write shorter lengths into the
    static tensors, run the replay hook and replay: the eager result (up to bf16 rounding: the
    eager page table is narrower, so the kernel may split the keys differently)."""
    page = 256 if version == "fa2" else 16  # fa2 captures only on its paged path
    seqs = [300, 4000, 17, 1000, 8000, 64, 2, 5000]
    ctx, batch, layer, q, k, v = _decode_step(page, 32, 8, 128, seqs, max_ctx=8192)
    backend = FACTORIES[version](ctx)
    assert backend.supports_cuda_graph
    backend.init_cuda_graph_state(len(seqs))
    backend.init_forward_metadata_capture_cuda_graph(batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            backend.forward(q, k, v, layer, batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, layer, batch)
    shorter = [max(1, s // 3) for s in seqs]
    batch.seq_lens.copy_(torch.tensor(shorter, device="cuda"))
    batch.seq_lens_cpu = shorter
    batch.out_cache_loc.copy_(batch.req_to_token[batch.req_pool_indices, batch.seq_lens - 1])
    backend.init_forward_metadata_replay_cuda_graph(batch)
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    backend.init_forward_metadata(batch)
    expected = backend.forward(q, k, v, layer, batch)
    torch.testing.assert_close(replayed, expected, rtol=1.6e-2, atol=1e-3)


# ------------------------------------------------------------------ timings
def _ms(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _report(name: str, times: dict[str, float]) -> None:
    parts = "  ".join(f"{k} {v:.3f} ms" for k, v in times.items())
    print(f"\nTIMING {name}: {parts}")


@pytest.mark.parametrize("batch_size,seq_len", [(1, 32768), (8, 8192), (64, 2048), (256, 1024)])
def test_decode_timing_vs_sdpa(version, batch_size, seq_len):
    heads, kv, dim = 32, 8, 128
    page = 256 if version == "fa2" else 16
    ctx, batch, layer, q, k, v = _decode_step(page, heads, kv, dim, [seq_len] * batch_size)
    backend = FACTORIES[version](ctx)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer, batch)
    slots = batch.req_to_token[batch.req_pool_indices, :seq_len]  # [B, L]
    keys = batch.kv_pool.k_buffers[0][slots].transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    values = batch.kv_pool.v_buffers[0][slots].transpose(1, 2).contiguous()
    qd = q.view(batch_size, heads, 1, dim)

    def sdpa():
        return F.scaled_dot_product_attention(qd, keys, values, scale=dim ** -0.5, enable_gqa=True)

    ref = sdpa().view(batch_size, heads, dim)
    rel = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert rel < TOL, rel
    times = {version: _ms(lambda: backend.forward(q, k, v, layer, batch)), "sdpa_dense": _ms(sdpa)}
    _report(f"{version} decode B={batch_size} L={seq_len} H={heads}/{kv} D={dim} bf16 page={page}", times)


@pytest.mark.parametrize("batch_size,prefix,new", [(1, 0, 8192), (4, 0, 2048), (4, 4096, 512), (16, 0, 512)])
def test_extend_timing_vs_sdpa(version, batch_size, prefix, new):
    heads, kv, dim = 32, 8, 128
    page = 256 if version == "fa2" else 16
    total = prefix + new
    ctx, batch, layer, _, _, _ = _decode_step(page, heads, kv, dim, [total] * batch_size)
    # the same pool as an extend of `new` tokens over `prefix` cached ones
    batch.mode = ForwardMode.EXTEND
    batch.prefix_lens_cpu, batch.extend_lens_cpu = [prefix] * batch_size, [new] * batch_size
    cols = torch.arange(prefix, total, device="cuda")
    batch.out_cache_loc = batch.req_to_token[batch.req_pool_indices][:, cols].reshape(-1)
    batch.positions = cols.repeat(batch_size)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch_size * new, heads, dim, generator=gen).to("cuda", BF16)
    k = batch.kv_pool.k_buffers[0][batch.out_cache_loc].clone()
    v = batch.kv_pool.v_buffers[0][batch.out_cache_loc].clone()
    backend = FACTORIES[version](ctx)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, layer, batch)
    slots = batch.req_to_token[batch.req_pool_indices, :total]
    keys = batch.kv_pool.k_buffers[0][slots].transpose(1, 2).contiguous()
    values = batch.kv_pool.v_buffers[0][slots].transpose(1, 2).contiguous()
    qd = q.view(batch_size, new, heads, dim).transpose(1, 2)
    mask = None
    if prefix:  # bottom-right aligned causal mask
        pos = torch.arange(total, device="cuda")
        mask = pos[None, :] <= pos[prefix:, None]

    def sdpa():
        return F.scaled_dot_product_attention(qd, keys, values, attn_mask=mask, is_causal=mask is None,
                                              scale=dim ** -0.5, enable_gqa=True)

    ref = sdpa().transpose(1, 2).reshape(-1, heads, dim)
    rel = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert rel < TOL, rel
    times = {version: _ms(lambda: backend.forward(q, k, v, layer, batch)), "sdpa_dense": _ms(sdpa)}
    _report(f"{version} extend B={batch_size} prefix={prefix} new={new} H={heads}/{kv} D={dim} bf16 "
            f"page={page}", times)

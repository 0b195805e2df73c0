"""The flashinfer backend on a GPU with FlashInfer installed (skipped elsewhere, with the
probe's reason): the shared conformance suite at real sizes, a CUDA-graph capture and
replay of decode against eager, timings against torch SDPA, and the engine's greedy tokens
against torch_native.

FlashInfer compiles each kernel family with nvcc on first use (minutes in all, cached in
~/.cache/flashinfer). The cases are chosen to need few families; what this file compiles,
by (query dtype, KV dtype, head dim, sliding window):

* batch prefill, fa2: bf16/bf16 d128, bf16/bf16 d128 windowed, bf16/bf16 d256,
  bf16/fp8_e4m3 d128, fp16/fp16 d64 (the head-dim-64 cases and the engine test, in
  float16); tensor-core decode (a KV head serving 4+ query heads) runs on these too;
* batch decode on CUDA cores (query groups under 4): fp16/fp16 d64;
* segment_packbits (the custom mask of target verify);
* MLA: the batch MLA kernels at 512 + 64 (bf16), and the ragged prefill at 192 / 128.

Bounds, 16-bit queries and K/V: |out - ref| <= 3e-2 + 3e-2 |ref| elementwise against the
float32 reference (the softmax weights round to 16 bits before P @ V, as in any flash kernel).

Run with ``-s`` to see the timings (scripts/gpu_check.sh does).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from flashinfer_batches import decode_step, paged_step
from radixserve.layers.attention import ForwardMode
from radixserve.testing.attention_conformance import Case, run_case
from radixserve_attention_flashinfer import make_backend, unavailable_reason

REASON = unavailable_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(REASON is not None, reason=f"the flashinfer backend cannot run here: {REASON}"),
]

BF16, TOL = torch.bfloat16, 3e-2
CHAIN, TREE = (-1, 0, 1, 2, 3, 4, 5), (-1, 0, 0, 1, 1, 2, 4, 6, 6, 3, 0, 10)


def _cases() -> list[Case]:
    def c(mode, page, heads, kv, dim, pre, ext, dtype=BF16, **kw):
        return Case(mode, page, heads, kv, dim, tuple(pre), tuple(ext), dtype=dtype, **kw)

    out = []
    for page in (1, 16, 64):  # d128, GQA 32/8: empty, mid-page and long prefixes
        out.append(c("extend", page, 32, 8, 128, (0, 1000, 517, 2047), (512, 37, 1, 300)))
        out.append(c("decode", page, 32, 8, 128, (0, 16, 255, 4095, 63, 1500), (1,) * 6))
    out.append(c("decode", 16, 32, 8, 128, (512, 700, 600, 3), (1,) * 4, shared_prefix=512))
    out.append(c("verify", 16, 32, 8, 128, (1000, 0, 300), (12, 7, 1), trees=(TREE, CHAIN, (-1,))))
    out.append(c("verify", 1, 32, 8, 128, (64, 33), (7, 12), trees=(CHAIN, TREE)))
    out.append(c("mixed", 16, 32, 8, 128, (0, 700, 33, 900), (300, 1, 1, 1)))
    # sliding window (d128): extend and decode through the windowed kernels, verify by mask
    out.append(c("extend", 16, 32, 8, 128, (0, 3000, 77), (2000, 500, 1), sliding_window=1024))
    out.append(c("decode", 16, 32, 8, 128, (4000, 1023, 1024, 5), (1,) * 4, sliding_window=1024))
    out.append(c("verify", 16, 32, 8, 128, (300, 20), (12, 7), sliding_window=4, trees=(TREE, CHAIN)))
    # head dims 64 (float16, group 3 as the default model: CUDA-core decode) and 256 (group 4)
    out.append(c("extend", 16, 9, 3, 64, (0, 900, 31), (400, 64, 1), dtype=torch.float16))
    out.append(c("decode", 16, 9, 3, 64, (0, 17, 2000, 300), (1,) * 4, dtype=torch.float16))
    out.append(c("extend", 16, 16, 4, 256, (0, 700, 33), (300, 64, 200)))
    out.append(c("decode", 16, 16, 4, 256, (5, 3000, 64), (1,) * 3))
    # KV stored as fp8 (e4m3), read with bf16 queries
    fp8 = torch.float8_e4m3fn
    out.append(c("extend", 16, 32, 8, 128, (0, 1000, 33), (300, 64, 1), kv_dtype=fp8))
    out.append(c("decode", 16, 32, 8, 128, (0, 100, 2000), (1,) * 3, kv_dtype=fp8))
    # MLA at DeepSeek-V3's latent shape (kv_lora_rank 512 + rope 64; 16 query heads): the MLA
    # wrapper for decode, extend over a prefix and mixed steps, the ragged wrapper for the
    # expanded prefill (192 / 128 per head)
    for page in (1, 16):
        out.append(c("decode", page, 16, 1, 576, (0, 40, 2000), (1,) * 3, v_head_dim=512))
        out.append(c("extend", page, 16, 1, 576, (700, 0, 31), (64, 300, 1), v_head_dim=512))
    out.append(c("mixed", 16, 16, 1, 576, (0, 700, 33), (300, 1, 1), v_head_dim=512))
    out.append(c("mla_prefill", 16, 16, 16, 192, (0, 0, 0), (300, 17, 1), v_head_dim=128))
    return out


@pytest.mark.parametrize("case", _cases(), ids=str)
def test_conforms_on_gpu(case):
    run_case(make_backend, case, device="cuda", atol=TOL, rtol=TOL)


def test_decode_in_a_cuda_graph_matches_eager():
    """Captured as the engine captures (every row one token long, the last rows padding),
    then replayed at other lengths: the re-plan rewrites the captured buffers in place."""
    step = decode_step([1] * 6, bucket=8, page=16, heads=32, kv_heads=8, dim=128, max_context_len=8192,
                       dtype=BF16, device="cuda")
    backend = make_backend(step.ctx)
    backend.init_cuda_graph_state(8)
    batch = step.batch
    backend.init_forward_metadata_capture_cuda_graph(batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            backend.forward(step.q, step.k, step.v, step.layer, batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(step.q, step.k, step.v, step.layer, batch)
    for lens in ([300, 4000, 17, 1000, 8000, 64], [8192, 1, 2, 4097, 16, 33]):
        step.set_lengths(lens)
        backend.init_forward_metadata_replay_cuda_graph(batch)
        graph.replay()
        torch.cuda.synchronize()
        replayed = out[:6].clone()
        eager_batch = dataclasses.replace(batch, attn_metadata=None)  # the same tensors, eager plan
        backend.init_forward_metadata(eager_batch)
        eager = backend.forward(step.q, step.k, step.v, step.layer, eager_batch)[:6]
        torch.testing.assert_close(replayed, eager, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(replayed, step.eager(), rtol=TOL, atol=TOL)


# ------------------------------------------------------------------ timings
def _ms(fn, warmup: int = 10, rep: int = 50) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rep):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / rep


def _report(name: str, times: dict[str, float]) -> None:
    parts = "  ".join(f"{k} {v:.3f} ms" for k, v in times.items())
    print(f"\nTIMING {name}: {parts}")


def _dense_kv(batch, length: int):
    """Each request's first ``length`` K/V rows, dense: ``[B, Hkv, L, D]`` each (SDPA's input)."""
    slots = batch.req_to_token[batch.req_pool_indices, :length]  # [B, L]
    keys = batch.kv_pool.k_buffers[0][slots].transpose(1, 2).contiguous()
    values = batch.kv_pool.v_buffers[0][slots].transpose(1, 2).contiguous()
    return keys, values


def _check_and_time(step, out, ref, sdpa) -> dict[str, float]:
    from radixserve_attention_torch import TorchNativeAttention

    rel = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert rel < 2e-2, rel
    backend = make_backend(step.ctx)
    backend.init_forward_metadata(step.batch)
    times = {
        "flashinfer": _ms(lambda: backend.forward(step.q, step.k, step.v, step.layer, step.batch)),
        "sdpa_dense": _ms(sdpa),
    }
    native = TorchNativeAttention(step.ctx)
    native.init_forward_metadata(step.batch)
    times["torch_native"] = _ms(lambda: native.forward(step.q, step.k, step.v, step.layer, step.batch))
    return times


def _run(step):
    backend = make_backend(step.ctx)
    backend.init_forward_metadata(step.batch)
    return backend.forward(step.q, step.k, step.v, step.layer, step.batch)


@pytest.mark.parametrize("batch_size,seq_len", [(8, 8192), (64, 2048)])
def test_decode_timing_vs_sdpa(batch_size, seq_len):
    heads, kv, dim = 32, 8, 128
    step = paged_step(ForwardMode.DECODE, (seq_len - 1,) * batch_size, (1,) * batch_size)
    out = _run(step)
    keys, values = _dense_kv(step.batch, seq_len)
    q = step.q.view(batch_size, heads, 1, dim)

    def sdpa():
        return F.scaled_dot_product_attention(q, keys, values, scale=dim**-0.5, enable_gqa=True)

    times = _check_and_time(step, out, sdpa().view(batch_size, heads, dim), sdpa)
    _report(f"decode B={batch_size} L={seq_len} H={heads}/{kv} D={dim} bf16", times)


@pytest.mark.parametrize("batch_size,prefix,new", [(4, 0, 2048), (4, 4096, 512)])
def test_extend_timing_vs_sdpa(batch_size, prefix, new):
    heads, kv, dim = 32, 8, 128
    step = paged_step(ForwardMode.EXTEND, (prefix,) * batch_size, (new,) * batch_size)
    out = _run(step)
    total = prefix + new
    keys, values = _dense_kv(step.batch, total)
    q = step.q.view(batch_size, new, heads, dim).transpose(1, 2)  # [B, H, new, D]
    mask = None
    if prefix:  # bottom-right aligned causal mask
        pos = torch.arange(total, device="cuda")
        mask = pos[None, :] <= pos[prefix:, None]

    def sdpa():
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                              scale=dim**-0.5, enable_gqa=True)

    ref = sdpa().transpose(1, 2).reshape(-1, heads, dim)
    times = _check_and_time(step, out, ref, sdpa)
    _report(f"extend B={batch_size} prefix={prefix} new={new} H={heads}/{kv} D={dim} bf16", times)


# ------------------------------------------------------------------ the engine
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
PROMPTS = [STORY, "def fibonacci(n):"]
FOLLOW_UP = STORY + " every morning"


def _greedy_tokens(backend_name: str) -> list[list[int]]:
    """A batched prefill and decode steps, then a prefill over a cached prefix (page 16)."""
    import radixserve

    with radixserve.Engine(attention_backend=backend_name, device="cuda", dtype="float16", page_size=16,
                           max_total_tokens=4096, context_length=512, max_running_requests=4) as engine:
        outs = engine.generate(PROMPTS, [{"temperature": 0.0, "max_new_tokens": 4}] * len(PROMPTS))
        follow = engine.generate(FOLLOW_UP, {"temperature": 0.0, "max_new_tokens": 2})
        assert follow["meta_info"]["cached_tokens"] >= 16, "the follow-up prompt did not reuse the cache"
        engine.check_idle_invariant()
        return [o["output_ids"] for o in outs] + [follow["output_ids"]]


@pytest.mark.slow
def test_engine_greedy_tokens_match_torch_native(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_PLUGINS", "radixserve-attention-torch,radixserve-attention-flashinfer")
    got = _greedy_tokens("flashinfer")
    expected = _greedy_tokens("torch_native")
    assert got == expected
    assert [len(ids) for ids in got] == [4, 4, 2]

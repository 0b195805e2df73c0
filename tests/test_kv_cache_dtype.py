"""``--kv-cache-dtype``: the KV pool stores K/V narrower than the activations.

Unit tests check the storage cast (saturating for fp8 and float16) and that the pool's bytes
per token halve (bfloat16, float16) or quarter (fp8) against float32, so one memory budget
holds 2x / 4x the tokens. Tiny-engine tests check that the prefix cache and chunked prefill
stay token-identical between runs with the same narrow pool, that the HiCache host tier
carries narrow pages, and that an attention backend that does not list the dtype is refused
at start-up. The default model's greedy tokens with bfloat16 and fp8_e4m3 pools are compared
with the float32 pool's on the 20 transformers-equality prompts of test_default_model.py.
(Each backend's attention over a narrow pool is checked by the conformance suite's
KV_DTYPE_CASES, in the backends' own tests.)
"""

from __future__ import annotations

import contextlib

import pytest
import radixserve
import torch
from engine_checks import wait_until_idle
from radixserve.config import ServerArgs
from radixserve.hookspecs import hookimpl
from radixserve.layers.attention import AttentionBackend
from radixserve.mem.kv_pool import KVPool, to_storage
from radixserve.registry import Registry
from tiny_models import VOCAB, build_checkpoint

NARROW = {"bfloat16": (torch.bfloat16, 2), "float16": (torch.float16, 2),
          "fp8_e4m3": (torch.float8_e4m3fn, 4), "fp8_e5m2": (torch.float8_e5m2, 4)}
PARAMS = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


# ------------------------------------------------------------------ unit
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16])
def test_storage_cast_saturates_instead_of_overflowing(dtype):
    big = torch.tensor([1e6, -1e6, 3.0e38, 1.0, -0.5])
    stored = to_storage(big, dtype)
    assert stored.dtype == dtype
    back = stored.float()
    assert torch.isfinite(back).all()
    limit = torch.finfo(dtype).max
    assert back[:3].tolist() == [limit, -limit, limit]
    assert back[3:].tolist() == [1.0, -0.5]


def test_set_kv_rounds_to_the_pool_dtype():
    pool = KVPool(num_layers=1, num_pages=3, page_size=2, num_kv_heads=2, head_dim=4,
                  dtype=torch.float8_e4m3fn, device="cpu")
    k = torch.randn(2, 2, 4) * 1000  # beyond e4m3's 448 for most entries
    v = torch.randn(2, 2, 4)
    loc = torch.tensor([2, 5])
    pool.set_kv(0, loc, k, v)
    got_k, got_v = pool.get_kv(0, loc)
    assert got_k.dtype == torch.float8_e4m3fn
    assert torch.equal(got_k.float(), k.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert torch.equal(got_v.float(), v.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("name", NARROW)
def test_pool_bytes_halve_or_quarter(name):
    dtype, ratio = NARROW[name]
    wide = KVPool.bytes_per_token_for(30, 3, 64, torch.float32)
    assert KVPool.bytes_per_token_for(30, 3, 64, dtype) * ratio == wide
    pool = KVPool(num_layers=2, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8, dtype=dtype, device="cpu")
    ref = KVPool(num_layers=2, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                 device="cpu")
    assert pool.bytes_per_token * ratio == ref.bytes_per_token
    assert pool.buffer.nbytes * ratio == ref.buffer.nbytes


def test_flag_refuses_unknown_dtypes():
    with pytest.raises(Exception, match="--kv-cache-dtype"):
        ServerArgs.from_kwargs(kv_cache_dtype="int8")


# ------------------------------------------------------------------ tiny engines
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kv_dtype_llama"))
    build_checkpoint(path, "llama", seed=3, max_position_embeddings=512)
    return path


@contextlib.contextmanager
def engine_for(path, **kw):
    kw.setdefault("max_total_tokens", 2048)
    engine = radixserve.Engine(path, dtype="float32", page_size=4, enable_leak_check=True, **kw)
    try:
        yield engine
        wait_until_idle(engine)
    finally:
        engine.shutdown()


def prompts(num=4, length=40, seed=0):
    """``num`` prompts sharing a 24-token prefix (radix cache hits on a second pass)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (24,), generator=g).tolist()
    return [shared + torch.randint(3, VOCAB, (length - 24,), generator=g).tolist() for _ in range(num)]


def outputs(engine, ids):
    return [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=PARAMS)]


def test_same_memory_budget_holds_more_tokens(tiny_path, monkeypatch):
    from radixserve.engine import memory

    monkeypatch.setattr(memory, "available_memory", lambda device: 16 << 20)  # 16 MiB: 8 MiB budget at 0.5
    tokens = {}
    for name in ("auto", "bfloat16", "fp8_e4m3"):
        with engine_for(tiny_path, max_total_tokens=None, mem_fraction_static=0.5, kv_cache_dtype=name) as e:
            tokens[name] = e.runner.max_total_tokens
            assert e.runner.kv_pool.buffer.nbytes <= 8 << 20
    assert tokens["bfloat16"] == pytest.approx(2 * tokens["auto"], rel=0.01)
    assert tokens["fp8_e4m3"] == pytest.approx(4 * tokens["auto"], rel=0.01)


@pytest.mark.parametrize("name", ["bfloat16", "fp8_e4m3"])
def test_radix_cache_and_chunked_prefill_are_token_identical(tiny_path, name):
    ids = prompts()
    with engine_for(tiny_path, kv_cache_dtype=name) as engine:
        assert engine.runner.kv_pool.dtype == NARROW[name][0]
        first = outputs(engine, ids)
        again = outputs(engine, ids)  # served from the radix cache: the stored (narrow) pages
        assert engine.get_stats()["num_cached_prompt_tokens"] > 0
    assert again == first
    with engine_for(tiny_path, kv_cache_dtype=name, chunked_prefill_size=8, disable_radix_cache=True) as chunked:
        assert outputs(chunked, ids) == first


@pytest.mark.parametrize("name,io", [("fp8_e4m3", "kernel"), ("fp8_e5m2", "direct"), ("bfloat16", "kernel")])
def test_hicache_host_tier_with_a_narrow_pool(tiny_path, name, io):
    from test_hicache import conversations, run_rounds

    rounds = conversations(turns=2)
    with engine_for(tiny_path, kv_cache_dtype=name) as big:
        reference = run_rounds(big, rounds)
    with engine_for(tiny_path, kv_cache_dtype=name, max_total_tokens=160, enable_hierarchical_cache=True,
                    hicache_ratio=8, hicache_io_backend=io) as hi:
        assert run_rounds(hi, rounds) == reference
        host = hi.scheduler.cache.host
        assert host.buffer.dtype == NARROW[name][0]
        assert hi.get_stats()["hicache_host_hit_tokens"] > 0


class _WideOnly(AttentionBackend):
    """A backend written without --kv-cache-dtype in mind (declares no narrow dtypes)."""

    def __init__(self, ctx):
        from radixserve_attention_torch import TorchNativeAttention

        self.inner = TorchNativeAttention(ctx)

    def init_forward_metadata(self, batch):
        self.inner.init_forward_metadata(batch)

    def forward_extend(self, q, k, v, layer, batch):
        return self.inner.forward_extend(q, k, v, layer, batch)

    def forward_decode(self, q, k, v, layer, batch):
        return self.inner.forward_decode(q, k, v, layer, batch)


class _WideOnlyPlugin:
    @staticmethod
    @hookimpl
    def register_attention_backends(register):
        register("wide_only", _WideOnly, description="test backend without narrow KV pools")


@pytest.fixture(scope="module")
def registry():
    reg = Registry()
    reg.load_entry_points()
    reg.add_plugin(_WideOnlyPlugin, name="wide-only", distribution="tests")
    return reg


def test_a_backend_without_the_dtype_is_refused_at_start_up(tiny_path, registry):
    with pytest.raises(ValueError) as err:
        radixserve.Engine(tiny_path, registry=registry, attention_backend="wide_only", kv_cache_dtype="fp8_e4m3",
                          max_total_tokens=256)
    msg = str(err.value)
    assert "--attention-backend wide_only" in msg and "--kv-cache-dtype fp8_e4m3" in msg
    assert "supports --kv-cache-dtype auto" in msg
    # the decode half of a hybrid is checked too
    with pytest.raises(ValueError, match="--decode-attention-backend wide_only"):
        radixserve.Engine(tiny_path, registry=registry, decode_attention_backend="wide_only",
                          kv_cache_dtype="bfloat16", max_total_tokens=256)
    # auto (the activation dtype) is always fine
    with engine_for(tiny_path, registry=registry, attention_backend="wide_only") as engine:
        assert outputs(engine, prompts(num=1))[0]


# ------------------------------------------------------------------ the default model
@pytest.fixture(scope="module")
def float32_pool_tokens(default_engine, default_prompts, default_greedy_outputs):
    """(prompt ids, greedy output ids) per prompt from the float32 pool (the default engine;
    ``default_prompts`` and its outputs from conftest.py)."""
    outs = default_greedy_outputs
    return [(default_engine.tokenizer.encode(p), o["output_ids"]) for p, o in zip(default_prompts, outs, strict=True)]


@torch.inference_mode()
def teacher_forced_argmax(engine, seqs) -> list[list[int]]:
    """For each (prompt, continuation): the engine's greedy choice at every position of the
    continuation given the true tokens before it, all in one extend batch (no compounding
    of an early divergence). Borrows pages and request slots while the engine is idle."""
    from radixserve.engine.request import Req
    from radixserve.layers.attention import ForwardMode
    from radixserve.sampling import SamplingParams

    runner = engine.runner
    page = runner.kv_pool.page_size
    reqs, rows, offset = [], [], 0
    try:
        for i, (prompt, out) in enumerate(seqs):
            ids = prompt + out
            req = Req(f"tf{i}", ids, SamplingParams(max_new_tokens=0), 0)
            req.req_pool_idx = runner.req_to_token_pool.alloc()
            reqs.append(req)
            req.pages = runner.kv_pool.allocator.allocate(-(-len(ids) // page))
            rows.extend(range(offset + len(prompt) - 1, offset + len(ids) - 1))
            offset += len(ids)
        batch = runner.build_batch(reqs, ForwardMode.EXTEND, [len(r.input_ids) for r in reqs])
        batch.logits_indices = torch.tensor(rows, device=runner.device)
        pred = runner.forward(batch).argmax(-1).tolist()
    finally:
        for req in reqs:
            runner.kv_pool.allocator.free(getattr(req, "pages", None) or [])
            runner.req_to_token_pool.free(req.req_pool_idx)
    out, at = [], 0
    for _, cont in seqs:
        out.append(pred[at:at + len(cont)])
        at += len(cont)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bfloat16", "fp8_e4m3"])
def test_default_model_agrees_with_the_float32_pool(name, default_prompts, float32_pool_tokens):
    """bfloat16: at least 16 of the 20 prompts give exactly the float32 pool's 64 greedy
    tokens (measured: 20 of 20). fp8_e4m3 (3 mantissa bits, scale 1.0) rounds K/V coarsely
    enough that a 64-token greedy run of this 135M model drifts on most prompts (measured:
    3 of 20 identical to the end), so it is held to per-step agreement instead: given the
    float32 pool's tokens so far, its greedy choice is the same at >= 95% of the 20 x 64
    positions (measured 97%) and >= 85% on every prompt (measured min 91%).

    k_scale/v_scale (stored = fp8(x / scale), read = fp8 * scale) would not lift fp8 to the
    16 of 20: this model's K/V (|K| <= 22, |V| <= 17) already sit in e4m3's normal range at
    scale 1.0, where the rounding error is the mantissa's (~2.6%) whatever the scale; amax
    scales per layer or per KV head land within the 96-98% per-step spread of arbitrary scale
    choices, and 16 of 20 identical 64-token runs would need ~99.6% per step
    (benchmarks/bench_kv_fp8_scales.py, BENCHMARKS.md)."""
    from test_default_model import GREEDY

    engine = radixserve.Engine(max_total_tokens=16384, kv_cache_dtype=name)  # as the default_engine fixture
    try:
        cfg = engine.model_config
        assert engine.runner.kv_pool.bytes_per_token * NARROW[name][1] == KVPool.bytes_per_token_for(
            cfg.num_hidden_layers, engine.runner.heads.num_kv_heads, cfg.head_dim, torch.float32)
        assert len(default_prompts) == 20
        if name == "bfloat16":
            outs = [o["output_ids"] for o in engine.generate(default_prompts, GREEDY)]
            same = sum(a == b for a, (_, b) in zip(outs, float32_pool_tokens, strict=True))
            assert same >= 16, f"{name}: {same} of 20 prompts give the float32 pool's greedy tokens"
        else:
            preds = teacher_forced_argmax(engine, float32_pool_tokens)
            rates = [sum(a == b for a, b in zip(p, out)) / len(out) for p, (_, out) in zip(preds, float32_pool_tokens)]
            total = sum(r * len(out) for r, (_, out) in zip(rates, float32_pool_tokens)) / sum(
                len(out) for _, out in float32_pool_tokens)
            assert total >= 0.95 and min(rates) >= 0.85, f"{name}: agreement {total:.3f}, per prompt {rates}"
        wait_until_idle(engine)
    finally:
        engine.shutdown()

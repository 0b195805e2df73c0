"""radixserve's compiled CPU kernels against the PyTorch code they replace, and the fallback.

Where a C compiler exists the kernels must build (a silent fallback would hide a broken
fast path); every kernel must agree with its PyTorch reference; a failed build or
``RADIXSERVE_CPU_KERNELS=0`` must leave a working PyTorch path that gives the same tokens.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn.functional as F
from radixserve.kernels import cpu as cpu_kernels
from radixserve.layers.linear import Linear
from radixserve.layers.rotary import RotaryEmbedding, apply_rotary


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels.load()
    if k is None:
        pytest.skip(f"radixserve CPU kernels unavailable: {cpu_kernels.status()}")
    return k


def test_kernels_build_where_a_compiler_exists():
    if os.environ.get("RADIXSERVE_CPU_KERNELS", "1") == "0" or cpu_kernels._compiler() is None:
        pytest.skip("no C compiler, or kernels disabled")
    assert cpu_kernels.load() is not None, cpu_kernels.status()


@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 33, 70])
@pytest.mark.parametrize("n,k", [(960, 576), (50, 17), (33, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(kernels, m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(m, k, generator=g)
    got = kernels.linear(x, kernels.pack(w), b, n)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_layer_paths_agree(kernels):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    x = torch.randn(5, 40, generator=g)
    ref = F.linear(x, w, b)
    for use_kernels, path in [(True, "radixserve"), (False, "onednn")]:
        layer = Linear(40, 96, bias=True)
        layer.load("weight", w)
        layer.load("bias", b)
        assert layer.pack(use_kernels=use_kernels)
        assert layer.path == path
        torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x.t().contiguous().t()), ref, rtol=1e-5, atol=1e-5)  # strided input


def _rmsnorm_ref(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("m", [1, 16])
def test_rmsnorm_and_fused_residual(kernels, m):
    g = torch.Generator().manual_seed(m)
    x, res, w = torch.randn(m, 576, generator=g), torch.randn(m, 576, generator=g), torch.randn(576, generator=g)
    torch.testing.assert_close(kernels.rmsnorm(x, w, 1e-5), _rmsnorm_ref(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    total = x + res
    out = kernels.rmsnorm(x, w, 1e-5, residual=res)
    torch.testing.assert_close(res, total, rtol=0, atol=0)  # residual += x in place, exactly
    torch.testing.assert_close(out, _rmsnorm_ref(total, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_silu_mul(kernels):
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(9, 2 * 1536, generator=g) * 6
    gate_up[0, :1536] = torch.linspace(-100, 100, 1536)  # saturated tails of exp
    ref = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    torch.testing.assert_close(kernels.silu_mul(gate_up), ref, rtol=1e-5, atol=1e-6)
    odd = torch.randn(3, 2 * 37, generator=g) * 6  # a width past the last whole vector
    torch.testing.assert_close(kernels.silu_mul(odd), F.silu(odd[:, :37]) * odd[:, 37:], rtol=1e-5, atol=1e-6)


def test_argmax_rows_matches_torch(kernels):
    """Same indices as torch.argmax: first maximum on ties, first NaN, all -inf, strided rows."""
    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        m, n = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 700, (1,), generator=g))
        x = torch.randn(m, n, generator=g)
        if trial % 2:
            x = x.round()  # many ties
        if trial % 5 == 0:
            x[torch.rand(m, n, generator=g) < 0.02] = float("nan")
        if trial % 7 == 0:
            x[0] = float("-inf")
        if trial % 3 == 0:
            x[torch.rand(m, n, generator=g) < 0.05] = float("inf")
        assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1)), trial
    wide = torch.randn(4, 49200, generator=g)[:, :49152]  # rows of a wider tensor
    assert torch.equal(kernels.argmax_rows(wide), wide.argmax(dim=-1))


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_in_place_matches_apply_rotary(kernels, scaling):
    t, h, hkv, d = 11, 9, 3, 64
    rot = RotaryEmbedding(d, 512, 10000.0, scaling, torch.float32)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g)
    pos = torch.randint(0, 512, (t,), generator=g)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    ref_q, ref_k = apply_rotary(q.reshape(t, h, d), k.reshape(t, hkv, d), rot(pos))
    ref_v = v.clone()
    kernels.rope_(qkv, h + hkv, d, rot.cos, rot.sin, pos)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    torch.testing.assert_close(q.reshape(t, h, d), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.reshape(t, hkv, d), ref_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v, ref_v, rtol=0, atol=0)


def _clear_kernel_caches() -> None:
    from radixserve_attention_torch import kernel as decode_kernel
    from radixserve_moe_torch import kernel as grouped_kernel

    for load in (cpu_kernels.load, decode_kernel.load, grouped_kernel.load):
        load.cache_clear()


def test_failed_build_falls_back(monkeypatch, tmp_path):
    """A compiler that fails leaves load() returning None with the reason, and the layers
    keep working on the oneDNN/PyTorch path."""
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exists, always fails
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
        assert cpu_kernels.status().startswith("build failed")
        layer = Linear(16, 8)
        w = torch.randn(8, 16)
        layer.load("weight", w)
        layer.pack()
        assert layer.path != "radixserve"
        x = torch.randn(3, 16)
        torch.testing.assert_close(layer(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
        monkeypatch.setenv("RADIXSERVE_CPU_KERNELS", "0")
        cpu_kernels.load.cache_clear()
        assert cpu_kernels.load() is None and cpu_kernels.status().startswith("disabled")
    finally:
        cpu_kernels.load.cache_clear()


@pytest.mark.parametrize("variant", ["llama", "qwen3"])  # qwen3: q/k norms, RoPE in PyTorch
def test_engine_same_tokens_with_and_without_kernels(kernels, tmp_path, monkeypatch, variant):
    """The whole model and the torch_native decode on the kernel path and on the PyTorch
    path give the same greedy tokens and nearly the same logits."""
    import radixserve
    from tiny_models import build_checkpoint

    path = str(tmp_path / variant)
    build_checkpoint(path, variant)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 40)), [3]]
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    results = []
    for enabled in ("1", "0"):
        monkeypatch.setenv("RADIXSERVE_CPU_KERNELS", enabled)
        _clear_kernel_caches()
        try:
            engine = radixserve.Engine(path, dtype="float32", max_total_tokens=1024)
            try:
                paths = {m.path for m in engine.runner.model.modules() if isinstance(m, Linear)}
                assert (paths == {"radixserve"}) == (enabled == "1"), paths
                # the attention plugin's own kernel follows the same switch
                assert (engine.runner.attn_backend.kernels is not None) == (enabled == "1")
                outs = engine.generate(input_ids=prompts, sampling_params=params)
                logits = engine.runner.prompt_logits(prompts[1])
                results.append(([o["output_ids"] for o in outs], logits))
            finally:
                engine.shutdown()
        finally:
            _clear_kernel_caches()
    (tokens_fast, logits_fast), (tokens_ref, logits_ref) = results
    assert tokens_fast == tokens_ref
    torch.testing.assert_close(logits_fast, logits_ref, rtol=1e-4, atol=1e-4)


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts OS threads through /proc (Linux only)")
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs two torch threads for an OpenMP worker to exist")
def test_release_thread_pool_frees_this_threads_openmp_workers(kernels):
    """A thread that opened parallel regions owns OpenMP workers; release_thread_pool gives them
    back (one OS thread fewer per worker), and the thread's next parallel op makes them again
    with the same results. Run in a fresh thread so the test's own pool is not involved."""
    x = torch.randn(512, 512)
    counts, results = [], []

    def work():
        torch.set_num_threads(2)
        results.append(x @ x)  # a parallel region: this thread's pool gets its worker
        counts.append(_os_threads())
        counts.append(cpu_kernels.release_thread_pool())
        counts.append(_os_threads())
        results.append(x @ x)  # the pool comes back
        counts.append(_os_threads())
        cpu_kernels.release_thread_pool()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    with_pool, released, without_pool, again = counts
    assert released is True
    assert without_pool == with_pool - 1
    assert again == with_pool
    assert torch.equal(results[0], results[1])


def test_engine_gives_back_the_building_and_inline_threads_workers(monkeypatch, tmp_path):
    """The thread that built an engine, and one that ran generate inline, keep no OpenMP
    workers afterwards (a background scheduler thread would otherwise share two CPUs with their
    idle workers and pay a wake-up per parallel region)."""
    from radixserve import Engine
    from radixserve.engine import engine as engine_mod
    from tiny_models import build_checkpoint

    calls = []
    monkeypatch.setattr(engine_mod.cpu_kernels, "release_thread_pool",
                        lambda: calls.append(threading.get_ident()) or True)
    build_checkpoint(str(tmp_path))
    eng = Engine(model=str(tmp_path))
    try:
        assert calls == [threading.get_ident()]  # at the end of the constructor
        eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert calls == [threading.get_ident()] * 2  # after the inline generate
    finally:
        eng.shutdown()

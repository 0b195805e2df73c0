"""The triton backend's kernels through Triton's interpreter (CPU), against torch_native.

Bounded relative error, max |triton - torch_native| / max |torch_native|: 1e-5 in float32
and 2e-2 in bfloat16 (``REL_ERROR_BOUND`` in triton_paged_batch.py). Sizes stay small: the
interpreter runs every program of the grid in Python.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import radixserve_attention_triton
import torch
from radixserve.testing.attention_conformance import CASES, KV_DTYPE_CASES, MLA_CASES, run_case
from radixserve_attention_triton import make_backend
from triton_paged_batch import (
    Spec,
    build,
    compare,
    decode,
    extend,
    random_tree,
    run,
    verify,
)

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests; the GPU runs test_triton_gpu.py"
)

GQA = ((4, 4), (6, 2), (8, 1))  # ratios 1, 3, 8


def small_splits(ctx):
    """Split decode KV every 16 tokens into at most 4 splits, so short test sequences
    use several splits, unevenly."""
    return make_backend(ctx, max_kv_splits=4, min_split_tokens=16)


def _grid() -> list[Spec]:
    out = []
    for page in (1, 16):
        for heads, kv in GQA:
            for dim in (64, 128):
                # empty prefix, mid-page prefixes (7, 33), a page-aligned one (16), mixed lengths
                out.append(extend(page, heads, kv, dim, (0, 7, 16, 33), (13, 1, 20, 5)))
                # 1..4 splits of 16 per request; 70 tokens: 4 splits of 18
                out.append(decode(page, heads, kv, dim, (1, 9, 16, 47, 70)))
    return out


@pytest.mark.parametrize("spec", _grid(), ids=str)
def test_matches_torch_native(spec):
    compare(small_splits, spec)


@pytest.mark.parametrize(
    "spec",
    [
        extend(16, 4, 2, 96, (0, 21), (9, 30)),  # 96 pads to 128
        decode(16, 4, 2, 96, (5, 40)),
        extend(16, 4, 1, 256, (0, 21), (9, 30)),
        decode(16, 4, 1, 256, (5, 40)),
        extend(1, 6, 2, 64, (0, 3), (70, 40)),  # causal across several query and key blocks
        extend(16, 6, 2, 64, (0, 20, 45), (40, 9, 3), sliding_window=8),
        extend(1, 4, 4, 64, (31,), (3,), sliding_window=1),
        extend(16, 6, 2, 64, (10,), (50,), sliding_window=64),  # window longer than the sequence
        decode(16, 6, 2, 64, (3, 40, 70), sliding_window=8),
        decode(1, 8, 1, 128, (2, 70), sliding_window=33),
        decode(16, 20, 1, 64, (5, 40)),  # 20 query heads per KV head: two head blocks of 16
        extend(16, 20, 1, 64, (5, 40), (7, 3)),
        extend(16, 6, 2, 64, (0, 7, 16), (13, 1, 20), dtype=torch.bfloat16),
        decode(16, 6, 2, 128, (9, 47, 70), dtype=torch.bfloat16),
    ],
    ids=str,
)
def test_head_dims_windows_and_dtypes(spec):
    compare(small_splits, spec)


@pytest.mark.parametrize(
    "spec", [extend(16, 6, 2, 64, (0, 7), (5, 12)), decode(16, 6, 2, 64, (9, 33))], ids=str
)
def test_strided_qkv_views(spec):
    """q, k, v as views into one fused projection output (row stride > H * D)."""
    compare(small_splits, spec, strided_qkv=True)


def test_empty_splits_and_one_token_splits():
    """min_split_tokens=1: a 5-token request gets 4 splits of 2, the last one empty."""
    for spec in (decode(1, 4, 2, 64, (1, 2, 5, 7)), decode(16, 4, 2, 64, (5, 3), sliding_window=2)):
        compare(lambda ctx: make_backend(ctx, max_kv_splits=4, min_split_tokens=1), spec)


def test_default_split_settings():
    compare(make_backend, decode(16, 6, 2, 64, (1, 31, 33, 200)))


CHAIN70 = tuple(range(-1, 69))  # a chain: target verify reduces to a causal extend


@pytest.mark.parametrize(
    "spec",
    [
        # trees across several query and key blocks (32 under the interpreter)
        verify(16, 6, 2, 64, (0, 37, 5), (random_tree(70, 1), random_tree(40, 2), (-1,))),
        # parents after their children: the mask, not the node order, decides
        verify(1, 4, 4, 64, (9, 50), (random_tree(45, 3, shuffled=True), random_tree(9, 4))),
        verify(1, 6, 2, 64, (0, 3), (CHAIN70, random_tree(33, 5, shuffled=True))),
        # sliding windows count tree positions (prefix + depth), not node indices
        verify(
            16,
            6,
            2,
            64,
            (20, 3, 40),
            (random_tree(70, 6), random_tree(33, 7, shuffled=True), (-1, 0, 1, 2)),
            sliding_window=3,
        ),
        verify(
            16, 4, 2, 64, (30, 0), (random_tree(40, 8, shuffled=True), CHAIN70), sliding_window=1
        ),
        verify(16, 6, 2, 64, (5, 60), (CHAIN70, random_tree(50, 9)), sliding_window=40),
        verify(16, 20, 1, 128, (5, 40), (random_tree(12, 10), random_tree(3, 11))),
        verify(
            16,
            6,
            2,
            96,
            (7, 16),
            (random_tree(20, 12), random_tree(35, 13, shuffled=True)),
            dtype=torch.bfloat16,
        ),
    ],
    ids=str,
)
def test_target_verify_matches_torch_native(spec):
    compare(small_splits, spec)


def test_target_verify_strided_qkv():
    spec = verify(16, 6, 2, 64, (0, 7), (random_tree(12, 14), random_tree(5, 15, shuffled=True)))
    compare(small_splits, spec, strided_qkv=True)


def test_target_verify_chain_is_causal_extend():
    """A chain's tree mask is the causal mask: the tree path gives the causal path's output
    (up to rounding: with a window the two paths start their key blocks at different
    positions, so the online softmax sums in a different order)."""
    prefix = (0, 21, 40)
    chains = (CHAIN70, tuple(range(-1, 4)), (-1,))
    plain = build(extend(16, 6, 2, 64, prefix, tuple(map(len, chains)), sliding_window=9))
    tree = build(verify(16, 6, 2, 64, prefix, chains, sliding_window=9))
    assert torch.equal(plain.q, tree.q) and torch.equal(plain.batch.positions, tree.batch.positions)
    backend = make_backend(plain.ctx)
    torch.testing.assert_close(run(backend, tree), run(backend, plain), rtol=1e-5, atol=1e-6)


def test_target_verify_declared_and_checked():
    built = build(verify(16, 4, 2, 64, (3,), ((-1, 0, 0),)))
    backend = make_backend(built.ctx)
    assert backend.supports_target_verify
    built.batch.tree_mask = None
    with pytest.raises(ValueError, match="tree_mask"):
        backend.init_forward_metadata(built.batch)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conforms_to_reference(case):
    run_case(make_backend, case)


def _kv_case_runs_here(case) -> bool:
    """Every shape of the suite in fp8 e4m3; in the other dtypes (the same kernels, each
    tile widened on load) one extend, one decode and one verify case, on pages of 16 without
    a window or a shared prefix (those shapes run in e4m3 and in the float32 cases)."""
    if case.kv_dtype == torch.float8_e4m3fn:
        return True
    return case.page_size == 16 and case.sliding_window is None and not case.shared_prefix


@pytest.mark.parametrize("case", MLA_CASES, ids=str)
def test_mla_conforms_to_reference(case):
    """MLA: the latent head in two tiles with V from the first (absorbed form, every mode),
    and the expanded prefill."""
    run_case(make_backend, case)


@pytest.mark.parametrize("case", [c for c in KV_DTYPE_CASES if _kv_case_runs_here(c)], ids=str)
def test_kv_dtypes_conform(case):
    """Narrow pools (--kv-cache-dtype), fp8 included: the interpreter widens every tile."""
    run_case(make_backend, case)


def test_decode_metadata_fixed_buffers():
    """Decode metadata is computed once per step into preallocated buffers: the split
    counts and the partial-output buffers keep their storage from step to step."""
    built = build(decode(16, 6, 2, 64, (1, 16, 17, 64, 65, 300)))
    backend = small_splits(built.ctx)
    mid_o, lse = backend._mid_o.data_ptr(), backend._mid_lse.data_ptr()
    backend.init_forward_metadata(built.batch)
    meta = built.batch.attn_metadata
    assert meta.num_splits.tolist() == [1, 1, 2, 4, 4, 4]
    assert meta.num_splits.data_ptr() == backend._num_splits.data_ptr()
    assert backend._mid_o.shape == (6, 6, 4, 64) and backend._mid_lse.shape == (6, 6, 4)
    run(backend, built)
    assert (backend._mid_o.data_ptr(), backend._mid_lse.data_ptr()) == (mid_o, lse)
    small = build(decode(16, 6, 2, 64, (40, 3)))
    backend.init_forward_metadata(small.batch)
    assert small.batch.attn_metadata.num_splits.data_ptr() == backend._num_splits.data_ptr()


def test_metadata_is_built_once_per_step(monkeypatch):
    """Layers only launch kernels: forward never rebuilds metadata."""
    built = build(extend(16, 6, 2, 64, (0, 7), (5, 12)))
    backend = make_backend(built.ctx)
    backend.init_forward_metadata(built.batch)
    calls = []
    monkeypatch.setattr(backend, "init_forward_metadata", lambda b: calls.append(b))
    for _ in range(3):
        backend.forward(built.q, built.k, built.v, built.layer, built.batch)
    assert calls == []


def test_registered_under_entry_point(monkeypatch):
    from radixserve.registry import ALLOWLIST_ENV, Registry

    monkeypatch.setenv(
        ALLOWLIST_ENV, "radixserve-attention-triton"
    )  # others' plugins may be mid-install
    reg = Registry()
    reg.load_entry_points()
    entry = reg.get("attention", "triton")
    assert entry.distribution == "radixserve-attention-triton"
    assert entry.factory is make_backend
    assert entry.is_available  # TRITON_INTERPRET=1 here (conftest.py)
    from radixserve_attention_triton.backend import TritonAttention

    for feature in ("supports_target_verify", "supports_mla"):  # the factory declares what the class does
        assert getattr(make_backend, feature) is getattr(TritonAttention, feature) is True


def test_probe_reasons(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert radixserve_attention_triton.unavailable_reason() is None
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = radixserve_attention_triton.unavailable_reason()
    assert "GPU" in reason and "TRITON_INTERPRET=1" in reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert radixserve_attention_triton.unavailable_reason() is None
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    assert "triton is not importable" in radixserve_attention_triton.unavailable_reason()


def test_cpu_without_interpreter_is_refused(monkeypatch):
    from radixserve_attention_triton import kernels

    monkeypatch.setattr(kernels, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        make_backend(build(decode(1, 4, 4, 64, (3,))).ctx)


def test_head_dim_too_large_is_refused():
    ctx = build(decode(1, 4, 4, 64, (3,))).ctx
    from dataclasses import replace

    with pytest.raises(ValueError, match="head_dim up to 256"):
        make_backend(replace(ctx, head_dim=512))
    with pytest.raises(ValueError, match="MLA latent of up to 512"):
        make_backend(replace(ctx, head_dim=1088, v_head_dim=1024))


def test_kernels_compile_for_a_gpu():
    """The interpreter forgives what the GPU compiler refuses (non-constexpr globals, a
    branch changing a value's type, tiles over the shared-memory limit): compile every
    kernel for sm_90 with Triton's toolchain, in a process without the interpreter, for plain
    heads and for DeepSeek's MLA latent (512 + 64 dims, 16 heads per rank over it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys; from radixserve_attention_triton.compile_check import main; "
            "sys.exit(main(['--arch', '90', '--dtype', 'bf16', '--head-dim', '128', '--group', '8']) or "
            "main(['--arch', '90', '--dtype', 'bf16', '--head-dim', '576', '--mla-latent', '512', '--group', '16']))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sm_90 bf16 head_dim=128 group=8: shared memory extend" in proc.stdout
    assert "sm_90 bf16 head_dim=576 mla_latent=512 group=16: shared memory extend" in proc.stdout


def test_one_launch_for_a_mixed_batch(monkeypatch):
    """Extend serves every request of the step in one kernel launch; decode in two (the
    split stage and the merge), whatever the number of requests."""
    from radixserve_attention_triton import kernels

    launches = []

    class Counting:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launches.append((self.name, grid))
            return self.kernel[grid]

    for name in ("extend_kernel", "decode_stage1_kernel", "decode_stage2_kernel"):
        monkeypatch.setattr(kernels, name, Counting(name, getattr(kernels, name)))
    built = build(extend(16, 6, 2, 64, (0, 7, 16, 33), (13, 1, 20, 40)))
    run(make_backend(built.ctx), built)
    assert launches == [("extend_kernel", (4, 6, 2))]  # 40 new tokens: two blocks of 32
    launches.clear()
    built = build(decode(16, 6, 2, 64, (1, 9, 300, 47, 70)))
    run(make_backend(built.ctx), built)
    assert launches == [("decode_stage1_kernel", (5, 2, 4)), ("decode_stage2_kernel", (5, 6))]
    launches.clear()
    built = build(verify(16, 6, 2, 64, (0, 7, 16), (random_tree(40, 0), (-1, 0, 0), (-1,))))
    run(make_backend(built.ctx), built)
    assert launches == [("extend_kernel", (3, 6, 2))]  # target verify: the same one launch

"""The fa3 / fa2 backend on CPU, its kernels replaced by torch doubles that follow the
libraries' documented semantics (``fa_reference.py``): the shared conformance suite
(extend, decode, mixed, target verify, sliding windows, narrow KV pools), the CUDA-graph
buffer protocol, and the probes and start-up checks.

These check radixserve's side (page tables, lengths, the gather path, the verify merge, the
calls' arguments); the real kernels run in ``test_flash_attn_gpu.py`` on a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import pytest
import radixserve_attention_flash_attn as plugin
import torch
from fa_reference import FA2, FA3
from radixserve.layers.attention import AttentionContext, AttentionLayer, ForwardBatch, ForwardMode
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.testing.attention_conformance import CASES, KV_DTYPE_CASES, Case, run_case
from radixserve_attention_flash_attn.backend import FlashAttention, check_context


def fa3(ctx):
    return FlashAttention(ctx, version=3, lib=FA3)


def fa2(ctx):
    return FlashAttention(ctx, version=2, lib=FA2)


FACTORIES = {"fa3": fa3, "fa2": fa2}


def conform(factory, case, **kw) -> None:
    """``run_case``, and a finite error: its tolerance test lets NaN outputs through."""
    err = run_case(factory, case, **kw)
    assert math.isfinite(err), f"{case}: non-finite output"

# FA2 reads pages itself only at page sizes of 256*k: these run its paged path (the suite's
# own cases, at pages 1 and 16, run its gather path)
FA2_PAGED_CASES = [
    Case("extend", 256, 6, 2, 64, (300, 0, 17), (9, 40, 1)),
    Case("decode", 256, 8, 1, 64, (0, 255, 600), (1, 1, 1)),
    Case("decode", 256, 4, 2, 64, (400, 3), (1, 1), sliding_window=8),
    Case("extend", 256, 4, 2, 64, (270, 0), (12, 30), sliding_window=8),
    Case("mixed", 256, 6, 2, 64, (0, 20, 300), (9, 1, 1)),
    Case("verify", 256, 6, 2, 64, (13, 300, 0), (5, 8, 1),
         trees=((-1, 0, 1, 2, 3), (-1, 0, 0, 1, 1, 2, 4, 6), (-1,))),
    Case("verify", 256, 4, 2, 64, (300, 3), (8, 5), sliding_window=4,
         trees=((-1, 0, 0, 1, 1, 2, 4, 6), (-1, 0, 1, 2, 3))),
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("version", ["fa3", "fa2"])
def test_conforms(version, case):
    conform(FACTORIES[version], case)


@pytest.mark.parametrize("case", KV_DTYPE_CASES, ids=str)
def test_kv_dtypes_conform(case):
    """Narrow pools take the gather path, which both versions share (fa3's varlen here)."""
    conform(fa3, case)


@pytest.mark.parametrize("case", FA2_PAGED_CASES, ids=str)
def test_fa2_paged_path_conforms(case):
    conform(fa2, case)


@pytest.mark.parametrize("case", FA2_PAGED_CASES[:3], ids=str)
def test_fa3_pages_of_256_conform(case):
    conform(fa3, case)


def _ctx(page_size=16, dtype=torch.float32, kv_dtype=None, device="cpu", max_ctx=256, head_dim=64):
    return AttentionContext(num_heads=4, num_kv_heads=2, head_dim=head_dim, num_layers=1,
                            dtype=dtype, device=torch.device(device), page_size=page_size,
                            max_context_len=max_ctx, max_batch_size=8, kv_dtype=kv_dtype)


def test_which_path_reads_the_pool():
    """FA3 reads pages of any size; FA2 only at 256*k; narrow pools gather (widened), and only
    the paged path offers CUDA graphs."""
    for page in (1, 16, 64):
        assert fa3(_ctx(page)).paged and fa3(_ctx(page)).supports_cuda_graph
        assert not fa2(_ctx(page)).paged and not fa2(_ctx(page)).supports_cuda_graph
    assert fa2(_ctx(256)).paged and fa2(_ctx(512)).supports_cuda_graph
    narrow = fa3(_ctx(16, kv_dtype=torch.float8_e4m3fn))
    assert not narrow.paged and not narrow.supports_cuda_graph
    with pytest.raises(RuntimeError, match="cannot be captured"):
        fa2(_ctx(16)).init_cuda_graph_state(4)


# ------------------------------------------------------------------ CUDA-graph protocol
def _decode_batch(ctx, pool, r2t, rows, seq_lens, out_loc) -> ForwardBatch:
    n = len(rows)
    return ForwardBatch(
        mode=ForwardMode.DECODE, batch_size=n,
        input_ids=torch.zeros(n, dtype=torch.int64), positions=torch.tensor(seq_lens) - 1,
        req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq_lens),
        out_cache_loc=torch.tensor(out_loc), seq_lens_cpu=list(seq_lens),
        prefix_lens_cpu=[s - 1 for s in seq_lens], extend_lens_cpu=[1] * n,
        req_to_token=r2t.req_to_token, kv_pool=pool, logits_indices=torch.arange(n))


def _fill(pool, r2t, row, pages, length, gen):
    page = pool.page_size
    slots = torch.tensor([pages[p // page] * page + p % page for p in range(length)])
    r2t.req_to_token[row, :length] = slots
    pool.k_buffers[0][slots] = torch.randn(length, 2, 64, generator=gen)
    pool.v_buffers[0][slots] = torch.randn(length, 2, 64, generator=gen)
    return slots


@pytest.mark.parametrize("version,page", [("fa3", 1), ("fa3", 16), ("fa2", 256)])
def test_decode_graph_buffers_rewritten_in_place(version, page):
    """The capture/replay protocol as the engine runs it (radixserve.engine.cuda_graph), with
    the replayed graph stood in for by a re-run of the layer: a bucket of 4 captured with
    padding rows, replayed with other requests and lengths written into the same static
    tensors, gives the eager result for the real rows, and the kernels' page table and
    lengths keep their addresses."""
    gen = torch.Generator().manual_seed(0)
    ctx = _ctx(page, max_ctx=4 * 256)
    num_pages = 4 * math.ceil(ctx.max_context_len / page) + 2
    pool = KVPool(num_layers=1, num_pages=num_pages, page_size=page, num_kv_heads=2, head_dim=64,
                  dtype=torch.float32, device="cpu")
    r2t = ReqToTokenPool(6, ctx.max_context_len, "cpu")
    pad_row = 5  # its table is all zeros: scratch page 0
    backend = FACTORIES[version](ctx)
    backend.init_cuda_graph_state(8)
    layer = AttentionLayer(0, 4, 2, 64, 64 ** -0.5)
    # static buffers of a bucket of 4, captured with padding only
    static = _decode_batch(ctx, pool, r2t, [pad_row] * 4, [1] * 4, [0] * 4)
    backend.init_forward_metadata_capture_cuda_graph(static)
    table_ptr = static.attn_metadata.page_table.data_ptr()
    lens_ptr = static.attn_metadata.cache_seqlens.data_ptr()
    q_static = torch.zeros(4, 4, 64)
    kv_static = torch.zeros(4, 2, 64)
    backend.forward(q_static, kv_static, kv_static, layer, static)
    # a step of 3 requests, padded to the bucket
    free = iter(pool.allocator.allocate(pool.allocator.num_free_pages))
    lens = [37, 3 * page + 1, 700]
    rows, new_slots = [0, 2, 3], []
    for row, n in zip(rows, lens):
        slots = _fill(pool, r2t, row, [next(free) for _ in range(math.ceil(n / page))], n, gen)
        new_slots.append(int(slots[-1]))
    q = torch.randn(3, 4, 64, generator=gen)
    k_new, v_new = torch.randn(3, 2, 64, generator=gen), torch.randn(3, 2, 64, generator=gen)
    for i, row in enumerate(rows):
        static.req_pool_indices[i] = row
        static.seq_lens[i] = lens[i]
        static.out_cache_loc[i] = new_slots[i]
    static.seq_lens_cpu = lens + [1]
    static.prefix_lens_cpu = [n - 1 for n in lens] + [0]
    q_static[:3], kv_static[:3] = q, k_new
    v_static = kv_static.clone()
    v_static[:3] = v_new
    backend.init_forward_metadata_replay_cuda_graph(static)
    meta = static.attn_metadata
    assert meta.page_table.data_ptr() == table_ptr and meta.cache_seqlens.data_ptr() == lens_ptr
    assert meta.page_table.shape == (4, ctx.max_context_len // page)
    assert meta.cache_seqlens.tolist() == lens + [1]
    assert meta.page_table[3].tolist() == [0] * meta.page_table.shape[1]  # padding: scratch page
    replayed = backend.forward(q_static, kv_static, v_static, layer, static)[:3]
    eager = _decode_batch(ctx, pool, r2t, rows, lens, new_slots)
    backend.init_forward_metadata(eager)
    expected = backend.forward(q, k_new, v_new, layer, eager)
    torch.testing.assert_close(replayed, expected, rtol=0, atol=0)
    from radixserve_attention_torch import TorchNativeAttention

    native = TorchNativeAttention(ctx)
    native.init_forward_metadata(eager)
    torch.testing.assert_close(expected, native.forward(q, k_new, v_new, layer, eager),
                               rtol=1e-4, atol=2e-5)


def test_graph_capture_needs_state():
    backend = fa3(_ctx())
    batch = _decode_batch(_ctx(), None, ReqToTokenPool(2, 256, "cpu"), [0], [1], [0])
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_capture_cuda_graph(batch)


# ------------------------------------------------------------------ probes and start-up
def test_probes_name_the_missing_pieces(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "CUDA GPU of compute capability 8.0+" in plugin.fa2_unavailable_reason()
    assert "Hopper" in plugin.fa3_unavailable_reason()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    fa3_reason = plugin.fa3_unavailable_reason()
    assert "9.x" in fa3_reason and "8.0" in fa3_reason and "fa2" in fa3_reason
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import raises ImportError
    assert "flash-attn is not importable" in plugin.fa2_unavailable_reason()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    assert "flash_attn_interface) is not importable" in plugin.fa3_unavailable_reason()
    monkeypatch.setitem(sys.modules, "flash_attn_interface", FA3)  # a stand-in module
    assert plugin.fa3_unavailable_reason() is None
    monkeypatch.setitem(sys.modules, "flash_attn", type(sys)("flash_attn"))
    sys.modules["flash_attn"].__dict__.update(vars(FA2), __version__="2.4.2")
    assert "2.4.2 is too old" in plugin.fa2_unavailable_reason()
    sys.modules["flash_attn"].__version__ = "2.8.3"
    assert plugin.fa2_unavailable_reason() is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    assert "8.0+" in plugin.fa2_unavailable_reason()


def test_registered_under_entry_point(monkeypatch):
    from radixserve.registry import ALLOWLIST_ENV, Registry

    monkeypatch.setenv(ALLOWLIST_ENV, "radixserve-attention-flash-attn")
    reg = Registry()
    reg.load_entry_points()
    for name, factory in (("fa3", plugin.make_fa3), ("fa2", plugin.make_fa2)):
        entry = reg.get("attention", name)
        assert entry.distribution == "radixserve-attention-flash-attn"
        assert entry.factory is factory
        if not torch.cuda.is_available():
            assert not entry.is_available and "GPU" in entry.unavailable_reason()


def test_plugin_imports_no_library(monkeypatch):
    """Listing plugins must work without flash-attn: the package and its backend module
    import with both libraries unimportable."""
    import importlib

    import radixserve_attention_flash_attn.backend as backend_module

    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    importlib.reload(plugin)
    importlib.reload(backend_module)


def test_start_up_checks_name_the_flag():
    with pytest.raises(ValueError, match="runs on CUDA devices"):
        check_context(_ctx(), "fa3")
    cuda = dataclasses.replace(_ctx(), device=torch.device("cuda"))
    with pytest.raises(ValueError, match=r"--attention-backend fa3 .*--dtype bfloat16"):
        check_context(cuda, "fa3")
    with pytest.raises(ValueError, match="multiple of 8 and at most 256"):
        check_context(dataclasses.replace(cuda, dtype=torch.bfloat16, head_dim=512), "fa2")
    check_context(dataclasses.replace(cuda, dtype=torch.bfloat16, kv_dtype=torch.bfloat16), "fa2")

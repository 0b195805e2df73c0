"""The pure-torch pieces of the flash-attn backends: metadata from a small hand-built batch
against hand-derived values, and from random batches (page sizes 1 to 256, shuffled pages)
against plain Python loops; the page table written in place into a CUDA-graph buffer; the
masked attention and its log-sum-exp merge."""

from __future__ import annotations

import math
import random

import pytest
import torch
from radixserve.layers.attention import ForwardBatch, ForwardMode
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve_attention_flash_attn.metadata import (
    cumsum0,
    decode_metadata,
    extend_metadata,
    masked_attention,
    merge_by_lse,
    token_slots,
    window_size,
    write_page_table,
)

PAGE = 4


def _batch(mode=ForwardMode.EXTEND, **kw) -> ForwardBatch:
    """Two requests over pages of 4 slots: row 2 owns pages 5, 3 (6 tokens, 4 cached), row 0
    owns page 1 (3 tokens, none cached); row 1 is stale."""
    pool = KVPool(num_layers=1, num_pages=8, page_size=PAGE, num_kv_heads=1, head_dim=8,
                  dtype=torch.float32, device="cpu")
    r2t = ReqToTokenPool(3, 16, "cpu")
    r2t.write(2, [5, 3], PAGE, 0, 6)  # slots 20 21 22 23 | 12 13
    r2t.write(0, [1], PAGE, 0, 3)  # slots 4 5 6
    r2t.req_to_token[1] = 31
    fields = dict(
        mode=mode, batch_size=2, input_ids=torch.zeros(5, dtype=torch.int64),
        positions=torch.tensor([4, 5, 0, 1, 2]), req_pool_indices=torch.tensor([2, 0]),
        seq_lens=torch.tensor([6, 3]), out_cache_loc=torch.tensor([12, 13, 4, 5, 6]),
        seq_lens_cpu=[6, 3], prefix_lens_cpu=[4, 0], extend_lens_cpu=[2, 3],
        req_to_token=r2t.req_to_token, kv_pool=pool, logits_indices=torch.tensor([1, 4]))
    fields.update(kw)
    return ForwardBatch(**fields)


def test_extend_metadata_paged():
    meta = extend_metadata(_batch(), PAGE, paged=True)
    assert meta.page_table.dtype == torch.int32
    assert meta.page_table.tolist() == [[5, 3], [1, 0]]  # row 0 past its length: column 4 is slot 0
    assert meta.cache_seqlens.tolist() == [6, 3] and meta.cache_seqlens.dtype == torch.int32
    assert meta.cu_seqlens_q.tolist() == [0, 2, 5] and meta.cu_seqlens_q.dtype == torch.int32
    assert meta.cu_seqlens_k.tolist() == [0, 6, 9]
    assert (meta.max_seqlen_q, meta.max_seqlen_k) == (3, 6)
    assert meta.kv_slots is None and meta.verify is None


def test_extend_metadata_gather():
    meta = extend_metadata(_batch(), PAGE, paged=False)
    assert meta.page_table is None
    assert meta.kv_slots.tolist() == [20, 21, 22, 23, 12, 13, 4, 5, 6]


def test_decode_metadata():
    batch = _batch(ForwardMode.DECODE, seq_lens=torch.tensor([6, 3]), out_cache_loc=torch.tensor([13, 6]),
                   positions=torch.tensor([5, 2]), prefix_lens_cpu=[5, 2], extend_lens_cpu=[1, 1],
                   input_ids=torch.zeros(2, dtype=torch.int64))
    paged = decode_metadata(batch, PAGE, paged=True)
    assert paged.page_table.tolist() == [[5, 3], [1, 0]] and paged.cache_seqlens.tolist() == [6, 3]
    gather = decode_metadata(batch, PAGE, paged=False)
    assert gather.cu_seqlens_q.tolist() == [0, 1, 2] and gather.cu_seqlens_k.tolist() == [0, 6, 9]
    assert gather.kv_slots.tolist() == [20, 21, 22, 23, 12, 13, 4, 5, 6]


def test_verify_metadata():
    """Request 0 drafts a root and one child (prefix 4); request 1 a root with two children
    (no prefix)."""
    tree0 = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    tree1 = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    batch = _batch(ForwardMode.TARGET_VERIFY, positions=torch.tensor([4, 5, 0, 1, 1]),
                   tree_mask=torch.cat([tree0.reshape(-1), tree1.reshape(-1)]),
                   tree_mask_offsets_cpu=[0, 4])
    vm = extend_metadata(batch, PAGE, paged=False).verify
    assert vm.prefix_lens.tolist() == [4, 0] and vm.cu_prefix.tolist() == [0, 4, 4]
    assert vm.max_prefix == 4
    assert vm.has_prefix.tolist() == [True, True, False, False, False]
    assert vm.tree_index.tolist() == [[0, 1, 0], [2, 3, 4]]
    assert vm.tree_valid.tolist() == [[True, True, False], [True, True, True]]
    assert vm.tree_pos.tolist() == [[4, 5, 0], [0, 1, 1]]
    assert torch.equal(vm.tree_allow[0, :2, :2], tree0) and not vm.tree_allow[0, 2].any()
    assert torch.equal(vm.tree_allow[1], tree1)
    assert vm.prefix_slots.tolist() == [20, 21, 22, 23]


def test_verify_metadata_paged():
    """The paged path reads the prefix through the page table: no gathered prefix slots."""
    tree0 = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    tree1 = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    batch = _batch(ForwardMode.TARGET_VERIFY, positions=torch.tensor([4, 5, 0, 1, 1]),
                   tree_mask=torch.cat([tree0.reshape(-1), tree1.reshape(-1)]), tree_mask_offsets_cpu=[0, 4])
    meta = extend_metadata(batch, PAGE, paged=True)
    assert meta.page_table.tolist() == [[5, 3], [1, 0]] and meta.kv_slots is None
    assert meta.verify.prefix_slots is None and meta.verify.prefix_lens.dtype == torch.int32
    assert meta.verify.cu_prefix.tolist() == [0, 4, 4] and meta.verify.cu_prefix.dtype == torch.int32


def _random_batch(page: int, seed: int, mode=ForwardMode.EXTEND):
    """Five requests in rows of a 7-row table, each over shuffled pages of the pool, with random
    cached and new lengths (a decode batch: one new token each); the other rows hold stale slots."""
    rnd = random.Random(seed)
    max_ctx = 4 * page + 40
    r2t = ReqToTokenPool(7, max_ctx, "cpu")
    num_pages = 7 * math.ceil(max_ctx / page) + 1
    free = list(range(1, num_pages))
    rnd.shuffle(free)
    r2t.req_to_token[:] = torch.randint(0, num_pages * page, r2t.req_to_token.shape,
                                        generator=torch.Generator().manual_seed(seed))
    rows = rnd.sample(range(7), 5)
    seq, ext = [], []
    for row in rows:
        n = rnd.randint(1, max_ctx)
        e = 1 if mode is ForwardMode.DECODE else rnd.randint(1, n)
        pages = [free.pop() for _ in range(math.ceil(n / page))]
        r2t.write(row, pages, page, 0, n)
        seq.append(n)
        ext.append(e)
    pool = KVPool(num_layers=1, num_pages=num_pages, page_size=page, num_kv_heads=1, head_dim=8,
                  dtype=torch.float32, device="cpu")
    batch = ForwardBatch(
        mode=mode, batch_size=5, input_ids=torch.zeros(sum(ext), dtype=torch.int64),
        positions=torch.cat([torch.arange(n - e, n) for n, e in zip(seq, ext)]),
        req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq), out_cache_loc=torch.zeros(sum(ext)),
        seq_lens_cpu=seq, prefix_lens_cpu=[n - e for n, e in zip(seq, ext)], extend_lens_cpu=ext,
        req_to_token=r2t.req_to_token, kv_pool=pool, logits_indices=torch.arange(5))
    return batch


def _pages_of(batch, i: int, page: int) -> list[int]:
    """Request i's pages in order, one Python lookup per page."""
    row = int(batch.req_pool_indices[i])
    return [int(batch.req_to_token[row, p * page]) // page for p in range(math.ceil(batch.seq_lens_cpu[i] / page))]


def _slots_of(batch, i: int, start: int, count: int) -> list[int]:
    row = int(batch.req_pool_indices[i])
    return [int(batch.req_to_token[row, p]) for p in range(start, start + count)]


def _prefix_sums(lens) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize("page", [1, 4, 16, 256])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metadata_of_random_batches_matches_plain_loops(page, seed):
    batch = _random_batch(page, seed)
    seq, ext = batch.seq_lens_cpu, batch.extend_lens_cpu
    paged = extend_metadata(batch, page, paged=True)
    table = paged.page_table
    assert table.dtype == torch.int32 and table.is_contiguous()
    assert table.shape == (5, math.ceil(max(seq) / page))
    for i in range(5):
        want = _pages_of(batch, i, page)
        assert table[i, :len(want)].tolist() == want
    assert paged.cu_seqlens_q.tolist() == _prefix_sums(ext) and paged.cu_seqlens_k.tolist() == _prefix_sums(seq)
    assert paged.cache_seqlens.tolist() == seq and paged.cache_seqlens.dtype == torch.int32
    assert (paged.max_seqlen_q, paged.max_seqlen_k) == (max(ext), max(seq))
    gather = extend_metadata(batch, page, paged=False)
    assert gather.kv_slots.tolist() == [s for i in range(5) for s in _slots_of(batch, i, 0, seq[i])]
    decode = _random_batch(page, seed, ForwardMode.DECODE)
    dmeta = decode_metadata(decode, page, paged=False)
    assert dmeta.cu_seqlens_q.tolist() == list(range(6)) and dmeta.cu_seqlens_q.dtype == torch.int32
    assert dmeta.cu_seqlens_k.tolist() == _prefix_sums(decode.seq_lens_cpu)
    starts = [random.Random(seed).randint(0, n - 1) for n in seq]
    counts = [n - s for n, s in zip(seq, starts)]
    assert token_slots(batch.req_to_token, batch.req_pool_indices, counts, start=starts).tolist() == [
        s for i in range(5) for s in _slots_of(batch, i, starts[i], counts[i])]


@pytest.mark.parametrize("page", [1, 16])
def test_write_page_table_into_a_graph_buffer(page):
    """Rows rewritten in place, as many columns as the buffer has (a wider buffer keeps its
    columns past the token table's width), other rows untouched."""
    batch = _random_batch(page, 3, ForwardMode.DECODE)
    rows = batch.req_pool_indices
    width = math.ceil(batch.req_to_token.shape[1] / page)
    buffer = torch.full((8, width + 2), -1, dtype=torch.int32)
    out = write_page_table(buffer[:5], batch.req_to_token, rows, page)
    assert out.data_ptr() == buffer.data_ptr()
    for i in range(5):
        row = int(rows[i])
        want = [int(batch.req_to_token[row, c * page]) // page for c in range(width)]
        assert buffer[i, :width].tolist() == want
    assert (buffer[:, width:] == -1).all() and (buffer[5:] == -1).all()
    narrow = torch.zeros(5, 2, dtype=torch.int32)
    write_page_table(narrow, batch.req_to_token, rows, page)
    assert narrow.tolist() == [[int(batch.req_to_token[int(r), c * page]) // page for c in range(2)] for r in rows]


def test_cumsum0():
    assert cumsum0([3, 0, 5], "cpu").tolist() == [0, 3, 3, 8]
    assert cumsum0([], "cpu").tolist() == [0] and cumsum0([1], "cpu").dtype == torch.int32


def test_token_slots_from_an_offset():
    r2t = _batch().req_to_token
    assert token_slots(r2t, torch.tensor([2, 0]), [2, 1], start=[3, 2]).tolist() == [23, 12, 6]
    assert token_slots(r2t, torch.tensor([2]), [0]).numel() == 0


def test_window_size():
    assert window_size(None) == (-1, -1)
    assert window_size(8) == (7, 0)  # itself and the 7 before it


def _dense(q, k, v, allow, scale):
    """Plain softmax attention, one [M, N] matrix per head."""
    scores = torch.einsum("mhd,nhd->hmn", q, k) * scale
    scores = scores.masked_fill(~allow[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", scores.softmax(-1), v)


def test_masked_attention_and_lse_merge_match_full_softmax():
    gen = torch.Generator().manual_seed(0)
    m, n, heads, dim = 7, 23, 4, 16
    q = torch.randn(1, m, heads, dim, generator=gen)
    k = torch.randn(1, n, 2, dim, generator=gen)  # GQA: 2 query heads per KV head
    v = torch.randn(1, n, 2, dim, generator=gen)
    allow = torch.rand(1, m, n, generator=gen) < 0.7
    allow[0, :, 0] = True  # every row sees a key
    part = torch.rand(1, 1, n, generator=gen) < 0.5
    part[0, 0, 0] = True
    part[0, 0, 1] = False
    a_allow, b_allow = allow & part, allow & ~part
    b_allow[0, 3] = False  # row 3 sees nothing in part b: lse -inf, weight 0
    a_allow[0, 3] = allow[0, 3]
    scale = dim ** -0.5
    out_a, lse_a = masked_attention(q, k, v, a_allow, scale)
    out_b, lse_b = masked_attention(q, k, v, b_allow, scale)
    assert lse_b[0, 3].eq(float("-inf")).all() and out_b[0, 3].eq(0).all()
    merged, lse = merge_by_lse(out_a, lse_a, out_b, lse_b)
    expected = _dense(q[0], k[0].repeat_interleave(2, 1), v[0].repeat_interleave(2, 1), allow[0], scale)
    torch.testing.assert_close(merged[0], expected, rtol=1e-5, atol=1e-6)
    full_out, full_lse = masked_attention(q, k, v, allow, scale)
    torch.testing.assert_close(lse, full_lse, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(full_out[0], expected, rtol=1e-5, atol=1e-6)

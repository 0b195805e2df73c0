"""The planner inputs (CSR page table, qo_indptr, tree masks, window_left) built from small
real ForwardBatches, against expectations worked out by hand in the comments."""

from __future__ import annotations

import pytest
import torch
from radixserve.layers.attention import ForwardBatch, ForwardMode
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve_attention_flashinfer.planner import (
    paged_kv,
    pages_per_request,
    qo_indptr,
    tree_custom_mask,
    window_left,
)

STALE = 39  # a slot of page 9 (page size 4): written past each sequence, never to be read


def _batch(page_size, rows_pages, prefix_lens, extend_lens, mode=ForwardMode.EXTEND):
    """Requests in table rows 3, 1, 2, ... whose positions lie page by page in the pages
    given; the table holds STALE past each sequence."""
    pool = KVPool(num_layers=1, num_pages=12, page_size=page_size, num_kv_heads=1, head_dim=8,
                  dtype=torch.float32, device="cpu")
    table = ReqToTokenPool(4, 16, "cpu")
    table.req_to_token.fill_(STALE)
    rows = [3, 1, 2, 0][:len(rows_pages)]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    for row, pages, n in zip(rows, rows_pages, seq_lens):
        table.write(row, pages, page_size, 0, n)
    return ForwardBatch(
        mode=mode, batch_size=len(rows), input_ids=torch.zeros(sum(extend_lens), dtype=torch.int64),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]),
        req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq_lens),
        out_cache_loc=torch.zeros(sum(extend_lens), dtype=torch.int64), seq_lens_cpu=seq_lens,
        prefix_lens_cpu=list(prefix_lens), extend_lens_cpu=list(extend_lens),
        req_to_token=table.req_to_token, kv_pool=pool,
        logits_indices=torch.tensor(extend_lens).cumsum(0) - 1)


def test_page_table_of_an_extend_batch():
    # page size 4. A: 3 cached + 3 new = 6 tokens on pages 5, 2 (2 tokens in the last);
    # B: 4 new tokens, exactly page 7; C: 8 cached + 1 new = 9 tokens on pages 1, 3, 6 (1 in the last)
    batch = _batch(4, [[5, 2], [7], [1, 3, 6]], (3, 0, 8), (3, 4, 1))
    kv = paged_kv(batch, 4)
    assert kv.indptr.tolist() == [0, 2, 3, 6]
    assert kv.indices.tolist() == [5, 2, 7, 1, 3, 6]
    assert kv.last_page_len.tolist() == [2, 4, 1]
    assert kv.seq_lens == [6, 4, 9]
    assert qo_indptr(batch.extend_lens_cpu).tolist() == [0, 3, 7, 8]
    for t in (kv.indptr, kv.indices, kv.last_page_len, qo_indptr([1])):
        assert t.dtype == torch.int32
    assert kv.indptr.device.type == kv.last_page_len.device.type == "cpu"  # read by the host planner


def test_page_table_with_page_size_one_is_the_slots():
    # page size 1: every slot is a page; A holds slots 9, 4, 6; B slot 2
    batch = _batch(1, [[9, 4, 6], [2]], (2, 0), (1, 1), mode=ForwardMode.DECODE)
    kv = paged_kv(batch, 1)
    assert kv.indptr.tolist() == [0, 3, 4]
    assert kv.indices.tolist() == [9, 4, 6, 2]
    assert kv.last_page_len.tolist() == [1, 1]


def test_cuda_graph_padding_rows_read_the_scratch_page():
    # a bucket of 3 for 1 real request: rows 2 and 3 are the padding row 0, all zeros
    batch = _batch(4, [[5, 2]], (4,), (1,), mode=ForwardMode.DECODE)
    batch.req_to_token[0].zero_()
    batch.batch_size = 3
    batch.req_pool_indices = torch.tensor([3, 0, 0])
    kv = paged_kv(batch, 4, seq_lens=[5, 1, 1])
    assert kv.indptr.tolist() == [0, 2, 3, 4]
    assert kv.indices.tolist() == [5, 2, 0, 0]
    assert kv.last_page_len.tolist() == [1, 1, 1]


def test_shorter_lengths_than_the_batch_and_bad_lengths():
    batch = _batch(4, [[1, 3, 6]], (8,), (1,))
    kv = paged_kv(batch, 4, seq_lens=[5])  # the first 5 tokens: pages 1, 3
    assert kv.indices.tolist() == [1, 3] and kv.last_page_len.tolist() == [1]
    with pytest.raises(ValueError, match="at least one token"):
        paged_kv(batch, 4, seq_lens=[0])
    with pytest.raises(ValueError, match="sequence lengths for a batch of 1"):
        paged_kv(batch, 4, seq_lens=[3, 3])
    assert pages_per_request([1, 4, 5, 16], 4) == [1, 1, 2, 4]


def test_window_left_counts_the_query_itself():
    # radixserve's window w: the w most recent tokens, the query's own included, so keys
    # t - (w - 1) .. t; FlashInfer's window_left is that left reach
    assert window_left(None) == -1
    assert window_left(1) == 0
    assert window_left(4096) == 4095
    with pytest.raises(ValueError):
        window_left(0)


def _verify_batch():
    # request 0: 2 cached tokens, draft tree parents (-1, 0, 0): root at depth 0, two
    # children at depth 1 (positions 2, 3, 3); request 1: 1 cached token, a lone root
    batch = _batch(4, [[5, 2], [7]], (2, 1), (3, 1), mode=ForwardMode.TARGET_VERIFY)
    batch.positions = torch.tensor([2, 3, 3, 1])
    tree0 = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    batch.tree_mask = torch.cat([tree0.reshape(-1), torch.tensor([True])])
    batch.tree_mask_offsets_cpu = [0, 9]
    return batch


def test_tree_mask_is_the_prefix_then_the_tree():
    mask = tree_custom_mask(_verify_batch())
    expected = [
        1, 1, 1, 0, 0,  # root: prefix, itself
        1, 1, 1, 1, 0,  # child 1: prefix, root, itself
        1, 1, 1, 0, 1,  # child 2: prefix, root, itself
        1, 1,  # request 1's root: its one cached token, itself
    ]
    assert mask.dtype == torch.bool
    assert mask.int().tolist() == expected


def test_tree_mask_applies_a_sliding_window_by_position():
    # window 2: a token at position t sees positions t - 1 and t. Request 0's key positions
    # are 0, 1 (cached), 2, 3, 3 (the tree); the root (position 2) keeps keys at 1, 2, the
    # children (position 3) keep keys at 2, 3 (their ancestor and themselves; not each other)
    mask = tree_custom_mask(_verify_batch(), sliding_window=2)
    expected = [
        0, 1, 1, 0, 0,
        0, 0, 1, 1, 0,
        0, 0, 1, 0, 1,
        1, 1,
    ]
    assert mask.int().tolist() == expected


def test_tree_mask_needs_the_tree():
    batch = _verify_batch()
    batch.tree_mask = None
    with pytest.raises(ValueError, match="tree_mask"):
        tree_custom_mask(batch)

"""KV pages between two pools: the segments a request's transfer writes, applied to real
pools (with plain memory copies and with the mooncake engine), move exactly that request's
K/V, and the checksum both sides compute agrees only when the bytes do."""

from __future__ import annotations

import ctypes

import pytest
import torch
from radixserve.disaggregation.kv_pages import PoolLayout, checksum, segments
from radixserve.disaggregation.transfer import DONE, TransferContext, TransferError
from radixserve.mem.kv_pool import KVPool
from radixserve.registry import get_registry


def pool(page_size: int, slots: int = 1024, heads: int = 2, dtype=torch.float32) -> KVPool:
    p = KVPool(num_layers=3, num_pages=slots // page_size, page_size=page_size, num_kv_heads=heads, head_dim=8,
               dtype=dtype, device="cpu")
    p.buffer.copy_(torch.randn(p.buffer.shape).to(dtype))
    return p


def slots_of(pages: list[int], page_size: int, n: int) -> list[int]:
    return [p * page_size + i for p in pages for i in range(page_size)][:n]


PAGES = {1: [7, 8, 9, 3, 100, 101, 102, 103] + list(range(500, 529)), 4: [5, 2, 3, 9, 10, 11, 40, 41, 60, 61],
         16: [6, 7, 1]}  # 37 tokens' pages for each page size


@pytest.mark.parametrize("src_page, dst_page", [(1, 1), (16, 16), (4, 16), (16, 1)])
def test_segments_move_exactly_the_requests_kv(src_page, dst_page):
    a, b = pool(src_page), pool(dst_page)
    before = b.buffer.clone()
    n = 37
    s, d = slots_of(PAGES[src_page], src_page, n), slots_of(PAGES[dst_page], dst_page, n)
    src, dst, lengths = segments(PoolLayout.from_pool(a), s, PoolLayout.from_pool(b), d)
    assert sum(lengths) == 2 * 3 * n * a.num_kv_heads * 8 * 4
    assert len(lengths) < 2 * 3 * n  # consecutive slots are merged
    for x, y, m in zip(src, dst, lengths):
        ctypes.memmove(y, x, m)
    si, di = torch.tensor(s), torch.tensor(d)
    assert torch.equal(b.buffer[:, :, di], a.buffer[:, :, si])
    untouched = torch.ones(b.num_slots, dtype=torch.bool)
    untouched[di] = False
    assert torch.equal(b.buffer[:, :, untouched], before[:, :, untouched])
    assert checksum(a, s) == checksum(b, d)
    b.buffer[1, 2, d[-1], 1, 3] += 1.0  # one value of one V row
    assert checksum(a, s) != checksum(b, d)


def test_layouts_must_agree():
    a, b = pool(1), pool(1, heads=4)
    with pytest.raises(TransferError, match="KV pools differ"):
        segments(PoolLayout.from_pool(a), [1], PoolLayout.from_pool(b), [1])
    c = pool(1, dtype=torch.bfloat16)
    with pytest.raises(TransferError, match="dtype"):
        PoolLayout.from_pool(a).check(PoolLayout.from_pool(c))
    with pytest.raises(TransferError, match="outside"):
        segments(PoolLayout.from_pool(a), [a.num_slots], PoolLayout.from_pool(a), [1])
    with pytest.raises(TransferError, match="source slots"):
        segments(PoolLayout.from_pool(a), [1, 2], PoolLayout.from_pool(a), [1])
    layout = PoolLayout.from_pool(a)
    assert PoolLayout.from_dict(layout.as_dict()) == layout
    with pytest.raises(TransferError):
        PoolLayout.from_dict({"base": 1})


def test_a_request_through_the_mooncake_engine():
    entry = get_registry().get("kv_transfer", "mooncake")
    reason = entry.unavailable_reason()
    if reason is not None:
        pytest.skip(f"mooncake transfer engine unavailable: {reason}")
    a, b = pool(16), pool(16)
    sender = entry.factory(TransferContext(role="prefill", timeout=5.0))
    receiver = entry.factory(TransferContext(role="decode", timeout=5.0))
    try:
        la, lb = PoolLayout.from_pool(a), PoolLayout.from_pool(b)
        sender.register_regions([(la.base, la.nbytes)])
        receiver.register_regions([(lb.base, lb.nbytes)])
        s, d = slots_of([3, 4, 9], 16, 40), slots_of([20, 8, 9], 16, 40)
        handle = sender.submit_write(receiver.address(), *segments(la, s, lb, d))
        assert sender.wait(handle) == DONE
        assert checksum(a, s) == checksum(b, d)
    finally:
        sender.close()
        receiver.close()

"""The storage-tier conformance suite itself: a correct in-memory tier passes every check,
and each way of breaking the contract fails the check that owns it."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest
from radixserve.hicache import CacheTier, CacheTierContext
from radixserve.testing import cache_tier_conformance as cc

_STORES: dict[str, OrderedDict[str, bytes]] = {}  # storage name -> key -> value, LRU first


class MemoryTier(CacheTier):
    """A correct tier over a process-wide dict named by ``extra_config['name']``."""

    def __init__(self, ctx: CacheTierContext) -> None:
        self.data = _STORES.setdefault(ctx.extra_config["name"], OrderedDict())
        self.capacity = ctx.extra_config.get("storage_size") or 0
        self.owner = threading.get_ident()

    def batch_exists(self, keys):
        for n, key in enumerate(keys):
            if key not in self.data:
                return n
        return len(keys)

    def batch_get(self, keys):
        out = []
        for key in keys:
            if key in self.data:
                self.data.move_to_end(key)
            out.append(self.data.get(key))
        return out

    def batch_set(self, keys, values):
        for key, value in zip(keys, values):
            self.data.pop(key, None)
            while self.capacity and self.data and sum(map(len, self.data.values())) + len(value) > self.capacity:
                self.data.popitem(last=False)
            self.data[key] = bytes(value)
        return [True] * len(keys)

    def clear(self):
        self.data.clear()

    def stats(self):
        return {"num_pages": len(self.data), "bytes": sum(map(len, self.data.values()))}


def new_context(**extra):
    return cc.make_context("memory", {"name": cc.fresh_name(), **extra})


def test_a_correct_tier_passes_every_check():
    assert cc.run_all(MemoryTier, new_context) == list(cc.CHECKS)


def test_run_all_leaves_out_what_does_not_apply():
    ran = cc.run_all(MemoryTier, new_context, persistent=False, bounded=False, skip=["thread"])
    assert set(cc.CHECKS) - set(ran) == {"shared", "persistence", "size_bound", "thread"}
    with pytest.raises(ValueError, match="unknown checks"):
        cc.run_all(MemoryTier, new_context, skip=["nope"])


class CountsEveryKey(MemoryTier):
    def batch_exists(self, keys):
        return sum(k in self.data for k in keys)


class FlipsAByte(MemoryTier):
    def batch_get(self, keys):
        return [v if v is None else v[:-1] + bytes([v[-1] ^ 1]) for v in super().batch_get(keys)]


class ReturnsMemoryviews(MemoryTier):
    def batch_get(self, keys):
        return [v if v is None else memoryview(v) for v in super().batch_get(keys)]


class KeepsTheFirstValue(MemoryTier):
    def batch_set(self, keys, values):
        for key, value in zip(keys, values):
            self.data.setdefault(key, bytes(value))
        return [True] * len(keys)


class PrivateStorage(MemoryTier):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.data = OrderedDict()


class ClearDoesNothing(MemoryTier):
    def clear(self):
        pass


class StatsNotNumbers(MemoryTier):
    def stats(self):
        return {"state": "fine"}


class CloseRaises(MemoryTier):
    def close(self):
        raise OSError("socket already closed")


class EvictsNewestFirst(MemoryTier):
    def batch_set(self, keys, values):
        for key, value in zip(keys, values):
            while self.capacity and self.data and sum(map(len, self.data.values())) + len(value) > self.capacity:
                self.data.popitem(last=True)
            self.data[key] = bytes(value)
        return [True] * len(keys)


class ReadsDoNotCount(MemoryTier):
    def batch_get(self, keys):
        return [self.data.get(k) for k in keys]


class Unbounded(MemoryTier):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.capacity = 0


class OnlyItsOwnThread(MemoryTier):
    def batch_set(self, keys, values):
        if threading.get_ident() != self.owner:
            raise RuntimeError("called from another thread")
        return super().batch_set(keys, values)


class RefusesSomeWrites(MemoryTier):
    def batch_set(self, keys, values):
        ok = super().batch_set(keys, values)
        return [v and i % 3 != 2 for i, v in enumerate(ok)]


class NotATier:
    def __init__(self, ctx):
        pass

    def close(self):
        pass


@pytest.mark.parametrize(("broken", "check", "match"), [
    (CountsEveryKey, "exists_leading_run", "first missing"),
    (FlipsAByte, "round_trip", "differ"),
    (ReturnsMemoryviews, "round_trip", "bytes or None"),
    (KeepsTheFirstValue, "overwrite", "differ"),
    (PrivateStorage, "shared", "second instance"),
    (PrivateStorage, "persistence", "fresh instance"),
    (ClearDoesNothing, "clear", "after clear"),
    (StatsNotNumbers, "stats", "names to numbers"),
    (CloseRaises, "close", "socket already closed"),
    (EvictsNewestFirst, "size_bound", "read just before"),
    (ReadsDoNotCount, "size_bound", "read just before"),
    (Unbounded, "size_bound", "holds 6 pages"),
    (OnlyItsOwnThread, "thread", "another thread"),
    (RefusesSomeWrites, "round_trip", "refused keys at positions"),
    (NotATier, "round_trip", "must return a radixserve.hicache.CacheTier"),
])
def test_each_breach_fails_its_check(broken, check, match):
    with pytest.raises((AssertionError, OSError, RuntimeError), match=match):
        cc.CHECKS[check](broken, new_context)


def test_values_are_framed_pages_of_the_context():
    from radixserve.hicache import HEADER_BYTES, decode_page

    ctx = new_context()
    pages = cc.Pages(ctx)
    keys, values = pages.chain(3)
    assert len(set(keys)) == 3 and all(len(v) == ctx.page_bytes == HEADER_BYTES + cc.PAYLOAD_BYTES for v in values)
    payload = decode_page(ctx.model_key, keys[1], values[1], cc.PAYLOAD_BYTES, mac=cc.MAC_KEY)
    assert bytes(payload) == pages.payload(keys[1])
    assert pages.value(keys[0], 1) != values[0]

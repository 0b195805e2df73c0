"""Conformance suite for HiCache storage tiers: any ``CacheTier``, ours or a third party's.

A tier's test module gives two callables and runs the checks; each raises AssertionError
saying what went wrong::

    from radixserve.testing import cache_tier_conformance as cc

    def new_context(**extra):          # a context over fresh, empty storage
        return cc.make_context("my_tier", {"url": ..., **extra})

    def test_conformance():
        cc.run_all(my_factory, new_context, bounded=False)

``make(ctx) -> CacheTier`` is the tier's factory (what it registers). ``new_context(**extra)``
returns a :class:`~radixserve.hicache.CacheTierContext` over storage that no other
context shares (a fresh directory, a fresh key prefix, ...), with ``extra`` merged into
``ctx.extra_config``; calling ``make`` twice with the same context must give two
instances over the *same* storage (two servers sharing a tier, or one after a restart).

Every value is a real page framed by the core (:func:`radixserve.hicache.encode_page`)
under keys from :func:`radixserve.hicache.page_keys`, and what comes back must decode.

* :func:`check_round_trip`: ``batch_set`` then ``batch_get`` is byte-exact, in order;
  empty batches; result types and lengths;
* :func:`check_missing`: a key never set reads as ``None`` and does not exist;
* :func:`check_exists_leading_run`: ``batch_exists`` counts the leading run only;
* :func:`check_mixed_batches`: present and missing keys interleaved, re-setting present keys;
* :func:`check_overwrite`: setting a stored key again replaces its value;
* :func:`check_shared`: two live instances over one storage see each other's pages;
* :func:`check_persistence`: a page set and closed is read by a fresh instance (``reopen``);
* :func:`check_clear`: ``clear()`` drops everything and the tier stays usable;
* :func:`check_stats`: ``stats()`` is a dict of plain numbers;
* :func:`check_close`: ``close()`` returns without raising;
* :func:`check_size_bound`: with ``storage_size`` set, stored bytes stay within it and the
  least recently *used* pages go first (a page read recently survives);
* :func:`check_thread`: a tier built on one thread works from another (the core builds it
  at start-up and calls it from its storage worker).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from radixserve.hicache import (
    HEADER_BYTES,
    CacheTier,
    CacheTierContext,
    decode_page,
    encode_page,
    mac_key,
    model_key,
    page_keys,
)

Make = Callable[[CacheTierContext], CacheTier]
NewContext = Callable[..., CacheTierContext]

PAGE_SIZE = 4  # tokens per page in the contexts of :func:`make_context`
PAYLOAD_BYTES = 2048  # K/V bytes per page in those contexts
MAC_KEY = mac_key(b"conformance")  # the storage secret's MAC key the framed pages are written with


class ConformanceError(AssertionError):
    """A cache tier broke the storage-tier contract."""


def make_context(backend: str, extra_config: dict[str, Any] | None = None, *, page_size: int = PAGE_SIZE,
                 payload_bytes: int = PAYLOAD_BYTES, salt: str = "conformance") -> CacheTierContext:
    """A context as the core builds it for ``--hicache-storage-backend backend`` with
    ``--hicache-storage-backend-extra-config`` set to ``extra_config`` (JSON-able)."""
    import torch

    from radixserve.config import ServerArgs

    args = ServerArgs(enable_hierarchical_cache=True, hicache_storage_backend=backend, page_size=page_size,
                      hicache_storage_backend_extra_config=json.dumps(extra_config or {}))
    key = model_key(salt, dtype=torch.bfloat16, page_size=page_size, num_layers=2, num_kv_heads=1,
                    head_dim=64, extra=f"payload={payload_bytes}")
    return CacheTierContext(args=args, extra_config=args.hicache_extra_config(), model_key=key,
                            page_size=page_size, page_bytes=HEADER_BYTES + payload_bytes)


class Pages:
    """Framed pages of one context: ``pages.chain(n, seed)`` gives ``n`` keys chained over a
    token sequence and their values, ``pages.value(key, version)`` another value for a key."""

    def __init__(self, ctx: CacheTierContext) -> None:
        self.ctx = ctx
        self.payload_bytes = ctx.page_bytes - HEADER_BYTES
        if self.payload_bytes < 0:
            raise ConformanceError(f"ctx.page_bytes {ctx.page_bytes} is smaller than a page header")
        self.payloads: dict[str, bytes] = {}

    def payload(self, key: str, version: int = 0) -> bytes:
        seed = bytes.fromhex(key) + version.to_bytes(4, "little")
        out = bytearray()
        block = 0
        while len(out) < self.payload_bytes:
            out += hashlib.sha256(seed + block.to_bytes(8, "little")).digest()
            block += 1
        return bytes(out[:self.payload_bytes])

    def value(self, key: str, version: int = 0) -> bytes:
        return encode_page(self.ctx.model_key, key, self.payload(key, version), mac=MAC_KEY)

    def chain(self, n: int, seed: int = 0) -> tuple[list[str], list[bytes]]:
        ids = [(seed * 7919 + i) % 50_000 for i in range(n * self.ctx.page_size)]
        keys = page_keys(self.ctx.model_key, ids, self.ctx.page_size)
        return keys, [self.value(k) for k in keys]

    def check(self, key: str, got: Any, version: int = 0, what: str = "") -> None:
        if got is None:
            raise ConformanceError(f"{what}key {key[:12]}...: read None, expected its stored value")
        if not isinstance(got, bytes):
            raise ConformanceError(f"{what}batch_get must return bytes or None, got {type(got).__name__}")
        want = self.value(key, version)
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise ConformanceError(f"{what}key {key[:12]}...: read {len(got)} bytes that differ from the "
                                   f"{len(want)} bytes stored (first difference at byte {first})")
        decode_page(self.ctx.model_key, key, got, self.payload_bytes, mac=MAC_KEY)  # the core's own check


def _set(tier: CacheTier, keys: Sequence[str], values: Sequence[bytes], what: str = "") -> None:
    ok = tier.batch_set(list(keys), list(values))
    if not isinstance(ok, list) or len(ok) != len(keys):
        raise ConformanceError(f"{what}batch_set must return a list with one bool per key ({len(keys)}), got {ok!r}")
    if not all(v is True for v in ok):
        refused = [i for i, v in enumerate(ok) if v is not True]
        raise ConformanceError(f"{what}batch_set refused keys at positions {refused} of {len(keys)} (results {ok})")


def _get(tier: CacheTier, keys: Sequence[str], what: str = "") -> list[bytes | None]:
    got = tier.batch_get(list(keys))
    if not isinstance(got, list) or len(got) != len(keys):
        raise ConformanceError(f"{what}batch_get must return a list with one entry per key ({len(keys)}), "
                               f"got {type(got).__name__} of {len(got) if hasattr(got, '__len__') else '?'}")
    return got


def _exists(tier: CacheTier, keys: Sequence[str], what: str = "") -> int:
    n = tier.batch_exists(list(keys))
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(keys):
        raise ConformanceError(f"{what}batch_exists must return an int in [0, {len(keys)}], got {n!r}")
    return n


class _Open:
    """``with _Open(make, ctx) as tier``: the tier is closed on the way out."""

    def __init__(self, make: Make, ctx: CacheTierContext) -> None:
        self.tier = make(ctx)
        if not isinstance(self.tier, CacheTier):
            raise ConformanceError("the factory must return a radixserve.hicache.CacheTier, got "
                                   f"{type(self.tier).__name__}")

    def __enter__(self) -> CacheTier:
        return self.tier

    def __exit__(self, *exc) -> None:
        self.tier.close()


# ---------------------------------------------------------------------------- checks
def check_round_trip(make: Make, new_context: NewContext) -> None:
    ctx = new_context()
    pages = Pages(ctx)
    with _Open(make, ctx) as tier:
        if _exists(tier, []) != 0 or _get(tier, []) != [] or tier.batch_set([], []) != []:
            raise ConformanceError("empty batches must give 0, [] and []")
        keys, values = pages.chain(8)
        _set(tier, keys, values)
        for key, got in zip(keys, _get(tier, keys)):
            pages.check(key, got)
        if _exists(tier, keys) != len(keys):
            raise ConformanceError(f"batch_exists over {len(keys)} stored keys gave {_exists(tier, keys)}")
        # one key at a time, and a batch in another order
        pages.check(keys[5], _get(tier, [keys[5]])[0], what="single get: ")
        rev = keys[::-1]
        for key, got in zip(rev, _get(tier, rev)):
            pages.check(key, got, what="reversed batch: ")


def check_missing(make: Make, new_context: NewContext) -> None:
    ctx = new_context()
    pages = Pages(ctx)
    with _Open(make, ctx) as tier:
        keys, _ = pages.chain(3, seed=11)
        if _get(tier, keys) != [None, None, None]:
            raise ConformanceError("batch_get of keys never set must give None for each")
        if _exists(tier, keys) != 0:
            raise ConformanceError("batch_exists of keys never set must be 0")


def check_exists_leading_run(make: Make, new_context: NewContext) -> None:
    ctx = new_context()
    pages = Pages(ctx)
    with _Open(make, ctx) as tier:
        keys, values = pages.chain(6, seed=2)
        stored = [i for i in range(6) if i != 3]
        _set(tier, [keys[i] for i in stored], [values[i] for i in stored])
        n = _exists(tier, keys)
        if n != 3:
            raise ConformanceError(f"batch_exists must stop at the first missing key (index 3), got {n}")
        n = _exists(tier, [keys[3]] + keys[:3])
        if n != 0:
            raise ConformanceError(f"batch_exists with the first key missing must be 0, got {n}")
        n = _exists(tier, keys[4:] + keys[:3])
        if n != 5:
            raise ConformanceError(f"batch_exists over 5 stored keys (any order) must be 5, got {n}")


def check_mixed_batches(make: Make, new_context: NewContext) -> None:
    ctx = new_context()
    pages = Pages(ctx)
    with _Open(make, ctx) as tier:
        a_keys, a_vals = pages.chain(4, seed=3)
        b_keys, b_vals = pages.chain(4, seed=4)
        _set(tier, a_keys[:2], a_vals[:2])
        # re-set two stored keys along with new ones, two prefixes interleaved
        keys = [a_keys[0], b_keys[0], a_keys[1], b_keys[1], a_keys[2]]
        vals = [a_vals[0], b_vals[0], a_vals[1], b_vals[1], a_vals[2]]
        _set(tier, keys, vals, what="batch with stored and new keys: ")
        probe = [b_keys[2], a_keys[0], a_keys[3], b_keys[1], a_keys[2], b_keys[3]]
        got = _get(tier, probe)
        for i, (key, value) in enumerate(zip(probe, got)):
            if key in (b_keys[2], a_keys[3], b_keys[3]):
                if value is not None:
                    raise ConformanceError(f"mixed batch_get: position {i} was never set but read a value")
            else:
                pages.check(key, value, what=f"mixed batch_get position {i}: ")
        n = _exists(tier, [a_keys[0], b_keys[0], a_keys[1], b_keys[2], a_keys[2]])
        if n != 3:
            raise ConformanceError(f"mixed batch_exists: expected 3 (stored, stored, stored, missing, stored), got {n}")


def check_overwrite(make: Make, new_context: NewContext) -> None:
    ctx = new_context()
    pages = Pages(ctx)
    with _Open(make, ctx) as tier:
        keys, values = pages.chain(2, seed=5)
        _set(tier, keys, values)
        before = tier.stats()
        _set(tier, [keys[0]], [pages.value(keys[0], version=1)], what="overwrite: ")
        pages.check(keys[0], _get(tier, [keys[0]])[0], version=1, what="after overwrite: ")
        pages.check(keys[1], _get(tier, [keys[1]])[0], what="neighbour of an overwritten key: ")
        _set(tier, [keys[0]], [pages.value(keys[0], version=1)], what="the same value again: ")
        after = tier.stats()
        for name in ("num_pages", "bytes"):
            if name in before and name in after and after[name] != before[name]:
                raise ConformanceError(f"stats()[{name!r}] went from {before[name]} to {after[name]} by "
                                       "overwriting keys with values of the same size")


def check_shared(make: Make, new_context: NewContext) -> None:
    ctx = new_context()
    pages = Pages(ctx)
    with _Open(make, ctx) as a, _Open(make, ctx) as b:
        keys, values = pages.chain(4, seed=6)
        _set(a, keys[:2], values[:2])
        if _exists(b, keys) != 2:
            raise ConformanceError("a second instance over the same storage must see the first one's pages")
        for key, got in zip(keys[:2], _get(b, keys[:2])):
            pages.check(key, got, what="second instance: ")
        _set(b, keys[2:], values[2:])
        for key, got in zip(keys, _get(a, keys)):
            pages.check(key, got, what="first instance, pages of the second: ")


def check_persistence(make: Make, new_context: NewContext, reopen: Make | None = None) -> None:
    ctx = new_context()
    pages = Pages(ctx)
    keys, values = pages.chain(5, seed=7)
    with _Open(make, ctx) as tier:
        _set(tier, keys, values)
    with _Open(reopen or make, ctx) as tier:
        if _exists(tier, keys) != len(keys):
            raise ConformanceError("pages set before close() must exist in a fresh instance over the same storage")
        for key, got in zip(keys, _get(tier, keys)):
            pages.check(key, got, what="after reopening: ")


def check_clear(make: Make, new_context: NewContext) -> None:
    ctx = new_context()
    pages = Pages(ctx)
    with _Open(make, ctx) as tier:
        keys, values = pages.chain(4, seed=8)
        _set(tier, keys, values)
        tier.clear()
        if _exists(tier, keys) != 0 or _get(tier, keys) != [None] * 4:
            raise ConformanceError("after clear() no page may exist or be read")
        stats = tier.stats()
        for name in ("num_pages", "bytes"):
            if stats.get(name, 0) != 0:
                raise ConformanceError(f"after clear() stats()[{name!r}] must be 0, got {stats[name]}")
        _set(tier, keys[:1], values[:1], what="after clear(): ")
        pages.check(keys[0], _get(tier, keys[:1])[0], what="after clear(): ")


def check_stats(make: Make, new_context: NewContext) -> None:
    ctx = new_context()
    pages = Pages(ctx)
    with _Open(make, ctx) as tier:
        keys, values = pages.chain(2, seed=9)
        _set(tier, keys, values)
        _get(tier, keys)
        stats = tier.stats()
        if not isinstance(stats, dict):
            raise ConformanceError(f"stats() must return a dict, got {type(stats).__name__}")
        for name, value in stats.items():
            if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConformanceError(f"stats() must map names to numbers, got {name!r}: {value!r}")
        if "num_pages" in stats and stats["num_pages"] < 2:
            raise ConformanceError(f"stats()['num_pages'] is {stats['num_pages']} with 2 pages stored")
        if "bytes" in stats and stats["bytes"] < sum(map(len, values)):
            raise ConformanceError(f"stats()['bytes'] is {stats['bytes']} with {sum(map(len, values))} bytes stored")


def check_close(make: Make, new_context: NewContext) -> None:
    ctx = new_context()
    pages = Pages(ctx)
    tier = make(ctx)
    keys, values = pages.chain(1, seed=10)
    _set(tier, keys, values)
    tier.close()


def check_size_bound(make: Make, new_context: NewContext, num_pages: int = 4) -> None:
    """``storage_size`` of ``num_pages`` pages: writing more keeps the stored bytes within
    it, drops the least recently used page first and keeps a page that was read recently."""
    probe_ctx = new_context()
    bound = num_pages * probe_ctx.page_bytes
    ctx = new_context(storage_size=bound)
    pages = Pages(ctx)
    with _Open(make, ctx) as tier:
        keys, values = pages.chain(num_pages + 3, seed=12)
        for i in range(num_pages):  # one at a time: k0 is the oldest
            _set(tier, [keys[i]], [values[i]], what=f"filling to the bound, page {i}: ")
        pages.check(keys[0], _get(tier, [keys[0]])[0], what="reading the oldest page: ")  # k0 is now the newest
        _set(tier, keys[num_pages:num_pages + 2], values[num_pages:num_pages + 2], what="past the bound: ")
        present = [k for k in keys if _exists(tier, [k]) == 1]
        if len(present) > num_pages:
            raise ConformanceError(f"storage_size of {num_pages} pages ({bound} bytes) holds {len(present)} pages")
        stats = tier.stats()
        if "bytes" in stats and stats["bytes"] > bound:
            raise ConformanceError(f"stats()['bytes'] is {stats['bytes']}, over storage_size {bound}")
        if _exists(tier, [keys[0]]) != 1:
            raise ConformanceError("the page read just before the tier filled up was dropped: eviction must be "
                                   "least recently used, and a read counts as a use")
        if _exists(tier, [keys[1]]) != 0:
            raise ConformanceError("the least recently used page (written first, never read) survived while "
                                   "the tier made room")
        for i in (num_pages, num_pages + 1):
            pages.check(keys[i], _get(tier, [keys[i]])[0], what="the newest pages: ")


def check_thread(make: Make, new_context: NewContext) -> None:
    ctx = new_context()
    pages = Pages(ctx)
    errors: list[BaseException] = []
    with _Open(make, ctx) as tier:
        keys, values = pages.chain(3, seed=13)

        def work() -> None:
            try:
                _set(tier, keys, values, what="from a worker thread: ")
                if _exists(tier, keys) != 3:
                    raise ConformanceError("from a worker thread: batch_exists does not see the pages just set")
                for key, got in zip(keys, _get(tier, keys)):
                    pages.check(key, got, what="from a worker thread: ")
            except BaseException as e:  # handed to the main thread
                errors.append(e)

        worker = threading.Thread(target=work, name="cache-tier-conformance", daemon=True)
        worker.start()
        worker.join(timeout=60)
        if worker.is_alive():
            raise ConformanceError("calls from a worker thread did not return within 60 s")
        if errors:
            raise errors[0]
        for key, got in zip(keys, _get(tier, keys)):  # and back on the thread that built it
            pages.check(key, got, what="main thread after the worker: ")


CHECKS: dict[str, Callable[..., None]] = {
    "round_trip": check_round_trip,
    "missing": check_missing,
    "exists_leading_run": check_exists_leading_run,
    "mixed_batches": check_mixed_batches,
    "overwrite": check_overwrite,
    "shared": check_shared,
    "persistence": check_persistence,
    "clear": check_clear,
    "stats": check_stats,
    "close": check_close,
    "size_bound": check_size_bound,
    "thread": check_thread,
}


def run_all(make: Make, new_context: NewContext, *, reopen: Make | None = None, persistent: bool = True,
            bounded: bool = True, skip: Sequence[str] = ()) -> list[str]:
    """Every check; returns the names run. ``persistent=False`` skips
    :func:`check_shared` and :func:`check_persistence` (a tier private to one instance);
    ``bounded=False`` skips :func:`check_size_bound` (a tier without ``storage_size``, whose
    bound lives elsewhere). ``reopen`` builds the instance that reads after a restart
    (default ``make``)."""
    unknown = set(skip) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks to skip: {sorted(unknown)}; the checks are {sorted(CHECKS)}")
    ran = []
    for name, check in CHECKS.items():
        if (name in skip or (not persistent and name in ("shared", "persistence"))
                or (not bounded and name == "size_bound")):
            continue
        if name == "persistence":
            check(make, new_context, reopen=reopen)
        else:
            check(make, new_context)
        ran.append(name)
    return ran


def fresh_name(prefix: str = "rx") -> str:
    """A name no other context uses (a key prefix, a directory name)."""
    return f"{prefix}-{os.getpid()}-{os.urandom(6).hex()}"

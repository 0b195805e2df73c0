"""HiCache: the hierarchical prefix cache (device -> host memory -> storage tier).

Unit tests drive :class:`HiRadixCache` over real KV and host pools without a model
(demotion, load-back byte for byte, write policies, host eviction, splits); engine tests on
a tiny random-weight Llama check that a device pool far smaller than the working set gives
the large pool's greedy tokens while computing fewer prefill tokens, for every write
policy and I/O backend, under retraction and aborts, and that the storage tier (an
in-memory tier registered here; the file and Redis tiers have their own engine tests)
serves a restarted engine, rejects corrupted, foreign or forged pages, degrades when it fails,
and honours each prefetch policy. Every engine is checked for the idle invariant, which
covers the host tier's pages.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import radixserve
import torch
from engine_checks import wait_until_idle
from radixserve.config import ConfigError
from radixserve.engine.request import Req
from radixserve.hicache import (
    HEADER_BYTES,
    CacheTier,
    PageFormatError,
    decode_page,
    encode_page,
    mac_key,
    model_key,
    page_keys,
)
from radixserve.hicache.hiradix_cache import HiRadixCache
from radixserve.hicache.host_pool import HostKVPool
from radixserve.hookspecs import hookimpl
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool, page_slots
from radixserve.registry import Registry
from radixserve.sampling import SamplingParams
from tiny_models import VOCAB, build_checkpoint

PAGE = 4
NEW_TOKENS = 6
PARAMS = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


# ------------------------------------------------------------------ unit: the tree
def make_cache(num_pages=16, host_pages=32, policy="write_through", io="kernel"):
    kv = KVPool(num_layers=2, num_pages=num_pages + 1, page_size=PAGE, num_kv_heads=2, head_dim=3,
                dtype=torch.float32, device="cpu")
    kv.buffer.copy_(torch.randn_like(kv.buffer))
    host = HostKVPool(kv, host_pages, io)
    return HiRadixCache(kv, ReqToTokenPool(4, 64, "cpu"), host, write_policy=policy)


def kv_of(cache, pages):
    return cache.kv_pool.buffer[:, :, page_slots(pages, PAGE)].clone()


def insert_seq(cache, ids):
    pages = cache.allocator.allocate(len(ids) // PAGE)
    cache.kv_pool.buffer[:, :, page_slots(pages, PAGE)] = torch.randn(2, 2, len(pages) * PAGE, 2, 3)
    snapshot = kv_of(cache, pages)
    assert cache.insert(ids, pages) == 0
    return pages, snapshot


@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_eviction_demotes_to_host_and_load_back_restores_the_bytes(io):
    cache = make_cache(io=io)
    ids = list(range(100, 100 + 3 * PAGE))
    _, snapshot = insert_seq(cache, ids)
    cache._wait_io()
    assert cache.evict(3) == 3
    assert cache.allocator.num_free_pages == cache.allocator.num_usable_pages  # device empty
    m = cache.match_prefix(ids)
    assert m.num_tokens == 0 and m.lower_tokens == 3 * PAGE  # still cached: on the host
    cache.kv_pool.buffer[:, :, PAGE:].zero_()  # the device pages are gone for good
    m = cache.load_back(m)
    cache.ready_for_forward()
    cache.on_admit(None, m)
    assert m.num_tokens == 3 * PAGE and m.lower_tokens == 0 and len(m.pages) == 3 and m.loaded_tokens == 3 * PAGE
    assert torch.equal(kv_of(cache, m.pages), snapshot)
    assert cache.stats()["hicache_host_hit_tokens"] == 3 * PAGE
    assert cache.invariant_problems() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host pages and the copy stream")
@pytest.mark.parametrize("io", ["kernel", "direct"])
def test_cuda_device_pool_round_trips_through_pinned_host_pages(io):
    kv = KVPool(num_layers=3, num_pages=9, page_size=PAGE, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                device="cuda")
    kv.buffer.copy_(torch.randn_like(kv.buffer))
    host = HostKVPool(kv, 8, io)
    assert host.buffer.is_pinned()
    src, dst = [3, 1, 7], [5, 2, 8]
    before = kv.buffer[:, :, page_slots(src, PAGE, "cuda")].clone()
    host.backup(src, [1, 2, 3])
    host.load([1, 2, 3], dst)
    torch.cuda.synchronize()
    assert torch.equal(kv.buffer[:, :, page_slots(dst, PAGE, "cuda")], before)


def test_without_a_host_copy_eviction_drops_and_write_back_copies_first():
    for policy, kept in (("write_through_selective", False), ("write_back", True)):
        cache = make_cache(policy=policy)
        ids = list(range(7, 7 + 2 * PAGE))
        _, snapshot = insert_seq(cache, ids)
        assert cache.stats()["hicache_host_used_pages"] == 0  # neither copies at insert
        cache.evict(2)
        m = cache.match_prefix(ids)
        assert m.lower_tokens == (2 * PAGE if kept else 0), policy
        if kept:
            m = cache.load_back(m)
            cache.ready_for_forward()
            assert torch.equal(kv_of(cache, m.pages), snapshot)
        assert cache.invariant_problems() == []


def test_write_through_selective_copies_a_node_once_it_is_reused():
    cache = make_cache(policy="write_through_selective")
    ids = list(range(50, 50 + 2 * PAGE))
    insert_seq(cache, ids)
    for _ in range(2):  # admissions that reuse the prefix
        m = cache.load_back(cache.match_prefix(ids))
        assert m.num_tokens == 2 * PAGE
        cache._wait_io()
        assert cache.stats()["hicache_host_backup_pages"] == 0  # looking is not reusing
        cache.on_admit(None, m)
    cache._wait_io()
    assert cache.stats()["hicache_host_backup_pages"] == 2
    cache.evict(2)
    assert cache.match_prefix(ids).lower_tokens == 2 * PAGE


def test_a_full_host_pool_drops_its_least_recently_used_host_only_leaves():
    cache = make_cache(num_pages=8, host_pages=4)
    a, b, c = ([i] * (2 * PAGE) for i in (11, 12, 13))
    insert_seq(cache, a)
    insert_seq(cache, b)
    cache.evict(4)  # a and b on the host only; host full
    cache.match_prefix(b)  # b used more recently than a
    insert_seq(cache, c)  # write-through of c needs 2 host pages: a goes
    assert cache.match_prefix(a).lower_tokens == 0
    assert cache.match_prefix(b).lower_tokens == 2 * PAGE
    assert cache.invariant_problems() == []


def test_inserting_over_a_host_only_node_adopts_the_new_device_pages():
    cache = make_cache()
    ids = list(range(30, 30 + 3 * PAGE))
    insert_seq(cache, ids)
    cache.evict(3)
    pages = cache.allocator.allocate(3)
    assert cache.insert(ids, pages) == 0  # nothing was on the device: the tree takes all three
    m = cache.match_prefix(ids)
    assert m.pages == pages and m.lower_tokens == 0
    assert cache.total_pages == 3 and cache.evictable_pages == 3
    assert cache.invariant_problems() == []


def test_a_split_keeps_host_pages_and_content_keys_with_their_tokens():
    cache = make_cache()
    stored = []
    cache.storage = SimpleNamespace(salt="ab" * 32, store=lambda keys, payloads: stored.append((keys, payloads)))
    ids = list(range(60, 60 + 4 * PAGE))
    insert_seq(cache, ids)
    cache._wait_io()
    cache.storage = None
    assert len(stored) == 1 and len(stored[0][1]) == 4  # written through to storage, page by page
    assert stored[0][1][0] == cache.host.payload(cache.match_prefix(ids).node.host_pages[0])
    full = cache.match_prefix(ids).node
    keys, host = list(full.hashes), list(full.host_pages)
    cache.match_prefix(ids[:2 * PAGE] + [0] * PAGE)  # splits the node after two pages
    top = cache.match_prefix(ids[:2 * PAGE]).node
    assert top.hashes == keys[:2] and top.host_pages == host[:2]
    assert next(iter(top.children.values())).hashes == keys[2:]
    assert keys == page_keys("ab" * 32, ids, PAGE)


# ------------------------------------------------------------- unit: keys and framing
def test_page_keys_chain_over_the_whole_prefix_and_the_model():
    salt, other = model_key("f1", dtype=torch.float32, page_size=4, num_layers=2, num_kv_heads=2, head_dim=3), \
        model_key("f2", dtype=torch.float32, page_size=4, num_layers=2, num_kv_heads=2, head_dim=3)
    a = page_keys(salt, list(range(12)), 4)
    assert len(a) == 3 and len(set(a)) == 3
    assert page_keys(salt, [9] + list(range(1, 12)), 4)[1:] != a[1:]  # a later page depends on earlier ones
    assert page_keys(salt, list(range(4, 12)), 4, prev=a[0]) == a[1:]  # chains continue
    assert page_keys(other, list(range(12)), 4) != a  # another model never shares a key
    assert model_key("f1", dtype=torch.bfloat16, page_size=4, num_layers=2, num_kv_heads=2, head_dim=3) != salt


def test_framed_pages_reject_corruption_truncation_and_foreign_values():
    salt, key, mac = "11" * 32, "22" * 32, mac_key(b"the server's secret")
    payload = bytes(range(256)) * 4
    value = encode_page(salt, key, payload, mac=mac)
    assert bytes(decode_page(salt, key, value, len(payload), mac=mac)) == payload
    flipped = bytearray(value)
    flipped[-7] ^= 1
    for bad, why in ((bytes(flipped), "MAC mismatch"), (value[:-10], "truncated"), (value[:20], "truncated"),
                     (encode_page("33" * 32, key, payload, mac=mac), "another model"),
                     (encode_page(salt, "44" * 32, payload, mac=mac), "another key"),
                     (b"JUNK" + value[4:], "magic")):
        with pytest.raises(PageFormatError, match=why):
            decode_page(salt, key, bad, len(payload), mac=mac)


def test_a_page_written_without_the_secret_is_refused():
    salt, key, mac = "11" * 32, "22" * 32, mac_key(b"the server's secret")
    payload = bytes(range(256)) * 4
    for forged in (encode_page(salt, key, payload, mac=mac_key(b"a guess")), unkeyed_forgery(salt, key, payload)):
        assert len(forged) == len(encode_page(salt, key, payload, mac=mac))
        with pytest.raises(PageFormatError, match="MAC mismatch"):
            decode_page(salt, key, forged, len(payload), mac=mac)
    value = encode_page(salt, key, payload, mac=mac)  # the MAC covers the header too
    with pytest.raises(PageFormatError, match="MAC mismatch"):
        decode_page(salt, key, value[:HEADER_BYTES] + payload[::-1], len(payload), mac=mac)
    assert mac_key(b"x" * 200) != mac_key(b"x" * 199) and len(mac_key(b"")) == 32


def unkeyed_forgery(salt: str, key: str, payload: bytes) -> bytes:
    """A page in the current format whose MAC field holds an unkeyed hash of the header and
    payload (what anyone can compute without the secret)."""
    import hashlib
    import struct

    head = struct.pack("<4sH32s32sQ", b"RXKV", 2, bytes.fromhex(salt), bytes.fromhex(key), len(payload))
    return head + hashlib.blake2b(head + payload, digest_size=32).digest() + payload


# ------------------------------------------------------------------ engines
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hicache_llama"))
    build_checkpoint(path, "llama", seed=5, max_position_embeddings=512)
    return path


def conversations(turns=3, num=4, seed=0):
    """``turns`` rounds of ``num`` prompts: each round extends every conversation's previous
    prompt by ~24 new tokens, so a conversation's history is a long cached prefix."""
    g = torch.Generator().manual_seed(seed)
    convs = [torch.randint(3, VOCAB, (40,), generator=g).tolist() for _ in range(num)]
    rounds = []
    for _ in range(turns):
        convs = [c + torch.randint(3, VOCAB, (24,), generator=g).tolist() for c in convs]
        rounds.append([list(c) for c in convs])
    return rounds


@contextlib.contextmanager
def engine_for(path, **kw):
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("page_size", PAGE)
    engine = radixserve.Engine(path, dtype="float32", enable_leak_check=True, **kw)
    try:
        yield engine
        wait_until_idle(engine)
    finally:
        engine.shutdown()


def run_rounds(engine, rounds):
    outs = []
    for prompts in rounds:
        outs.extend(o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=PARAMS))
    return outs


@pytest.fixture(scope="module")
def reference(tiny_path):
    with engine_for(tiny_path) as engine:
        return run_rounds(engine, conversations())


# 4 conversations of up to 112 tokens each: 448 tokens; the device pool holds 128 (+ the
# running batch's pages), so every conversation's history is evicted between its turns.
SMALL = 160


@pytest.mark.parametrize("io", ["kernel", "direct"])
@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_a_small_device_pool_gives_the_large_pools_tokens_with_fewer_prefill_tokens(tiny_path, reference,
                                                                                      policy, io):
    # separate prefill steps: the token accounting below compares whole-prompt prefills (with
    # budgeted mixed chunks in a pool this small, a retracted chunk is computed twice)
    with engine_for(tiny_path, max_total_tokens=SMALL, disable_mixed_chunk=True) as plain:
        assert run_rounds(plain, conversations()) == reference
        plain_prefill = plain.get_stats()["num_prefill_tokens"]
        plain_cached = plain.get_stats()["num_cached_prompt_tokens"]
    with engine_for(tiny_path, max_total_tokens=SMALL, enable_hierarchical_cache=True, hicache_ratio=8,
                    hicache_write_policy=policy, hicache_io_backend=io, disable_mixed_chunk=True) as hi:
        assert run_rounds(hi, conversations()) == reference
        stats = hi.get_stats()
    if policy == "write_through_selective":  # nothing is reused twice here: it behaves like the plain cache
        assert stats["num_prefill_tokens"] <= plain_prefill
        return
    assert stats["hicache_host_hit_tokens"] > 0 and stats["hicache_demoted_pages"] > 0
    # every prompt token is computed or served from a tier: what the host served is not recomputed
    assert stats["num_prefill_tokens"] < plain_prefill
    assert plain_prefill - stats["num_prefill_tokens"] == stats["num_cached_prompt_tokens"] - plain_cached
    # pages come back from the host only for a request that is admitted in the same step:
    # every page loaded is a page hit (none copied for a request that then did not fit)
    page_bytes = hi.scheduler.cache.host.page_bytes
    assert stats["hicache_host_load_bytes"] == stats["hicache_host_hit_tokens"] // PAGE * page_bytes


def test_cached_tokens_count_tokens_served_from_the_host(tiny_path):
    rounds = conversations(turns=2)
    with engine_for(tiny_path, max_total_tokens=SMALL, enable_hierarchical_cache=True, hicache_ratio=8) as hi:
        run_rounds(hi, rounds[:1])
        outs = hi.generate(input_ids=rounds[1], sampling_params=PARAMS)
        cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
        stats = hi.get_stats()
        assert cached > 0 and stats["hicache_host_hit_tokens"] > 0
        assert stats["num_cached_prompt_tokens"] == cached


def test_the_io_thread_gives_its_openmp_workers_back_after_each_copy(tiny_path, monkeypatch):
    """Copies run parallel torch ops on HiCache's io thread; that thread then releases its
    OpenMP workers, so the scheduler's thread keeps the only pool (radixserve.kernels.cpu)."""
    from radixserve.kernels import cpu as cpu_kernels

    released = []
    monkeypatch.setattr(cpu_kernels, "release_thread_pool",
                        lambda: released.append(threading.current_thread().name) or True)
    with engine_for(tiny_path, max_total_tokens=SMALL, enable_hierarchical_cache=True, hicache_ratio=8) as hi:
        run_rounds(hi, conversations(turns=2))
        assert hi.get_stats()["hicache_demoted_pages"] > 0
    io_releases = [n for n in released if n.startswith("radixserve-hicache-io")]
    assert io_releases


def test_retraction_and_aborts_keep_every_tier_accounted(tiny_path, reference, monkeypatch):
    import radixserve.engine.scheduler.kv as sched_mod

    monkeypatch.setattr(sched_mod, "INIT_NEW_TOKEN_RATIO", 0.0)  # decode outgrows the pool: retract
    monkeypatch.setattr(sched_mod, "MIN_NEW_TOKEN_RATIO", 0.0)
    rounds = conversations()
    long_params = {**PARAMS, "max_new_tokens": 24}
    with engine_for(tiny_path, max_total_tokens=SMALL + 64, enable_hierarchical_cache=True, hicache_ratio=4) as hi:
        for prompts in rounds:
            hi.generate(input_ids=prompts, sampling_params=long_params)
        assert hi.scheduler.stats.num_retractions > 0
        sched = hi.scheduler
        reqs = [Req(f"a{i}", p, SamplingParams(**long_params), 0) for i, p in enumerate(rounds[-1])]
        for r in reqs:
            sched.add_request(r)
        sched.step()  # admitted, partly loaded back from the host
        for r in reqs[::2]:
            sched.abort(r.rid)
        while sched.has_work:
            sched.step()
        assert sched.cache.invariant_problems() == []


def _burst(engine, prompts, max_new):
    """Queue ``prompts`` at once in the scheduler (no thread) and run them to the end.
    Returns the requests and the order of events: ("first", i) when request i streams its
    first token, ("done", i) when it finishes."""
    sched, events, reqs = engine.scheduler, [], []
    for i, ids in enumerate(prompts):
        seqs, params, _ = engine.normalize(None, ids, dict(PARAMS, max_new_tokens=max_new))
        (req,), = engine.make_requests(seqs, params, rids=[f"b{i}"], priorities=[None])

        def on_output(r, num_new, finished, i=i):
            if num_new and len(r.output_ids) == num_new:
                events.append(("first", i))
            if finished:
                events.append(("done", i))
        req.on_output = on_output
        sched.add_request(req)
        reqs.append(req)
    while sched.has_work:
        sched.step()
    return reqs, events


# three 40-token prompts; the pool (64 tokens) holds one of them with its answer at a time
BURST_POOL = 64


@pytest.mark.parametrize("pause", [True, False])
def test_a_burst_gets_its_first_tokens_before_the_answers_when_decoding_pauses_to_the_host(tiny_path, pause):
    prompts = [list(range(3 + 40 * i, 43 + 40 * i)) for i in range(3)]
    with engine_for(tiny_path) as big:
        reference = [o["output_ids"] for o in big.generate(input_ids=prompts,
                                                          sampling_params=dict(PARAMS, max_new_tokens=16))]
    with engine_for(tiny_path, max_total_tokens=BURST_POOL, enable_hierarchical_cache=True, hicache_ratio=8,
                    disable_hicache_first_token_preemption=not pause) as hi:
        reqs, events = _burst(hi, prompts, 16)
        stats = hi.scheduler.get_stats()
    assert [r.output_ids for r in reqs] == reference
    firsts = [events.index(("first", i)) for i in range(3)]
    done = [events.index(("done", i)) for i in range(3)]
    if pause:
        # every request streams its first token before any answer is finished; the two
        # requests paused for a newcomer (once each) resumed from the host
        assert max(firsts) < min(done)
        assert stats["num_preemptions"] == 2 and sorted(r.num_preemptions for r in reqs) == [0, 1, 1]
        assert stats["hicache_host_num_loads"] >= 2 and stats["num_retractions"] == 0
    else:  # one at a time: a request starts once the one before it has finished
        assert firsts[1] > done[0] and firsts[2] > done[1]
        assert stats["num_preemptions"] == 0


def test_pausing_stops_once_the_paused_requests_fill_the_host_tier(tiny_path):
    """Paused requests wait on the host; once those waiting hold as many tokens as the host
    tier (here 40: one paused 41-token request), newcomers wait their turn instead."""
    prompts = [list(range(3 + 40 * i, 43 + 40 * i)) for i in range(3)]
    with engine_for(tiny_path, max_total_tokens=BURST_POOL, enable_hierarchical_cache=True,
                    hicache_ratio=0.625) as hi:
        assert hi.scheduler.cache.host_capacity_tokens == 40
        reqs, events = _burst(hi, prompts, 16)
        assert hi.scheduler.get_stats()["num_preemptions"] == 1
    assert events.index(("first", 1)) < events.index(("done", 0))  # request 0 paused for request 1
    assert events.index(("first", 2)) > min(events.index(("done", 0)), events.index(("done", 1)))


def test_requests_about_to_finish_are_not_paused(tiny_path):
    """A decoding request with fewer than FIRST_TOKEN_PREEMPT_MIN_LEFT tokens of its budget
    left is not paused for a newcomer (copying it back would cost more than waiting)."""
    from radixserve.engine.scheduler.preemption import FIRST_TOKEN_PREEMPT_MIN_LEFT

    prompts = [list(range(3 + 40 * i, 43 + 40 * i)) for i in range(2)]
    with engine_for(tiny_path, max_total_tokens=BURST_POOL, enable_hierarchical_cache=True, hicache_ratio=8) as hi:
        reqs, events = _burst(hi, prompts, FIRST_TOKEN_PREEMPT_MIN_LEFT)
        assert hi.scheduler.get_stats()["num_preemptions"] == 0
    assert events.index(("first", 1)) > events.index(("done", 0))
    assert all(len(r.output_ids) == FIRST_TOKEN_PREEMPT_MIN_LEFT for r in reqs)


# ------------------------------------------------------------ storage tier (in memory)
STORES: dict[str, OrderedDict] = {}


class MemoryTier(CacheTier):
    """A storage tier over a process-wide dict (a "server" that outlives engines). Knobs in
    the extra config: ``gate`` (a threading.Event name: reads wait for it), ``fail`` (every
    call raises), ``corrupt`` (values come back with a flipped byte), ``forge`` (values come
    back with their K/V negated and re-framed without the server's secret: ``other_secret``
    under a guessed one, ``unkeyed`` with an unkeyed hash)."""

    gates: dict[str, threading.Event] = {}

    def __init__(self, ctx):
        self.cfg, self.salt = ctx.extra_config, ctx.model_key
        self.data = STORES.setdefault(self.cfg["name"], OrderedDict())

    def _check(self):
        if self.cfg.get("fail"):
            raise ConnectionError("the storage server went away")

    def batch_exists(self, keys):
        self._check()
        for n, k in enumerate(keys):
            if k not in self.data:
                return n
        return len(keys)

    def batch_get(self, keys):
        self._check()
        gate = self.cfg.get("gate")
        if gate:
            assert MemoryTier.gates[gate].wait(30)
        out = [self.data.get(k) for k in keys]
        if self.cfg.get("corrupt"):
            out = [None if v is None else v[:-1] + bytes([v[-1] ^ 0xFF]) for v in out]
        if self.cfg.get("forge"):
            out = [None if v is None else self._forged(k, v) for k, v in zip(keys, out)]
        return out

    def _forged(self, key, value):
        payload = torch.frombuffer(bytearray(value[HEADER_BYTES:]), dtype=torch.float32).neg().numpy().tobytes()
        if self.cfg["forge"] == "unkeyed":
            return unkeyed_forgery(self.salt, key, payload)
        return encode_page(self.salt, key, payload, mac=mac_key(b"a guess at the server's secret"))

    def batch_set(self, keys, values):
        self._check()
        for k, v in zip(keys, values):
            self.data[k] = bytes(v)
        return [True] * len(keys)


class MemoryTierPlugin:
    @staticmethod
    @hookimpl
    def register_cache_tiers(register):
        register("memory", MemoryTier, description="in-memory test tier")


@pytest.fixture(scope="module")
def registry():
    reg = Registry()
    reg.load_entry_points()
    reg.add_plugin(MemoryTierPlugin, name="memory-tier", distribution="tests")
    return reg


def storage_engine(path, registry, name, policy="wait_complete", **extra):
    return engine_for(path, registry=registry, max_total_tokens=SMALL, enable_hierarchical_cache=True,
                      hicache_ratio=4, hicache_storage_backend="memory", hicache_storage_prefetch_policy=policy,
                      hicache_storage_backend_extra_config={"name": name, **extra})


def test_a_restarted_engine_is_served_from_storage(tiny_path, reference, registry):
    rounds = conversations()
    with storage_engine(tiny_path, registry, "restart") as first:
        assert run_rounds(first, rounds) == reference
        assert first.get_stats()["hicache_storage_store_pages"] > 0
    with storage_engine(tiny_path, registry, "restart") as second:
        outs = second.generate(input_ids=rounds[-1], sampling_params=PARAMS)
        stats = second.get_stats()
    assert [o["output_ids"] for o in outs] == reference[-len(rounds[-1]):]
    assert stats["hicache_storage_hit_tokens"] > 0
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs)
    assert stats["num_prefill_tokens"] < sum(len(p) for p in rounds[-1]) / 2


def test_another_models_pages_are_never_used(tiny_path, tmp_path, reference, registry):
    other = str(tmp_path / "other")
    build_checkpoint(other, "llama", seed=6, max_position_embeddings=512)  # same shapes, other weights
    rounds = conversations()
    with storage_engine(other, registry, "shared-by-two-models") as first:
        run_rounds(first, rounds)
    with storage_engine(tiny_path, registry, "shared-by-two-models") as second:
        assert run_rounds(second, rounds) == reference
        assert second.get_stats()["hicache_storage_hit_tokens"] == 0


def test_corrupted_pages_are_detected_and_recomputed(tiny_path, reference, registry, caplog):
    rounds = conversations()
    with storage_engine(tiny_path, registry, "corrupt"):
        pass
    with storage_engine(tiny_path, registry, "corrupt") as first:
        run_rounds(first, rounds)
    with caplog.at_level(logging.WARNING), storage_engine(tiny_path, registry, "corrupt", corrupt=True) as second:
        outs = second.generate(input_ids=rounds[-1], sampling_params=PARAMS)
        stats = second.get_stats()
    assert [o["output_ids"] for o in outs] == reference[-len(rounds[-1]):]
    assert stats["hicache_storage_hit_tokens"] == 0 and stats["hicache_storage_errors"] > 0
    assert "MAC mismatch" in caplog.text


@pytest.mark.parametrize("forge", ["other_secret", "unkeyed"])
def test_forged_pages_are_refused_counted_and_recomputed(tiny_path, reference, registry, caplog, forge):
    rounds = conversations()
    name = f"forged-{forge}"
    with storage_engine(tiny_path, registry, name) as first:
        run_rounds(first, rounds)
        assert first.get_stats()["hicache_storage_store_pages"] > 0
    with caplog.at_level(logging.WARNING), storage_engine(tiny_path, registry, name, forge=forge) as second:
        outs = second.generate(input_ids=rounds[-1], sampling_params=PARAMS)
        stats = second.get_stats()
    assert [o["output_ids"] for o in outs] == reference[-len(rounds[-1]):]  # as without a cache
    assert stats["hicache_storage_hit_tokens"] == 0 and stats["hicache_storage_errors"] > 0
    assert "MAC mismatch" in caplog.text


def test_a_storage_tier_that_fails_degrades_to_recomputation(tiny_path, reference, registry, caplog):
    with caplog.at_level(logging.WARNING), storage_engine(tiny_path, registry, "down", fail=True) as engine:
        assert run_rounds(engine, conversations()) == reference
        stats = engine.get_stats()
    assert stats["hicache_storage_errors"] > 0 and stats["hicache_host_hit_tokens"] > 0
    assert "went away" in caplog.text


def _served_while_a_read_is_held(engine, gate, prompt, waits: bool) -> dict:
    """Generate ``prompt`` while the storage tier holds its reads until ``gate`` is set:
    ``waits`` says whether admission must hold the request back for the read."""
    done = threading.Event()
    result = {}

    def go():
        result["out"] = engine.generate(input_ids=prompt, sampling_params=PARAMS)
        done.set()

    t = threading.Thread(target=go)
    t.start()
    try:
        if waits:
            assert not done.wait(0.5)  # held back until its prefix arrives from storage
            gate.set()
        else:  # admitted without waiting for the held read
            assert done.wait(30)
    finally:
        gate.set()
        t.join(30)
    return result["out"]


def test_prefetch_policies(tiny_path, reference, registry):
    rounds = conversations()
    with storage_engine(tiny_path, registry, "prefetch") as first:
        run_rounds(first, rounds)
    want = reference[-len(rounds[-1]):]
    prompt = rounds[-1][0]
    # auto with nothing measured yet waits as timeout does (here 50 ms)
    for policy in ("best_effort", "timeout", "auto", "wait_complete"):
        gate = MemoryTier.gates.setdefault(policy, threading.Event())
        extra = {"gate": policy, "prefetch_timeout_base": 0.05, "prefetch_timeout_per_ki_token": 0.0}
        with storage_engine(tiny_path, registry, "prefetch", policy=policy, **extra) as engine:
            out = _served_while_a_read_is_held(engine, gate, prompt, waits=policy == "wait_complete")
            assert out["output_ids"] == want[0]
            hits = engine.get_stats()["hicache_storage_hit_tokens"]
            if policy == "wait_complete":
                assert out["meta_info"]["cached_tokens"] > 0 and hits > 0
            else:
                assert out["meta_info"]["cached_tokens"] == 0 and hits == 0


@pytest.mark.parametrize("case", ["loading_cheaper", "recomputing_cheaper"])
def test_auto_prefetch_weighs_loading_against_recomputing(tiny_path, reference, registry, case):
    """With both rates measured, ``auto`` waits for a read estimated cheaper than
    recomputing (however long the 50 ms timeout prior says) and skips one estimated
    dearer."""
    rounds = conversations()
    with storage_engine(tiny_path, registry, "prefetch-auto") as first:
        run_rounds(first, rounds)
    want = reference[-len(rounds[-1]):]
    prompt = rounds[-1][0]
    gate = MemoryTier.gates.setdefault(f"auto-{case}", threading.Event())
    extra = {"gate": f"auto-{case}", "prefetch_timeout_base": 0.05, "prefetch_timeout_per_ki_token": 0.0}
    with storage_engine(tiny_path, registry, "prefetch-auto", policy="auto", **extra) as engine:
        cache = engine.scheduler.cache
        cache.observe_prefill(1000, 1000.0)  # a second per token to recompute
        per_byte = 1e-12 if case == "loading_cheaper" else 1.0  # loading: next to nothing, or ages
        cache.storage.reads.observe(1e9, 1e9 * per_byte)
        waits = case == "loading_cheaper"
        out = _served_while_a_read_is_held(engine, gate, prompt, waits=waits)
        stats = engine.get_stats()
    assert out["output_ids"] == want[0]
    assert (out["meta_info"]["cached_tokens"] > 0) == waits
    assert stats["hicache_storage_prefetch_waits"] == int(waits)
    assert stats["hicache_storage_prefetch_skips"] == int(not waits)


def test_prefill_rate_ignores_short_steps(tiny_path, registry):
    from radixserve.hicache.prefetch import MIN_PREFILL_SAMPLE_TOKENS

    with storage_engine(tiny_path, registry, "prefill-rate", policy="auto") as engine:
        cache = engine.scheduler.cache
        cache.observe_prefill(1, 5.0)  # one token's step is mostly fixed cost
        assert cache.prefill.estimate(100) is None
        cache.observe_prefill(MIN_PREFILL_SAMPLE_TOKENS, MIN_PREFILL_SAMPLE_TOKENS * 0.01)
        assert cache.prefill.estimate(100) == pytest.approx(1.0)
        engine.generate(input_ids=list(range(3, 3 + MIN_PREFILL_SAMPLE_TOKENS + 8)), sampling_params=PARAMS)
        assert engine.get_stats()["hicache_prefill_tokens_per_second"] > 0
        assert cache.prefill.units > MIN_PREFILL_SAMPLE_TOKENS  # the engine's own prefill counted


# ------------------------------------------------------------------ configuration
def test_bad_hicache_flags_name_the_flag():
    from radixserve.config import ServerArgs

    with pytest.raises(ConfigError, match="--enable-hierarchical-cache"):
        ServerArgs(hicache_storage_backend="file")
    with pytest.raises(ConfigError, match="--disable-radix-cache"):
        ServerArgs(enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ConfigError, match="--hicache-write-policy"):
        ServerArgs(enable_hierarchical_cache=True, hicache_write_policy="sometimes")
    with pytest.raises(ConfigError, match="--hicache-storage-backend-extra-config"):
        ServerArgs(enable_hierarchical_cache=True, hicache_storage_backend_extra_config="{not json")
    with pytest.raises(ConfigError, match="--hicache-ratio"):
        ServerArgs(enable_hierarchical_cache=True, hicache_ratio=-1)


def test_an_unknown_storage_tier_lists_the_choices(tiny_path):
    with pytest.raises(Exception, match="--hicache-storage-backend.*nope"):
        radixserve.Engine(tiny_path, enable_hierarchical_cache=True, hicache_storage_backend="nope")


def test_cache_salts_keep_prefixes_apart_in_every_tier(tiny_path, registry):
    """Requests of different cache salts (or none) never share a cached prefix: not on the
    device, not through the host tier, not through storage after a restart; the same salt
    does share, and a salt changes no output."""
    prompt = conversations()[-1][0]
    with engine_for(tiny_path) as plain:
        ref = plain.generate(input_ids=prompt, sampling_params=PARAMS)["output_ids"]

    def run(engine, salt):
        out = engine.generate(input_ids=prompt, sampling_params=PARAMS, cache_salt=salt)
        assert out["output_ids"] == ref
        return out["meta_info"]["cached_tokens"]

    with storage_engine(tiny_path, registry, "salted") as first:
        assert run(first, "tenant-a") == 0
        assert run(first, "tenant-a") >= len(prompt) - PAGE  # the same salt shares its prefix
        assert run(first, "tenant-b") == 0 and run(first, None) == 0
        assert run(first, None) > 0
        first.generate(input_ids=conversations()[0], sampling_params=PARAMS)  # evict the prompt to the host
        assert run(first, "tenant-c") == 0
    with storage_engine(tiny_path, registry, "salted") as second:  # a restart: only storage has the pages
        assert run(second, "tenant-c2") == 0
        assert second.get_stats()["hicache_storage_hit_tokens"] == 0
        assert run(second, "tenant-a") > 0
        assert second.get_stats()["hicache_storage_hit_tokens"] > 0

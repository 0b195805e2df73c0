"""Continuous batching with the radix prefix cache, on a tiny random-weight Llama.

Greedy outputs must not depend on scheduling: cache on or off, page size, chunked prefill
sizes that split prompts mid-page, schedule policy, or retraction under a tiny pool. Aborts
at every stage must leave the idle invariant true (every page free or cached, every
request slot free).
"""

from __future__ import annotations

import contextlib

import pytest
import radixserve
import torch
from engine_checks import wait_until_idle
from radixserve.engine.request import Req
from radixserve.engine.scheduler import RequestRejected
from radixserve.engine.scheduler import kv as kv_mod
from radixserve.sampling import SamplingParams
from tiny_models import VOCAB, build_checkpoint

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sched_llama"))
    build_checkpoint(path, "llama", seed=11, max_position_embeddings=512)
    return path


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """3 groups x 4 prompts: a 37-token shared prefix (not page aligned) + 3..20 own tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(3):
        prefix = torch.randint(3, VOCAB, (37,), generator=g).tolist()
        for _ in range(4):
            n = int(torch.randint(3, 21, (1,), generator=g))
            prompts.append(prefix + torch.randint(3, VOCAB, (n,), generator=g).tolist())
    order = torch.randperm(len(prompts), generator=g).tolist()
    return [prompts[i] for i in order]


PARAMS = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


def make_engine(path, **kw):
    kw.setdefault("max_total_tokens", 4096)
    return radixserve.Engine(path, dtype="float32", enable_leak_check=True, **kw)


@contextlib.contextmanager
def engine_for(path, **kw):
    """An engine that is checked for the idle invariant when the block ends, then shut down."""
    engine = make_engine(path, **kw)
    try:
        yield engine
        wait_until_idle(engine)
    finally:
        engine.shutdown()


def run(engine, prompts, params=PARAMS):
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="module")
def reference(tiny_path):
    """Outputs with no cache, no chunking, one prompt at a time."""
    with engine_for(tiny_path, disable_radix_cache=True, chunked_prefill_size=-1) as engine:
        return [run(engine, [p])[0] for p in shared_prefix_prompts()]


@pytest.mark.parametrize("page_size", [1, 4, 16])
# mixed steps need chunks: unchunked, every prompt prefills in the first step
@pytest.mark.parametrize("chunk, mixed", [(-1, False), (7, False), (13, False), (7, True), (13, True)],
                         ids=["chunk-1", "chunk7", "chunk13", "chunk7-mixed", "chunk13-mixed"])
@pytest.mark.parametrize("cache", ["on", "off"])
def test_outputs_independent_of_cache_page_and_chunking(tiny_path, reference, page_size, chunk, cache, mixed):
    with engine_for(tiny_path, page_size=page_size, chunked_prefill_size=chunk,
                    disable_radix_cache=cache == "off", disable_mixed_chunk=not mixed) as engine:
        prompts = shared_prefix_prompts()
        assert run(engine, prompts) == reference
        mixed_steps = engine.scheduler.stats.num_mixed_steps
        assert (mixed_steps > 0) == mixed  # later prompts' chunks prefill while earlier ones decode
        first = engine.scheduler.get_stats()
        assert run(engine, prompts) == reference  # second pass: served from the cache when on
        second = engine.scheduler.get_stats()
        hits = second["num_cached_prompt_tokens"] - first["num_cached_prompt_tokens"]
        total = second["num_prompt_tokens"] - first["num_prompt_tokens"]
        if cache == "on":
            # every prompt was cached whole by the first pass (all but the last, partial page)
            assert hits >= total - len(prompts) * page_size
        else:
            assert second["num_cached_prompt_tokens"] == 0


@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed"])
@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight", "lof", "random"])
def test_every_schedule_policy_gives_the_same_greedy_outputs(tiny_path, reference, policy, mixed):
    with engine_for(tiny_path, schedule_policy=policy, max_running_requests=3, chunked_prefill_size=16,
                    disable_mixed_chunk=not mixed) as engine:
        assert run(engine, shared_prefix_prompts()) == reference
        assert (engine.scheduler.stats.num_mixed_steps > 0) == mixed


def test_lpm_orders_waiting_by_cached_prefix(tiny_path):
    with engine_for(tiny_path, page_size=1) as engine:
        sched = engine.scheduler
        base = list(range(10, 60))
        run(engine, [base])  # cache 50 + NEW_TOKENS tokens
        reqs = [Req(f"r{n}", base[:n] + [5] * 8, SamplingParams(max_new_tokens=1), 1) for n in (3, 40, 12)]
        for r in reqs:
            sched.add_request(r)
        assert [r.rid for r in sched.planner.order()] == ["r40", "r12", "r3"]
        sched.planner.policy = "fcfs"
        assert [r.rid for r in sched.planner.order()] == ["r3", "r40", "r12"]
        sched.planner.policy = "lof"
        for r, m in zip(reqs, (5, 1, 9)):
            r.max_new_tokens = m
        assert [r.rid for r in sched.planner.order()] == ["r12", "r3", "r40"]
        while sched.has_work:
            sched.step()


def test_lpm_falls_back_to_arrival_order_above_lpm_max_queue(tiny_path, monkeypatch):
    """Above --lpm-max-queue waiting requests the queue is not matched against the cache
    (that costs a prefix match per waiting request per step) and keeps arrival order."""
    with engine_for(tiny_path, page_size=1, lpm_max_queue=3) as engine:
        sched = engine.scheduler
        base = list(range(10, 60))
        run(engine, [base])
        calls = []
        match = sched.kv.cache.match_prefix
        monkeypatch.setattr(sched.kv.cache, "match_prefix", lambda ids: calls.append(1) or match(ids))
        reqs = [Req(f"r{n}", base[:n] + [5] * 8, SamplingParams(max_new_tokens=1), 1) for n in (3, 40, 12)]
        for r in reqs:
            sched.add_request(r)
        assert [r.rid for r in sched.planner.order()] == ["r40", "r12", "r3"] and len(calls) == 3
        sched.add_request(Req("r45", base[:45] + [6] * 8, SamplingParams(max_new_tokens=1), 1))
        calls.clear()
        assert [r.rid for r in sched.planner.order()] == ["r3", "r40", "r12", "r45"] and not calls
        while sched.has_work:
            sched.step()


@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed"])
def test_retraction_under_a_tiny_pool_keeps_greedy_outputs(tiny_path, reference, monkeypatch, mixed):
    # Reserve nothing for future decode tokens, so decode outgrows the pool and must retract.
    monkeypatch.setattr(kv_mod, "INIT_NEW_TOKEN_RATIO", 0.0)
    monkeypatch.setattr(kv_mod, "MIN_NEW_TOKEN_RATIO", 0.0)
    with engine_for(tiny_path, page_size=4, max_total_tokens=160, chunked_prefill_size=32,
                    disable_mixed_chunk=not mixed) as engine:
        assert run(engine, shared_prefix_prompts()) == reference
        assert engine.scheduler.stats.num_retractions > 0


def test_request_that_can_never_fit_is_rejected(tiny_path):
    with engine_for(tiny_path, max_total_tokens=64) as engine:
        with pytest.raises(RequestRejected, match="KV pool"):
            engine.generate(input_ids=[5] * 40, sampling_params={"max_new_tokens": 30})
        assert engine.scheduler.waiting == type(engine.scheduler.waiting)()
        engine.check_idle_invariant()


def _req(rid, prompt, n=NEW_TOKENS):
    return Req(rid, list(prompt), SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True), n)


@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed"])
@pytest.mark.parametrize("stage", ["queued", "mid-prefill", "decoding"])
def test_abort_at_every_stage_returns_everything(tiny_path, reference, stage, mixed):
    with engine_for(tiny_path, page_size=4, chunked_prefill_size=8, max_running_requests=2,
                    disable_mixed_chunk=not mixed) as engine:
        sched = engine.scheduler
        prompts = shared_prefix_prompts()
        reqs = [_req(f"r{i}", p) for i, p in enumerate(prompts[:4])]
        for r in reqs:
            sched.add_request(r)
        target = {"queued": reqs[3], "mid-prefill": reqs[0], "decoding": reqs[0]}[stage]
        steps = 0
        while True:
            if stage == "queued" and target in sched.waiting and steps >= 1:
                break
            if stage == "mid-prefill" and target.req_pool_idx is not None and 0 < target.kv_len < len(target.input_ids):
                break
            if stage == "decoding" and len(target.output_ids) >= 3:
                break
            sched.step()
            steps += 1
            assert steps < 200
        produced = list(target.output_ids)
        assert sched.abort(target.rid)
        assert target.finish_reason["type"] == "abort"
        assert target.output_ids == produced
        if stage == "decoding":
            assert produced == reference[0][: len(produced)]
        while sched.has_work:
            sched.step()
        sched.check_idle_invariant()
        for i, r in enumerate(reqs):
            if r is not target:
                assert r.output_ids == reference[i]


def test_leak_check_flag_raises_in_the_scheduler(tiny_path):
    with engine_for(tiny_path) as engine:
        engine.generate(input_ids=[[5, 6, 7]], sampling_params=PARAMS)
        stray = engine.scheduler.kv.allocator.allocate(1)  # a page nobody owns
        with pytest.raises(AssertionError, match="leaked"):
            engine.generate(input_ids=[[5, 6, 7]], sampling_params=PARAMS)
        engine.scheduler.kv.allocator.free(stray)
        engine.check_idle_invariant()


def test_stats_and_flush_cache(tiny_path):
    with engine_for(tiny_path) as engine:
        prompts = shared_prefix_prompts()
        run(engine, prompts)
        stats = engine.scheduler.get_stats()
        assert stats["num_prompt_tokens"] == sum(len(p) for p in prompts)
        assert stats["num_decode_tokens"] > 0 and stats["decode_throughput"] > 0
        assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
        assert stats["num_cached_tokens"] > 0
        assert engine.scheduler.flush_cache()
        assert engine.scheduler.get_stats()["num_cached_tokens"] == 0
        engine.check_idle_invariant()


@pytest.mark.parametrize("page_size", [1, 4])
def test_cascade_decode_over_shared_prefixes_keeps_greedy_outputs(tiny_path, reference,
                                                                 monkeypatch, page_size):
    """torch_native attends a shared cached prefix once per group of requests (cascade);
    lowering its threshold below the workload's 37-token prefixes turns it on here."""
    cascade = pytest.importorskip("radixserve_attention_torch.cascade")
    monkeypatch.setattr(cascade, "MIN_SHARED_TOKENS", 8)
    calls = []
    original = cascade.group_attention
    monkeypatch.setattr(cascade, "group_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    with engine_for(tiny_path, page_size=page_size) as engine:
        prompts = shared_prefix_prompts()
        run(engine, prompts)  # fills the cache
        assert run(engine, prompts) == reference  # now every group decodes over one prefix
        assert calls

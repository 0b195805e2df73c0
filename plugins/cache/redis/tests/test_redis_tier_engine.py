"""The redis tier under real engines: two engines sharing one Redis reuse each other's
prefixes (the second never saw them), and a Redis that goes away mid-run costs only
recomputation, with identical tokens and no hang. Tiny random-weight Llama."""

from __future__ import annotations

import logging

import pytest
import radixserve
from engine_checks import wait_until_idle  # noqa: E402 - tests/ is on sys.path (conftest)
from tiny_models import random_prompts  # noqa: E402

PAGE = 4
PARAMS = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def prompts(num=4, length=80, seed=0):
    return random_prompts(num, length, seed)


def engine(path, url):
    return radixserve.Engine(path, dtype="float32", page_size=PAGE, max_total_tokens=512, enable_leak_check=True,
                             enable_hierarchical_cache=True, hicache_storage_backend="redis",
                             hicache_storage_url=url, hicache_storage_prefetch_policy="wait_complete")


@pytest.fixture(scope="module")
def reference(tiny):
    e = radixserve.Engine(tiny, dtype="float32", page_size=PAGE, max_total_tokens=4096)
    try:
        return [o["output_ids"] for o in e.generate(input_ids=prompts(), sampling_params=PARAMS)]
    finally:
        e.shutdown()


def generate(e, ps):
    outs = e.generate(input_ids=ps, sampling_params=PARAMS)
    wait_until_idle(e)
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs]


def test_two_engines_share_prefixes_through_redis(tiny, reference, redis_server):
    a, b = engine(tiny, redis_server.url), engine(tiny, redis_server.url)  # two "servers"
    try:
        outs, cached = generate(a, prompts())
        assert outs == reference and sum(cached) == 0
        a.scheduler.cache.storage.flush(30)  # a's writes have landed in Redis
        outs, cached = generate(b, prompts())  # b never saw these prompts
        assert outs == reference
        assert all(c >= 80 - PAGE for c in cached)
        assert b.get_stats()["hicache_storage_hit_tokens"] >= 4 * (80 - PAGE)
    finally:
        a.shutdown()
        b.shutdown()


def test_a_redis_that_goes_away_mid_run_degrades_to_recomputation(tiny, reference, own_redis_server, caplog):
    server = own_redis_server()
    e = engine(tiny, server.url)
    try:
        outs, _ = generate(e, prompts()[:2])
        assert outs == reference[:2]
        e.scheduler.cache.storage.flush(30)
        server.kill()
        with caplog.at_level(logging.WARNING):
            outs, cached = generate(e, prompts()[2:])  # new prefixes: lookups and writes fail
            assert outs == reference[2:] and sum(cached) == 0
            outs, _ = generate(e, prompts())  # the first two are still in the host tier
            assert outs == reference
        assert e.get_stats()["hicache_storage_errors"] > 0 or "redis" in caplog.text.lower()
    finally:
        e.shutdown()  # pending writes to the dead server give up instead of hanging

"""The ``redis`` storage tier against a real redis-server: the shared conformance suite,
then sharing between servers, options, Redis's own size bound, and a Redis that dies or
stalls mid-run (calls fail fast, never hang, one warning)."""

from __future__ import annotations

import logging
import sys
import time

import pytest
from radixserve.config import ConfigError, ServerArgs
from radixserve.hicache import CacheTierContext
from radixserve.registry import BackendUnavailableError, get_registry
from radixserve.testing import cache_tier_conformance as cc
from radixserve_cache_redis import probe
from radixserve_cache_redis import tier as tier_mod
from radixserve_cache_redis.tier import DEFAULT_KEY_PREFIX, DEFAULT_URL, RedisTier

LOGGER = tier_mod.logger.name
FAST = 2.0  # seconds a call may take against a dead or stalled Redis


def make(ctx: CacheTierContext) -> RedisTier:
    return get_registry().resolve("cache_tier", "redis").factory(ctx)


@pytest.fixture
def new_context(redis_server):
    def new(**extra):
        return cc.make_context("redis", {"url": redis_server.url, "key_prefix": f"{cc.fresh_name('rxtest')}:",
                                         **extra})

    return new


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("check", sorted(set(cc.CHECKS) - {"size_bound"}))
def test_conformance(check, new_context):
    cc.CHECKS[check](make, new_context)


def test_conformance_run_all(new_context):
    assert cc.run_all(make, new_context, bounded=False) == [c for c in cc.CHECKS if c != "size_bound"]


# -------------------------------------------------------------- configuration
def test_registered_with_a_probe():
    entry = get_registry().resolve("cache_tier", "redis")
    assert entry.distribution == "radixserve-cache-redis" and entry.probe is probe
    assert probe() is None


def test_probe_names_the_missing_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis now fails
    assert "redis client library is not installed" in probe()
    with pytest.raises(BackendUnavailableError, match="redis client library"):
        get_registry().resolve("cache_tier", "redis", flag="--hicache-storage-backend")


def test_defaults_without_options():
    tier = make(cc.make_context("redis", {}))  # connects lazily: no server needed
    try:
        assert tier.url == DEFAULT_URL == "redis://127.0.0.1:6379/0"
        assert tier.prefix == DEFAULT_KEY_PREFIX == "radixserve:kv:"
        assert tier.ttl_ms is None
    finally:
        tier.close()


@pytest.mark.parametrize(("extra", "match"), [
    ({"url": "http://nowhere:1"}, "--hicache-storage-url"),
    ({"ttl_seconds": -1}, "ttl_seconds"),
    ({"timeout_seconds": 0}, "timeout_seconds"),
    ({"connect_timeout_seconds": "1"}, "connect_timeout_seconds"),
    ({"key_prefix": 3}, "key_prefix"),
])
def test_bad_options_are_config_errors(extra, match):
    with pytest.raises(ConfigError, match=match):
        make(cc.make_context("redis", extra))


# --------------------------------------------------------------------- storage
def test_pages_live_under_the_prefix_and_reads_are_one_mget(new_context, redis_server):
    ctx = new_context()
    pages = cc.Pages(ctx)
    keys, values = pages.chain(8)
    tier = make(ctx)
    raw = redis_server.client()
    try:
        assert tier.batch_set(keys, values) == [True] * 8
        prefix = ctx.extra_config["key_prefix"]
        assert sorted(raw.keys(prefix + "*")) == sorted((prefix + k).encode() for k in keys)
        assert raw.get(prefix + keys[3]) == values[3]
        raw.config_resetstat()
        assert tier.batch_get(keys) == values
        stats = raw.info("commandstats")
        assert stats["cmdstat_mget"]["calls"] == 1 and "cmdstat_get" not in stats
    finally:
        tier.close()
        raw.close()


def test_two_servers_share_pages_through_the_flag(redis_server):
    """Two radixserve servers configured only with --hicache-storage-url."""
    base = cc.make_context("redis", {})
    tiers = []
    for _ in range(2):
        args = ServerArgs(enable_hierarchical_cache=True, hicache_storage_backend="redis",
                          hicache_storage_url=redis_server.url,
                          hicache_storage_backend_extra_config=f'{{"key_prefix": "{cc.fresh_name("two")}:"}}')
        extra = {**args.hicache_extra_config(), "key_prefix": "rx-two-servers:"}
        tiers.append(make(CacheTierContext(args, extra, base.model_key, base.page_size, base.page_bytes)))
    a, b = tiers
    try:
        a.clear()
        pages = cc.Pages(base)
        keys, values = pages.chain(6)
        assert a.batch_set(keys[:4], values[:4]) == [True] * 4
        assert b.batch_exists(keys) == 4  # the second server never computed them
        assert b.batch_get(keys) == values[:4] + [None, None]
        assert b.batch_set(keys[4:], values[4:]) == [True, True]
        assert a.batch_exists(keys) == 6
    finally:
        a.clear()
        a.close()
        b.close()


def test_ttl_seconds_expires_pages(new_context, redis_server):
    ctx = new_context(ttl_seconds=30)
    pages = cc.Pages(ctx)
    keys, values = pages.chain(2)
    tier = make(ctx)
    raw = redis_server.client()
    try:
        assert tier.batch_set(keys, values) == [True, True]
        for key in keys:
            assert 0 < raw.pttl(ctx.extra_config["key_prefix"] + key) <= 30_000
    finally:
        tier.close()
        raw.close()


def test_clear_removes_only_its_own_prefix(new_context, redis_server):
    raw = redis_server.client()
    ctx = new_context(key_prefix="rx*glob[1]:")  # glob characters match literally
    other = new_context(key_prefix="rxXglob1:")
    pages = cc.Pages(ctx)
    keys, values = pages.chain(3)
    tier, neighbour = make(ctx), make(other)
    try:
        raw.set("unrelated", b"keep me")
        assert tier.batch_set(keys, values) == [True] * 3
        assert neighbour.batch_set(keys, values) == [True] * 3
        tier.clear()
        assert tier.batch_exists(keys) == 0
        assert neighbour.batch_exists(keys) == 3 and raw.get("unrelated") == b"keep me"
    finally:
        neighbour.clear()
        raw.delete("unrelated")
        tier.close()
        neighbour.close()
        raw.close()


def test_maxmemory_allkeys_lru_is_the_size_bound(own_redis_server):
    server = own_redis_server("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    ctx = cc.make_context("redis", {"url": server.url}, payload_bytes=16 * 1024)
    pages = cc.Pages(ctx)
    keys, values = pages.chain(200)  # 3.2 MB of pages
    tier = make(ctx)
    raw = server.client()
    try:
        for i in range(0, 200, 10):
            assert tier.batch_set(keys[i:i + 10], values[i:i + 10]) == [True] * 10
        assert raw.info("memory")["used_memory"] <= 2 * 1024 * 1024
        assert raw.info("stats")["evicted_keys"] > 0
        assert tier.batch_exists(keys) < 100 and tier.batch_get(keys[-5:]) == values[-5:]
    finally:
        tier.close()
        raw.close()


def test_a_full_redis_without_eviction_refuses_writes_with_one_warning(own_redis_server, caplog):
    server = own_redis_server("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    ctx = cc.make_context("redis", {"url": server.url}, payload_bytes=16 * 1024)
    pages = cc.Pages(ctx)
    keys, values = pages.chain(200)
    tier = make(ctx)
    try:
        results = []
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for i in range(0, 200, 10):
                results += tier.batch_set(keys[i:i + 10], values[i:i + 10])
                tier.batch_exists(keys[i:i + 10])  # other calls succeed meanwhile
        assert results[0] and not results[-1]
        assert len(_warnings(caplog)) == 1 and "maxmemory" in _warnings(caplog)[0], _warnings(caplog)
        assert all(results[:results.index(False)]) and not any(results[results.index(False):])
        stored = results.index(False)
        assert tier.batch_exists(keys) == stored and tier.stats()["refused_writes"] == 200 - stored
        assert tier.stats()["is_up"] == 1
    finally:
        tier.close()


# --------------------------------------------------- a Redis that goes away
def _timed(fn, *args):
    started = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - started


def test_redis_killed_mid_run_fails_fast_then_recovers(own_redis_server, caplog):
    server = own_redis_server()
    ctx = cc.make_context("redis", {"url": server.url, "retry_interval_seconds": 0})
    pages = cc.Pages(ctx)
    keys, values = pages.chain(4)
    tier = make(ctx)
    try:
        assert tier.batch_set(keys[:2], values[:2]) == [True, True]
        server.kill()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            for _ in range(3):
                n, took = _timed(tier.batch_exists, keys)
                assert n == 0 and took < FAST
                got, took = _timed(tier.batch_get, keys)
                assert got == [None] * 4 and took < FAST
                ok, took = _timed(tier.batch_set, keys[2:], values[2:])
                assert ok == [False, False] and took < FAST
        assert len(_warnings(caplog)) == 1, _warnings(caplog)
        assert tier.stats()["failed_calls"] == 9 and tier.stats()["is_up"] == 0
        with pytest.raises(ConnectionError, match="clear"):
            tier.clear()

        own_redis_server(port=server.port)  # back, empty (no persistence)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=LOGGER):
            assert tier.batch_set(keys, values) == [True] * 4
        assert any("answers again" in r.getMessage() for r in caplog.records)
        assert tier.batch_get(keys) == values and tier.stats()["is_up"] == 1
    finally:
        tier.close()


def test_after_a_failure_calls_skip_redis_for_the_retry_interval(own_redis_server):
    server = own_redis_server()
    ctx = cc.make_context("redis", {"url": server.url, "retry_interval_seconds": 60})
    keys, values = cc.Pages(ctx).chain(2)
    tier = make(ctx)
    try:
        server.kill()
        assert tier.batch_exists(keys) == 0
        own_redis_server(port=server.port)
        # Redis is back, but the tier does not try it again before 60 s have passed
        assert tier.batch_set(keys, values) == [False, False]
        assert tier.stats()["skipped_calls"] == 1 and tier.stats()["failed_calls"] == 1
    finally:
        tier.close()


def test_stalled_redis_times_out_instead_of_hanging(own_redis_server, caplog):
    server = own_redis_server()
    ctx = cc.make_context("redis", {"url": server.url, "timeout_seconds": 0.5, "retry_interval_seconds": 0})
    pages = cc.Pages(ctx)
    keys, values = pages.chain(2)
    tier = make(ctx)
    try:
        assert tier.batch_set(keys, values) == [True, True]
        server.pause()  # accepts nothing, answers nothing
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            got, took = _timed(tier.batch_get, keys)
            assert got == [None, None] and took < FAST
            ok, took = _timed(tier.batch_set, keys, values)
            assert ok == [False, False] and took < FAST
            n, took = _timed(tier.batch_exists, keys)
            assert n == 0 and took < FAST
        assert len(_warnings(caplog)) == 1 and "Timeout" in _warnings(caplog)[0]
        server.resume()
        assert tier.batch_get(keys) == values
    finally:
        server.resume()
        tier.close()


# ------------------------------------------------------------------ secrets
def test_the_password_in_the_url_is_never_logged(own_redis_server, caplog):
    password = "pw-" + cc.fresh_name("s3cret")
    server = own_redis_server("--requirepass", password)
    good = f"redis://:{password}@127.0.0.1:{server.port}/0"
    wrong = f"redis://default:{password}-wrong@127.0.0.1:{server.port}/0"
    pages = cc.Pages(cc.make_context("redis", {"url": good}))
    keys, values = pages.chain(2)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        tier = make(cc.make_context("redis", {"url": good, "retry_interval_seconds": 0}))
        try:
            assert tier.batch_set(keys, values) == [True, True]  # the password works
            server.kill()
            assert tier.batch_exists(keys) == 0  # logs the failure, with the URL
        finally:
            tier.close()
        bad = make(cc.make_context("redis", {"url": wrong}))
        try:
            own_redis_server("--requirepass", password, port=server.port)
            assert bad.batch_get(keys) == [None, None]  # refused: wrong password, logged
        finally:
            bad.close()
        with pytest.raises(ConfigError) as err:
            make(cc.make_context("redis", {"url": f"http://u:{password}@nowhere:1"}))
    text = "\n".join(r.getMessage() for r in caplog.records) + str(err.value)
    assert len(_warnings(caplog)) == 2 and f"127.0.0.1:{server.port}" in text, text
    assert password not in text and "redis://***@127.0.0.1" in text, text


def test_the_password_can_come_from_a_file_or_the_environment(own_redis_server, tmp_path, monkeypatch):
    """So that it is not on the command line: ``password_file``, else RADIXSERVE_REDIS_PASSWORD."""
    password = "pw-" + cc.fresh_name("file")
    server = own_redis_server("--requirepass", password)
    url = f"redis://127.0.0.1:{server.port}/0"
    keys, values = cc.Pages(cc.make_context("redis", {"url": url})).chain(1)
    secret = tmp_path / "redis-password"
    secret.write_text(password + "\n")
    for extra, env in (({"password_file": str(secret)}, None), ({}, password), ({}, None)):
        if env is None:
            monkeypatch.delenv("RADIXSERVE_REDIS_PASSWORD", raising=False)
        else:
            monkeypatch.setenv("RADIXSERVE_REDIS_PASSWORD", env)
        tier = make(cc.make_context("redis", {"url": url, "retry_interval_seconds": 0, **extra}))
        try:
            stored = tier.batch_set(keys, values)
        finally:
            tier.close()
        assert stored == ([False] if not extra and env is None else [True]), (extra, env)
    secret.write_text("")
    with pytest.raises(ConfigError, match="password_file"):
        make(cc.make_context("redis", {"url": url, "password_file": str(secret)}))

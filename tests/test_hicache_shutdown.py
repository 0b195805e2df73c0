"""A shutdown flushes the storage tier's queued writes within
``--hicache-storage-shutdown-timeout``: what is queued lands when the tier keeps up, and a
stuck tier costs at most the timeout, neither the engine's shutdown nor the process exit
waiting on it."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from radixserve.config import ServerArgs
from radixserve.hicache import PageFormatError, decode_page
from radixserve.hicache.storage_io import StorageIO
from radixserve.testing import cache_tier_conformance as cc
from tiny_models import build_checkpoint

SLACK = 3.0  # seconds a bounded shutdown may take beyond its timeout on a loaded machine


class SlowTier:
    """Stores pages in a dict, each batch_set taking ``delay`` seconds, or blocking until
    ``release`` is set when ``stuck``."""

    def __init__(self, delay=0.0, stuck=False):
        self.data, self.delay, self.stuck = {}, delay, stuck
        self.release, self.entered = threading.Event(), threading.Event()
        self.closed = False

    def batch_exists(self, keys):
        return next((n for n, k in enumerate(keys) if k not in self.data), len(keys))

    def batch_get(self, keys):
        return [self.data.get(k) for k in keys]

    def batch_set(self, keys, values):
        self.entered.set()
        if self.stuck:
            self.release.wait(60)
        else:
            time.sleep(self.delay)  # a slow device: the writes queue up behind each other
        self.data.update(zip(keys, values))
        return [True] * len(keys)

    def stats(self):
        return {}

    def close(self):
        self.closed = True


def storage_of(tier, close_timeout=ServerArgs.hicache_storage_shutdown_timeout):
    ctx = cc.make_context("memory")
    return StorageIO(tier, ctx, "slow", cc.PAYLOAD_BYTES, mac=cc.MAC_KEY, close_timeout=close_timeout), cc.Pages(ctx)


def test_the_default_timeout_is_below_a_supervisors_grace_period():
    assert 0 < ServerArgs().hicache_storage_shutdown_timeout == 5.0 < 10


def test_queued_writes_are_on_storage_after_close():
    tier = SlowTier(delay=0.05)
    storage, pages = storage_of(tier)
    keys, _ = pages.chain(12)
    for i in range(0, 12, 2):  # six batches queued at once, ~0.3 s of writing
        storage.store(keys[i:i + 2], [pages.payload(k) for k in keys[i:i + 2]])
    storage.close()
    assert tier.closed and sorted(tier.data) == sorted(keys)
    for k in keys:
        assert bytes(decode_page(storage.salt, k, tier.data[k], cc.PAYLOAD_BYTES, mac=cc.MAC_KEY)) == \
            pages.payload(k)
    assert storage.counters.store_pages == 12 and storage.counters.errors == 0


def test_close_returns_within_the_timeout_when_the_tier_is_stuck(caplog):
    tier = SlowTier(stuck=True)
    storage, pages = storage_of(tier, close_timeout=0.5)
    keys, _ = pages.chain(6)
    try:
        for i in range(0, 6, 2):
            storage.store(keys[i:i + 2], [pages.payload(k) for k in keys[i:i + 2]])
        assert tier.entered.wait(10)
        started = time.monotonic()
        with caplog.at_level(logging.WARNING):
            storage.close()
        took = time.monotonic() - started
        assert 0.5 <= took < 0.5 + SLACK
        assert "3 queued writes did not finish within --hicache-storage-shutdown-timeout 0.5 s" in caplog.text
        assert tier.closed
    finally:
        tier.release.set()
    with pytest.raises(PageFormatError, match="missing"):  # the batches not started were dropped
        decode_page(storage.salt, keys[-1], tier.data.get(keys[-1]), cc.PAYLOAD_BYTES, mac=cc.MAC_KEY)


SCRIPT = textwrap.dedent("""
    import sys, threading, time
    import radixserve
    from radixserve.hicache import CacheTier
    from radixserve.hookspecs import hookimpl
    from radixserve.registry import Registry

    class Stuck(CacheTier):  # reads miss, every write hangs
        def __init__(self, ctx):
            pass
        def batch_exists(self, keys):
            return 0
        def batch_get(self, keys):
            return [None] * len(keys)
        def batch_set(self, keys, values):
            threading.Event().wait()

    class Plugin:
        @staticmethod
        @hookimpl
        def register_cache_tiers(register):
            register("stuck", Stuck, description="a tier whose writes never end")

    reg = Registry()
    reg.load_entry_points()
    reg.add_plugin(Plugin, name="stuck-tier", distribution="tests")
    engine = radixserve.Engine(sys.argv[1], dtype="float32", page_size=4, max_total_tokens=256, registry=reg,
                               enable_hierarchical_cache=True, hicache_storage_backend="stuck",
                               hicache_storage_shutdown_timeout=1.0, hicache_storage_secret="test")
    engine.generate(input_ids=[list(range(3, 40))] * 2, sampling_params={"max_new_tokens": 4})
    print("SHUTDOWN", time.time(), flush=True)
    engine.shutdown()
    print("SHUTDOWN DONE", time.time(), flush=True)
""")


def test_engine_shutdown_and_exit_are_bounded_when_the_tier_is_stuck(tmp_path):
    path = str(tmp_path / "llama")
    build_checkpoint(path, "llama", seed=5, max_position_embeddings=512)
    script = tmp_path / "stuck.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), path], capture_output=True, text=True, timeout=120)
    exited = time.time()
    assert proc.returncode == 0, proc.stderr[-3000:]
    times = dict(line.rsplit(" ", 1) for line in proc.stdout.splitlines() if line.startswith("SHUTDOWN"))
    started, done = float(times["SHUTDOWN"]), float(times["SHUTDOWN DONE"])
    assert done - started < 1.0 + SLACK, proc.stderr[-3000:]
    assert exited - started < 1.0 + 2 * SLACK  # the stuck write does not hold the process either
    assert "did not finish within --hicache-storage-shutdown-timeout 1 s" in proc.stderr

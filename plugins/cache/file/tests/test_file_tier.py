"""The ``file`` storage tier: the shared conformance suite, then what is particular to
files (layout, atomic writes, temporary files, the LRU bound across restarts, read-only
and full directories, several servers over one directory)."""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
from radixserve.config import ConfigError, ServerArgs
from radixserve.hicache import CacheTierContext
from radixserve.registry import get_registry
from radixserve.testing import cache_tier_conformance as cc
from radixserve_cache_file import FileTier, parse_size
from radixserve_cache_file import store as store_mod

LOGGER = store_mod.logger.name


@pytest.fixture
def new_context(tmp_path):
    def new(**extra):
        return cc.make_context("file", {"storage_dir": str(tmp_path / cc.fresh_name("dir")), **extra})

    return new


def make(ctx: CacheTierContext) -> FileTier:
    return get_registry().resolve("cache_tier", "file").factory(ctx)


@pytest.mark.parametrize("check", sorted(cc.CHECKS))
def test_conformance(check, new_context):
    cc.CHECKS[check](make, new_context)


def test_conformance_run_all_covers_every_check(new_context):
    assert cc.run_all(make, new_context) == list(cc.CHECKS)


def _files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _temps(root) -> list[str]:
    return [f for f in _files(root) if os.path.basename(f).startswith(store_mod.TEMP_PREFIX)]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


# ------------------------------------------------------------------ configuration
def test_registered_by_its_distribution():
    entry = get_registry().resolve("cache_tier", "file")
    assert entry.distribution == "radixserve-cache-file"
    assert "HiCache-SSD" in entry.description


def test_missing_storage_dir_names_the_flag():
    ctx = cc.make_context("file", {})
    with pytest.raises(ConfigError, match="--hicache-storage-dir"):
        make(ctx)


def test_dedicated_flags_feed_the_tier(tmp_path):
    args = ServerArgs(enable_hierarchical_cache=True, hicache_storage_backend="file",
                      hicache_storage_dir=str(tmp_path / "ssd"), hicache_storage_size=3 * 1000,
                      hicache_storage_backend_extra_config='{"storage_dir": "/nonexistent/ignored"}')
    base = cc.make_context("file", {})
    ctx = CacheTierContext(args, args.hicache_extra_config(), base.model_key, base.page_size, base.page_bytes)
    tier = make(ctx)
    try:
        assert tier.root == str(tmp_path / "ssd") and tier.capacity == 3000
        assert os.path.isdir(tmp_path / "ssd")
    finally:
        tier.close()


def test_storage_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="not a directory|cannot create"):
        FileTier(tmp_path / "f")


@pytest.mark.parametrize(("raw", "want"), [
    (None, None), (0, None), (4096, 4096), ("4096", 4096), ("10GB", 10 * 10**9), ("64GiB", 64 * 2**30),
    ("1.5 MB", 1_500_000), (2.0e6, 2_000_000),
])
def test_parse_size(raw, want):
    assert parse_size(raw) == want


@pytest.mark.parametrize("raw", ["lots", "10 parsecs", -1, True])
def test_parse_size_rejects(raw):
    with pytest.raises(ConfigError, match="--hicache-storage-size"):
        parse_size(raw)


# ---------------------------------------------------------------------- layout
def test_pages_fan_out_by_key_prefix(tmp_path):
    ctx = cc.make_context("file", {"storage_dir": str(tmp_path)})
    pages = cc.Pages(ctx)
    keys, values = pages.chain(6)
    tier = make(ctx)
    assert tier.batch_set(keys, values) == [True] * 6
    for key, value in zip(keys, values):
        path = tmp_path / key[:2] / f"{key}.kv"
        assert path.read_bytes() == value
    assert len(_files(tmp_path)) == 6
    tier.close()


def test_invalid_key_is_refused(tmp_path):
    tier = FileTier(tmp_path)
    for bad in ("../../etc/passwd", "ABCDEF00", "ab/cd", ""):
        with pytest.raises(ValueError, match="lower-case hex"):
            tier.batch_set([bad], [b"x"])
    assert _files(tmp_path) == []


# -------------------------------------------------------------- atomic writes
def test_no_temporary_files_left_behind(tmp_path):
    ctx = cc.make_context("file", {"storage_dir": str(tmp_path)})
    pages = cc.Pages(ctx)
    tier = make(ctx)
    for seed in range(5):
        keys, values = pages.chain(8, seed=seed)
        assert all(tier.batch_set(keys, values))
        assert all(tier.batch_set(keys[:3], [pages.value(k, 1) for k in keys[:3]]))  # overwrite
    assert _temps(tmp_path) == []
    assert len(_files(tmp_path)) == 40 and tier.stats()["num_pages"] == 40
    tier.close()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporary_files_are_removed_at_open(tmp_path):
    host = store_mod._host_tag()
    sub = tmp_path / "ab"
    sub.mkdir()
    dead = sub / f".tmp-{host}-{_dead_pid()}-aaaaaa.0"  # this host, writer gone: a crash
    old = sub / ".tmp-otherhost-1-bbbbbb.0"  # another host's, an hour old: a crash
    recent = sub / ".tmp-otherhost-1-cccccc.0"  # another host's, just now: may be writing
    alive = sub / f".tmp-{host}-{os.getpid()}-dddddd.0"  # a live writer on this host
    for p in (dead, old, recent, alive):
        p.write_bytes(b"partial page")
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    tier = FileTier(tmp_path)
    assert not dead.exists() and not old.exists()
    assert recent.exists() and alive.exists()
    assert tier.num_removed_temp == 2
    assert tier.stats()["num_pages"] == 0 and tier.stats()["bytes"] == 0  # temporaries are no pages
    tier.close()


# ------------------------------------------------------------------- LRU bound
def test_lru_order_survives_a_restart(tmp_path):
    ctx = cc.make_context("file", {"storage_dir": str(tmp_path)})
    pages = cc.Pages(ctx)
    keys, values = pages.chain(5)
    tier = make(ctx)
    assert all(tier.batch_set(keys[:4], values[:4]))
    tier.close()
    now = time.time()
    for i, key in enumerate(keys[:4]):  # k0 oldest ... k3 newest
        os.utime(tmp_path / key[:2] / f"{key}.kv", (now - 100 + i, now - 100 + i))
    tier = make(ctx)
    assert tier.batch_get([keys[0]]) == [values[0]]  # the read makes k0 the newest, on disk too
    tier.close()

    bounded = cc.make_context("file", {"storage_dir": str(tmp_path), "storage_size": 4 * ctx.page_bytes})
    tier = make(bounded)
    assert tier.batch_set([keys[4]], [values[4]]) == [True]
    assert [tier.batch_exists([k]) for k in keys] == [1, 0, 1, 1, 1]  # k1 was least recently used
    assert tier.stats()["bytes"] <= 4 * ctx.page_bytes and tier.stats()["evicted_pages"] == 1
    assert len(_files(tmp_path)) == 4
    tier.close()


def test_open_with_a_smaller_bound_trims_to_it(tmp_path):
    ctx = cc.make_context("file", {"storage_dir": str(tmp_path)})
    pages = cc.Pages(ctx)
    keys, values = pages.chain(6)
    tier = make(ctx)
    for key, value in zip(keys, values):  # one by one: distinct modification times
        assert tier.batch_set([key], [value]) == [True]
    tier.close()
    tier = FileTier(tmp_path, 3 * ctx.page_bytes)
    assert tier.stats()["num_pages"] == 3 and tier.stats()["bytes"] == 3 * ctx.page_bytes
    assert [tier.batch_exists([k]) for k in keys] == [0, 0, 0, 1, 1, 1]
    assert len(_files(tmp_path)) == 3
    tier.close()


def test_a_page_larger_than_the_bound_is_refused(tmp_path, caplog):
    tier = FileTier(tmp_path, 100)
    key = "ab" * 32
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert tier.batch_set([key, "cd" * 32], [b"x" * 101, b"y"]) == [False, False]
    assert tier.batch_exists([key]) == 0 and _files(tmp_path) == []
    assert len(_warnings(caplog)) == 1 and "larger than storage_size" in _warnings(caplog)[0]
    tier.close()


# ----------------------------------------------------- read-only and full disks
def _as_unprivileged(fn):
    """``fn()`` where directory permissions hold: here when not root, else in a forked
    child that drops to ``nobody`` (root writes into read-only directories). Returns what
    ``fn`` returns (JSON), or raises what went wrong."""
    if os.geteuid() != 0:
        return fn()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no pytest from here on, only os calls and the tier
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out = {"ok": fn()}
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = {"error": f"{type(e).__name__}: {e}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + 60
    while True:
        ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the unprivileged child hung")
        chunk = os.read(r, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b'{"error": "the child died"}')
    if "error" in out:
        raise AssertionError(out["error"])
    return out["ok"]


def test_read_only_directory_serves_reads_and_refuses_writes_with_one_warning():
    root = tempfile.mkdtemp(prefix="rx-file-ro-", dir="/tmp")  # reachable by nobody
    try:
        ctx = cc.make_context("file", {"storage_dir": root})
        pages = cc.Pages(ctx)
        keys, values = pages.chain(4)
        tier = make(ctx)
        assert all(tier.batch_set(keys[:2], values[:2]))
        tier.close()
        dirs = [root, *{os.path.join(root, k[:2]) for k in keys}]
        for d in dirs:
            os.makedirs(d, exist_ok=True)
            os.chmod(d, 0o555)

        def in_read_only_dir():
            warnings = []

            class Count(logging.Handler):
                def emit(self, record):
                    if record.levelno >= logging.WARNING:
                        warnings.append(record.getMessage())

            store_mod.logger.addHandler(Count())
            t = make(ctx)
            sets = [t.batch_set(keys[2:], values[2:]) for _ in range(3)]
            sets.append(t.batch_set([keys[0]], [pages.value(keys[0], 1)]))
            got = t.batch_get(keys)
            result = {"sets": sets, "warnings": warnings, "exists": t.batch_exists(keys),
                      "reads": [g == v if g is not None else None for g, v in zip(got, values)],
                      "temps": _temps(root), "stats": t.stats()}
            t.close()
            return result

        out = _as_unprivileged(in_read_only_dir)
        assert out["sets"] == [[False, False]] * 3 + [[False]]
        assert len(out["warnings"]) == 1 and "Permission denied" in out["warnings"][0], out["warnings"]
        assert out["reads"] == [True, True, None, None]  # the old page survived the failed overwrite
        assert out["exists"] == 2 and out["temps"] == []
        assert out["stats"]["failed_writes"] == 4 and out["stats"]["num_pages"] == 2
    finally:
        for d, _, _ in os.walk(root):
            os.chmod(d, 0o755)
        shutil.rmtree(root)


class _FaultyDisk:
    """Makes ``os.open`` (``mode='open'``, e.g. EROFS) or ``os.write`` (``mode='write'``,
    e.g. ENOSPC) fail with ``err`` for files under ``root``; everything else is untouched."""

    def __init__(self, monkeypatch, root, err: int, mode: str) -> None:
        self.root = os.path.abspath(root)
        self.err, self.mode = err, mode
        self.fds: set[int] = set()
        self.real_open, self.real_write = os.open, os.write
        self.calls = 0
        monkeypatch.setattr(os, "open", self.open)
        monkeypatch.setattr(os, "write", self.write)

    def open(self, path, flags, mode=0o777, *, dir_fd=None):
        inside = os.path.abspath(os.fspath(path)).startswith(self.root + os.sep)
        if inside and self.mode == "open" and flags & os.O_CREAT:
            self.calls += 1
            raise OSError(self.err, os.strerror(self.err), path)
        fd = self.real_open(path, flags, mode, dir_fd=dir_fd)
        if inside:
            self.fds.add(fd)
        return fd

    def write(self, fd, data):
        if fd in self.fds and self.mode == "write":
            self.calls += 1
            self.real_write(fd, bytes(data)[:100])  # a partial page reaches the disk first
            raise OSError(self.err, os.strerror(self.err))
        return self.real_write(fd, data)


@pytest.mark.parametrize(("err", "mode"), [(errno.EROFS, "open"), (errno.EACCES, "open"),
                                           (errno.ENOSPC, "write"), (errno.EDQUOT, "write")])
def test_write_faults_degrade_with_one_warning(tmp_path, monkeypatch, caplog, err, mode):
    ctx = cc.make_context("file", {"storage_dir": str(tmp_path)})
    pages = cc.Pages(ctx)
    keys, values = pages.chain(6)
    tier = make(ctx)
    assert all(tier.batch_set(keys[:2], values[:2]))
    with monkeypatch.context() as m:
        disk = _FaultyDisk(m, tmp_path, err, mode)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            started = time.monotonic()
            for _ in range(5):
                assert tier.batch_set(keys[2:], values[2:]) == [False] * 4
                # overwriting a stored page fails too, and leaves the old page readable
                assert tier.batch_set([keys[0]], [pages.value(keys[0], 1)]) == [False]
            assert time.monotonic() - started < 5
        assert disk.calls == 10  # one attempt per batch: the rest of a batch is not tried
        assert len(_warnings(caplog)) == 1, _warnings(caplog)
        assert os.strerror(err) in _warnings(caplog)[0]
        assert tier.batch_get(keys[:3]) == [values[0], values[1], None]
        assert tier.batch_exists(keys) == 2
        assert _temps(tmp_path) == []
        assert tier.stats()["failed_writes"] == 10 and tier.stats()["num_pages"] == 2
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):  # the fault is gone: writes work again
        assert tier.batch_set(keys[2:], values[2:]) == [True] * 4
    assert any("work again" in r.getMessage() for r in caplog.records)
    assert tier.batch_exists(keys) == 6
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger=LOGGER):
        _FaultyDisk(m, tmp_path, err, mode)
        caplog.clear()
        assert tier.batch_set([keys[0]], [values[0]]) == [False]
        assert len(_warnings(caplog)) == 1  # a new episode warns again
    tier.close()


# ------------------------------------------------- several servers, one directory
def test_another_server_removes_a_page_between_exists_and_get(tmp_path):
    ctx = cc.make_context("file", {"storage_dir": str(tmp_path)})
    pages = cc.Pages(ctx)
    keys, values = pages.chain(3)
    a, b = make(ctx), make(ctx)
    assert all(a.batch_set(keys, values))
    assert b.batch_exists(keys) == 3 and b.stats()["num_pages"] == 3  # b learns a's pages
    os.unlink(tmp_path / keys[1][:2] / f"{keys[1]}.kv")  # a's eviction, or a third server's
    assert b.batch_get(keys) == [values[0], None, values[2]]
    assert b.stats()["num_pages"] == 2 and b.stats()["failed_reads"] == 0
    assert a.batch_exists(keys) == 1
    a.close()
    b.close()


def test_a_page_that_cannot_be_read_is_a_miss(tmp_path):
    ctx = cc.make_context("file", {"storage_dir": str(tmp_path)})
    pages = cc.Pages(ctx)
    keys, values = pages.chain(2)
    tier = make(ctx)
    (tmp_path / keys[0][:2]).mkdir(exist_ok=True)
    (tmp_path / keys[0][:2] / f"{keys[0]}.kv").mkdir()  # something that is no readable file
    assert tier.batch_set(keys[1:], values[1:]) == [True]
    assert tier.batch_get(keys) == [None, values[1]]
    assert tier.batch_exists(keys) == 0
    assert tier.stats()["failed_reads"] == 1
    tier.close()


def test_clear_drops_pages_of_every_instance(tmp_path):
    ctx = cc.make_context("file", {"storage_dir": str(tmp_path)})
    pages = cc.Pages(ctx)
    keys, values = pages.chain(4)
    a, b = make(ctx), make(ctx)
    assert all(a.batch_set(keys[:2], values[:2])) and all(b.batch_set(keys[2:], values[2:]))
    a.clear()
    assert b.batch_exists(keys[2:]) == 0 and _files(tmp_path) == []
    a.close()
    b.close()


def test_calls_after_close_raise(tmp_path):
    tier = FileTier(tmp_path)
    tier.close()
    tier.close()
    with pytest.raises(RuntimeError, match="closed"):
        tier.batch_get(["ab" * 32])

"""The ``file`` storage tier: one file per KV page under a directory.

Layout: ``<storage_dir>/<key[:2]>/<key>.kv``, 256 fan-out directories by the first two
hex digits of the key, so no directory grows past a few thousand files on a large SSD.

Invariants:

* A page file is whole or absent. Writes go to a temporary file in the page's own
  directory (``.tmp-<host>-<pid>-<instance>.<n>``) and are renamed over the page (``os.replace``,
  atomic on POSIX file systems); a failed write removes its temporary file. Temporary
  files of a crashed writer (a dead pid on this host, or older than
  :data:`STALE_TEMP_SECONDS`) are removed at open. There is no fsync: a page torn by a
  power loss fails the core's checksum and is recomputed.
* ``_index`` holds the pages this instance knows, least recently used first, with their
  sizes; ``_total`` is the sum. It is rebuilt at open from the directory, ordered by
  modification time, and a read bumps a page's time (``os.utime``), so recency survives a
  restart. With ``storage_size`` set, a write first drops least recently used pages until
  the new one fits.
* Several servers may share a directory. Each keeps its own index: pages another server
  wrote enter it when this one sees them, and a page another server removed reads as
  missing. The size bound is then kept by each server over the pages it knows.
* Storage faults never raise: a read that fails is a miss (``None``), a write that fails
  is ``False`` and stops the rest of its batch (later pages of a prefix are useless
  without the earlier ones). The first failure logs one warning; it is logged again only
  after a write has succeeded in between.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import socket
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from radixserve.plugin_api import ConfigError
from radixserve.plugin_api.cache import CacheTier, CacheTierContext

logger = logging.getLogger(__name__)

PAGE_SUFFIX = ".kv"
TEMP_PREFIX = ".tmp-"
STALE_TEMP_SECONDS = 600.0  # a temporary file this old is a crashed writer's, whoever wrote it
_KEY = re.compile(r"[0-9a-f]{4,128}\Z")
_FANOUT = re.compile(r"[0-9a-f]{2}\Z")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: Any) -> int | None:
    """``storage_size`` as bytes: an integer, or a string such as ``"200GB"`` or ``"64GiB"``;
    ``None`` or 0 means unbounded."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"--hicache-storage-size: expected a number of bytes, got {value!r}")
    if isinstance(value, (int, float)):
        size = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"--hicache-storage-size (storage_size): expected bytes such as 10000000000, "
                              f"'10GB' or '64GiB', got {value!r}")
        size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if size < 0 or size != size:
        raise ConfigError(f"--hicache-storage-size must be >= 0 bytes, got {value!r}")
    return int(size) or None


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


class FileTier(CacheTier):
    """KV pages as files under ``storage_dir``, at most ``storage_size`` bytes of them."""

    def __init__(self, storage_dir: str | os.PathLike, storage_size: int | None = None) -> None:
        self.root = os.path.abspath(os.fspath(storage_dir))
        self.capacity = storage_size or 0  # 0: unbounded
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._total = 0
        self._host = _host_tag()
        self._temp_tag = f"{TEMP_PREFIX}{self._host}-{os.getpid()}-{os.urandom(3).hex()}."
        self._temp_ids = itertools.count()
        self._made_dirs: set[str] = set()
        self._failing = False  # a write failed and none has succeeded since (one warning per episode)
        self._closed = False
        self.num_evicted = 0
        self.num_failed_writes = 0
        self.num_failed_reads = 0
        self.num_removed_temp = 0
        self._open()

    @classmethod
    def from_context(cls, ctx: CacheTierContext) -> FileTier:
        """The registered factory: ``storage_dir`` and ``storage_size`` from
        ``ctx.extra_config`` (``--hicache-storage-dir``, ``--hicache-storage-size`` or the
        same keys in ``--hicache-storage-backend-extra-config``)."""
        storage_dir = ctx.extra_config.get("storage_dir")
        if not storage_dir:
            raise ConfigError("--hicache-storage-backend file needs a directory: pass --hicache-storage-dir PATH "
                              "(or \"storage_dir\" in --hicache-storage-backend-extra-config)")
        return cls(storage_dir, parse_size(ctx.extra_config.get("storage_size")))

    # ------------------------------------------------------------------ open
    def _open(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--hicache-storage-dir {self.root}: cannot create the directory ({e}); "
                              "give a writable path") from e
        if not os.path.isdir(self.root):
            raise ConfigError(f"--hicache-storage-dir {self.root} is not a directory")
        found: list[tuple[int, str, int]] = []  # (mtime_ns, key, bytes)
        now = time.time()
        for sub in self._fanout_dirs():
            try:
                entries = list(os.scandir(sub))
            except OSError:
                continue
            for entry in entries:
                name = entry.name
                try:
                    if name.startswith(TEMP_PREFIX):
                        if self._is_stale_temp(name, entry.stat().st_mtime, now):
                            os.unlink(entry.path)
                            self.num_removed_temp += 1
                    elif name.endswith(PAGE_SUFFIX) and _KEY.match(name[:-len(PAGE_SUFFIX)]) and entry.is_file():
                        st = entry.stat()
                        found.append((st.st_mtime_ns, name[:-len(PAGE_SUFFIX)], st.st_size))
                except OSError:  # gone meanwhile, or a read-only directory: leave it
                    continue
        for _, key, size in sorted(found):
            self._index[key] = size
            self._total += size
        if self.num_removed_temp:
            logger.info("HiCache file tier %s: removed %d temporary files left by crashed writers",
                        self.root, self.num_removed_temp)
        if self.capacity and self._total > self.capacity:
            with self._lock:
                self._make_room(0)
        logger.info("HiCache file tier %s: %d pages, %d bytes%s", self.root, len(self._index), self._total,
                    f" of {self.capacity}" if self.capacity else "")

    def _fanout_dirs(self) -> list[str]:
        try:
            return [e.path for e in os.scandir(self.root) if _FANOUT.match(e.name) and e.is_dir()]
        except OSError:
            return []

    def _is_stale_temp(self, name: str, mtime: float, now: float) -> bool:
        if now - mtime > STALE_TEMP_SECONDS:
            return True
        parts = name[len(TEMP_PREFIX):].split("-")
        if len(parts) == 3 and parts[0] == self._host and parts[1].isdigit():
            return not _pid_alive(int(parts[1]))
        return False  # another host's, recent: it may be writing right now

    # ----------------------------------------------------------------- paths
    def _path(self, key: str) -> str:
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"a page key must be lower-case hex (4 to 128 digits), got {key!r}")
        return os.path.join(self.root, key[:2], key + PAGE_SUFFIX)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"HiCache file tier {self.root} is closed")

    # ------------------------------------------------------------- contract
    def batch_exists(self, keys: Sequence[str]) -> int:
        self._check_open()
        with self._lock:
            for n, key in enumerate(keys):
                path = self._path(key)
                try:
                    st = os.stat(path)
                except OSError:
                    st = None
                if st is None or not stat.S_ISREG(st.st_mode):
                    self._forget(key)
                    return n
                size = st.st_size
                if key not in self._index:  # another server's page
                    self._index[key] = size
                    self._total += size
            return len(keys)

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        self._check_open()
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                path = self._path(key)
                try:
                    with open(path, "rb", buffering=0) as f:
                        data = f.read()
                except FileNotFoundError:  # never stored, or removed by another server meanwhile
                    self._forget(key)
                    out.append(None)
                    continue
                except OSError as e:
                    self.num_failed_reads += 1
                    logger.debug("HiCache file tier: cannot read %s: %s", path, e)
                    out.append(None)
                    continue
                try:  # recency for the index rebuilt at the next open (ns: coarse clocks tie)
                    now = time.time_ns()
                    os.utime(path, ns=(now, now))
                except OSError:
                    pass
                self._forget(key)
                self._index[key] = len(data)
                self._total += len(data)
                out.append(data)
        return out

    def batch_set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        self._check_open()
        if len(keys) != len(values):
            raise ValueError(f"batch_set: {len(keys)} keys but {len(values)} values")
        out = [False] * len(keys)
        with self._lock:
            for i, (key, value) in enumerate(zip(keys, values)):
                path = self._path(key)
                size = len(value)
                if self.capacity and size > self.capacity:
                    self._write_failed(path, f"a page of {size} bytes is larger than storage_size {self.capacity}")
                    break
                old = self._index.pop(key, None)
                if old is not None:
                    self._total -= old
                if self.capacity:
                    self._make_room(size)
                try:
                    self._write(path, value)
                except OSError as e:
                    if old is not None and os.path.exists(path):  # the old page is still there
                        self._index[key] = old
                        self._total += old
                    self._write_failed(path, e)
                    break
                self._index[key] = size
                self._total += size
                out[i] = True
                if self._failing:
                    self._failing = False
                    logger.info("HiCache file tier %s: writes work again", self.root)
        return out

    def clear(self) -> None:
        self._check_open()
        with self._lock:
            for sub in self._fanout_dirs():
                try:
                    names = os.listdir(sub)
                except OSError:
                    continue
                for name in names:
                    if name.endswith(PAGE_SUFFIX):
                        try:
                            os.unlink(os.path.join(sub, name))
                        except FileNotFoundError:
                            pass
            self._index.clear()
            self._total = 0

    def stats(self) -> dict[str, int | float]:
        # without the lock: get_stats() must not wait behind a batch of file I/O
        return {"bytes": self._total, "num_pages": len(self._index), "capacity_bytes": self.capacity,
                "evicted_pages": self.num_evicted, "failed_writes": self.num_failed_writes,
                "failed_reads": self.num_failed_reads}

    def close(self) -> None:
        self._closed = True

    # -------------------------------------------------------------- helpers
    def _forget(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._total -= size

    def _make_room(self, size: int) -> None:
        """Drop least recently used pages until ``size`` more bytes fit (lock held)."""
        while self._index and self._total + size > self.capacity:
            key, old = self._index.popitem(last=False)
            self._total -= old
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                pass
            except OSError as e:  # a read-only directory: the write that follows fails too
                logger.debug("HiCache file tier: cannot remove %s: %s", key, e)
                continue
            self.num_evicted += 1

    def _write(self, path: str, value: bytes) -> None:
        """``value`` into ``path`` whole or not at all."""
        sub = os.path.dirname(path)
        if sub not in self._made_dirs:
            os.makedirs(sub, exist_ok=True)
            self._made_dirs.add(sub)
        tmp = os.path.join(sub, f"{self._temp_tag}{next(self._temp_ids)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileNotFoundError:  # the fan-out directory was removed under us
            self._made_dirs.discard(sub)
            os.makedirs(sub, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            try:
                view = memoryview(value)
                while view:
                    written = os.write(fd, view)
                    if written <= 0:
                        raise OSError(errno.EIO, "short write")
                    view = view[written:]
                if os.utime in os.supports_fd:  # exact write order for the index rebuilt at open
                    now = time.time_ns()
                    os.utime(fd, ns=(now, now))
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _write_failed(self, path: str, reason: Any) -> None:
        self.num_failed_writes += 1
        if not self._failing:
            self._failing = True
            logger.warning("HiCache file tier %s: cannot store pages (%s); the engine recomputes what it "
                           "cannot find, and this is logged again only after a write has worked",
                           self.root, reason)
        else:
            logger.debug("HiCache file tier: cannot write %s: %s", path, reason)

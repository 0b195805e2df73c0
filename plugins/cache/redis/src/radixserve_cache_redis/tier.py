"""The ``redis`` storage tier: KV pages as Redis string values, shared by every server
that points at the same Redis (or Valkey) database.

Options, from ``ctx.extra_config`` (``--hicache-storage-url`` fills ``url``, the rest come
from ``--hicache-storage-backend-extra-config``):

* ``url``: ``redis://[user:password@]HOST:PORT/DB``, ``rediss://`` for TLS or
  ``unix:///path/redis.sock?db=N`` (default ``redis://127.0.0.1:6379/0``); messages and
  logs show it with its credentials redacted (``redis://***@HOST:PORT/DB``);
* ``password_file``: a file whose first line is the Redis password, used when ``url`` has
  none; else the environment variable ``RADIXSERVE_REDIS_PASSWORD``. Either keeps the
  password off the command line, where ``ps`` shows it;
* ``key_prefix``: prepended to every page key (default ``radixserve:kv:``); ``clear()``
  removes only keys under it;
* ``ttl_seconds``: expire pages that long after they were written (default: never);
* ``connect_timeout_seconds`` (default 0.5) and ``timeout_seconds`` (default 1.0): a
  Redis that is down or stalled makes a call fail within about that long, never hang;
* ``retry_interval_seconds`` (default 5): after a connection failure, calls answer
  "miss" / "not stored" at once for that long before trying Redis again.

The size bound is Redis's own: run it with ``maxmemory`` and ``maxmemory-policy
allkeys-lru`` so it drops the least recently used pages itself (under ``noeviction`` a full
Redis refuses writes, which this tier reports as not stored).

Failures never raise into the core: a call that cannot reach Redis, or a command Redis
refuses, answers "missing" (0 / ``None``) or "not stored" (``False``). The first failure
logs one warning; it is logged again only after Redis has answered in between.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from radixserve.plugin_api import ConfigError, read_key_file, redact_url
from radixserve.plugin_api.cache import CacheTier, CacheTierContext

logger = logging.getLogger(__name__)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
PASSWORD_ENV = "RADIXSERVE_REDIS_PASSWORD"
DEFAULT_KEY_PREFIX = "radixserve:kv:"
DEFAULT_CONNECT_TIMEOUT = 0.5
DEFAULT_TIMEOUT = 1.0
DEFAULT_RETRY_INTERVAL = 5.0
CLEAR_BATCH = 1000


def _seconds(extra: dict[str, Any], name: str, default: float | None, *, positive: bool = True) -> float | None:
    value = extra.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (positive and value == 0):
        raise ConfigError(f"--hicache-storage-backend-extra-config: {name} must be a number of seconds "
                          f"{'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _password(extra: dict[str, Any]) -> str | None:
    """The password from ``password_file`` or the environment (None: the URL's, or none)."""
    path = extra.get("password_file")
    if path is None:
        return os.environ.get(PASSWORD_ENV) or None
    password = read_key_file(path, "--hicache-storage-backend-extra-config: password_file")
    return password


class RedisTier(CacheTier):
    """KV pages under ``key_prefix + key`` in one Redis database."""

    def __init__(self, url: str = DEFAULT_URL, *, key_prefix: str = DEFAULT_KEY_PREFIX,
                 ttl_seconds: float | None = None, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 timeout: float = DEFAULT_TIMEOUT, retry_interval: float = DEFAULT_RETRY_INTERVAL,
                 password: str | None = None) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = redact_url(url)  # for messages: never the password
        self.prefix = key_prefix
        self.ttl_ms = int(ttl_seconds * 1000) if ttl_seconds else None
        self.retry_interval = retry_interval
        self._errors = (redis.RedisError, OSError)
        try:
            # No retries inside the client: one attempt, bounded by the timeouts; the tier
            # itself waits retry_interval before trying a Redis that went away.
            # a password in the URL wins over ``password`` (redis-py's rule for from_url)
            self._client = redis.Redis.from_url(
                url, password=password, socket_connect_timeout=connect_timeout, socket_timeout=timeout,
                retry=Retry(NoBackoff(), 0), health_check_interval=0)
        except ValueError as e:
            raise ConfigError(f"--hicache-storage-url {self.url!r}: {redact_url(str(e))} "
                              "(expected redis://HOST:PORT/DB)") from None
        self._lock = threading.Lock()
        self._down_until = 0.0  # monotonic time before which calls do not try Redis
        self._unreachable = False  # a call failed and none has succeeded since (one warning per episode)
        self._refusing = False  # Redis refused writes and has stored none since
        self._closed = False
        self.num_failed_calls = 0
        self.num_refused_writes = 0
        self.num_skipped_calls = 0

    @classmethod
    def from_context(cls, ctx: CacheTierContext) -> RedisTier:
        """The registered factory (options in the module docstring)."""
        extra = ctx.extra_config
        url = extra.get("url") or DEFAULT_URL
        prefix = extra.get("key_prefix", DEFAULT_KEY_PREFIX)
        if not isinstance(url, str) or not isinstance(prefix, str):
            raise ConfigError(f"--hicache-storage-url / key_prefix must be strings, got {url!r} / {prefix!r}")
        return cls(url, key_prefix=prefix, ttl_seconds=_seconds(extra, "ttl_seconds", None),
                   connect_timeout=_seconds(extra, "connect_timeout_seconds", DEFAULT_CONNECT_TIMEOUT),
                   timeout=_seconds(extra, "timeout_seconds", DEFAULT_TIMEOUT),
                   retry_interval=_seconds(extra, "retry_interval_seconds", DEFAULT_RETRY_INTERVAL,
                                           positive=False),
                   password=_password(extra))

    # ------------------------------------------------------------- contract
    def batch_exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0

        def run():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.prefix + key)
            return pipe.execute()

        found = self._call("exists", run)
        if found is None:
            return 0
        for n, hit in enumerate(found):
            if not hit:
                return n
        return len(keys)

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        values = self._call("get", lambda: self._client.mget([self.prefix + k for k in keys]))
        if values is None:
            return [None] * len(keys)
        return [v if isinstance(v, bytes) else None for v in values]

    def batch_set(self, keys: Sequence[str], values: Sequence[bytes]) -> list[bool]:
        if len(keys) != len(values):
            raise ValueError(f"batch_set: {len(keys)} keys but {len(values)} values")
        if not keys:
            return []

        def run():
            pipe = self._client.pipeline(transaction=False)
            for key, value in zip(keys, values):
                pipe.set(self.prefix + key, bytes(value), px=self.ttl_ms)
            return pipe.execute(raise_on_error=False)

        replies = self._call("set", run)
        if replies is None:
            return [False] * len(keys)
        out = [r is True for r in replies]
        refused = [r for r in replies if isinstance(r, Exception)]
        if refused:  # e.g. OOM under maxmemory-policy noeviction
            self.num_refused_writes += len(refused)
            if self._episode("_refusing", True):
                logger.warning("HiCache redis tier %s: Redis refused to store %d of %d pages (%s: %s); "
                               "logged again only after it has stored a page", self.url, len(refused), len(out),
                               type(refused[0]).__name__, redact_url(str(refused[0])))
        elif self._episode("_refusing", False):
            logger.info("HiCache redis tier %s: Redis stores pages again", self.url)
        return out

    def clear(self) -> None:
        def run():
            batch = []
            for name in self._client.scan_iter(match=_glob_escape(self.prefix) + "*", count=CLEAR_BATCH):
                batch.append(name)
                if len(batch) >= CLEAR_BATCH:
                    self._client.unlink(*batch)
                    batch = []
            if batch:
                self._client.unlink(*batch)
            return True

        if self._call("clear", run, skip_when_down=False) is None:
            raise ConnectionError(f"HiCache redis tier {self.url}: clear() could not reach Redis")

    def stats(self) -> dict[str, int | float]:
        return {"failed_calls": self.num_failed_calls, "refused_writes": self.num_refused_writes,
                "skipped_calls": self.num_skipped_calls, "is_up": int(not self._unreachable)}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._client.close()
            except self._errors:
                pass

    # -------------------------------------------------------------- helpers
    def _call(self, what: str, fn, *, skip_when_down: bool = True):
        """``fn()``, or ``None`` when Redis cannot be reached (logged once per episode)."""
        if self._closed:
            raise RuntimeError(f"HiCache redis tier {self.url} is closed")
        if skip_when_down and time.monotonic() < self._down_until:
            self.num_skipped_calls += 1
            return None
        try:
            result = fn()
        except self._errors as e:
            self.num_failed_calls += 1
            self._down_until = time.monotonic() + self.retry_interval
            if self._episode("_unreachable", True):
                logger.warning("HiCache redis tier %s: %s failed (%s: %s); the engine recomputes what it "
                               "cannot load, and this is logged again only after Redis has answered",
                               self.url, what, type(e).__name__, redact_url(str(e)))
            else:
                logger.debug("HiCache redis tier %s: %s failed: %s", self.url, what, redact_url(str(e)))
            return None
        if self._episode("_unreachable", False):
            logger.info("HiCache redis tier %s: Redis answers again", self.url)
        return result

    def _episode(self, flag: str, state: bool) -> bool:
        """Set ``flag`` to ``state``; whether it changed (a warning or a recovery to log)."""
        with self._lock:
            changed = getattr(self, flag) != state
            setattr(self, flag, state)
        return changed


def _glob_escape(text: str) -> str:
    """``text`` matched literally in a Redis SCAN MATCH pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)

"""The core's side of a HiCache storage tier: framing and verifying pages, a worker
thread, bounded queued writes, counters, and the measured read rate (:class:`RateMeter`)
that the ``auto`` prefetch policy weighs against recomputing."""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

from radixserve.hicache import (
    CacheTier,
    CacheTierContext,
    PageFormatError,
    TierCounters,
    decode_page,
    encode_page,
    rank_key,
)

logger = logging.getLogger(__name__)

MAX_PENDING_STORE_BYTES = 256 << 20  # storage writes queued beyond this are skipped (counted)
RATE_DECAY = 0.9  # weight of the past in the measured read and prefill rates, per observation


class RateMeter:
    """Seconds per unit (byte, token) of recent work: sums of units and seconds, the past
    decaying by RATE_DECAY per observation, so large transfers and steps weigh most."""

    def __init__(self) -> None:
        self.units = 0.0
        self.seconds = 0.0

    def observe(self, units: float, seconds: float) -> None:
        if units > 0 and seconds >= 0:
            self.units = self.units * RATE_DECAY + units
            self.seconds = self.seconds * RATE_DECAY + seconds

    def estimate(self, units: float) -> float | None:
        """Seconds for ``units`` at the measured rate (None before any measurement)."""
        return units * self.seconds / self.units if self.units else None


def _per_second(meter: RateMeter) -> float:
    """Units per second measured by ``meter`` (0.0 before any measurement)."""
    return meter.units / meter.seconds if meter.seconds > 0 else 0.0


class StorageWorker:
    """One daemon thread running submitted calls in order. Unlike a ThreadPoolExecutor's
    worker it is not joined at interpreter exit, so a tier stuck in a write cannot hold the
    engine process past its shutdown timeout."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn, args = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                    fut.set_exception(e)

    def shutdown(self) -> None:
        """Cancel what has not started; the thread ends after the call it runs (if any)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        self._jobs.put(None)


class StorageIO:
    """The core's side of a storage tier: framing, verification, a worker thread, counters
    and warnings that never repeat more than once a minute."""

    def __init__(self, tier: CacheTier, ctx: CacheTierContext, name: str, payload_bytes: int, *, mac: bytes,
                 close_timeout: float, key_tag: str = "") -> None:
        self.tier, self.ctx, self.name = tier, ctx, name
        self.key_tag = key_tag  # tensor parallelism: this rank's pages go under keys of their own
        self.salt = ctx.model_key
        self.mac = mac  # the MAC key of every page (radixserve.hicache.mac_key of the storage secret)
        self.close_timeout = close_timeout
        self.payload_bytes = payload_bytes
        self.executor = StorageWorker("radixserve-hicache-storage")
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._pending: list[Future] = []
        self._warned: dict[str, float] = {}
        self.skipped_pages = 0
        self.reads = RateMeter()  # seconds per byte of fetches that found pages

    def estimate_read_seconds(self, num_pages: int) -> float | None:
        """Seconds to fetch ``num_pages`` pages at the measured read rate (None before a
        fetch has found any)."""
        return self.reads.estimate(num_pages * self.payload_bytes)

    def warn(self, what: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._warned.get(what, -1e9) >= 60.0:
            self._warned[what] = now
            logger.warning("HiCache storage tier %r: " + message + " (recomputing instead; repeats muted for 60 s)",
                           self.name, *args)

    # ------------------------------------------------------------ reads
    def _keys(self, keys: list[str]) -> list[str]:
        return [rank_key(k, self.key_tag) for k in keys] if self.key_tag else keys

    def submit_fetch(self, keys: list[str]) -> Future:
        return self.executor.submit(self._fetch, self._keys(keys))

    def fetch_now(self, keys: list[str]) -> tuple[list[memoryview], float]:
        """:meth:`submit_fetch` on the calling thread (a follower rank, inside rank 0's call)."""
        return self._fetch(self._keys(keys))

    def _fetch(self, keys: list[str]) -> tuple[list[memoryview], float]:
        t0 = time.monotonic()
        try:
            n = int(self.tier.batch_exists(keys))
            values = self.tier.batch_get(keys[:n]) if n else []
        except Exception as e:  # noqa: BLE001 - a broken tier is a miss
            self.counters.errors += 1
            self.warn("read", "reading failed: %s: %s", type(e).__name__, e)
            return [], time.monotonic() - t0
        out = []
        for key, value in zip(keys, values):
            try:
                out.append(decode_page(self.salt, key, value, self.payload_bytes, mac=self.mac))
            except PageFormatError as e:
                if value is not None:  # gone between exists and get is a plain miss
                    self.counters.errors += 1
                    self.warn("corrupt", "page %s… rejected: %s", key[:12], e)
                break
        seconds = time.monotonic() - t0
        self.reads.observe(len(out) * self.payload_bytes, seconds)
        return out, seconds

    # ----------------------------------------------------------- writes
    def store(self, keys: list[str], payloads: list[bytes]) -> None:
        """Queue a write (called from the I/O thread with payloads already copied)."""
        keys = self._keys(keys)
        size = sum(len(p) for p in payloads)
        with self._lock:
            if self._pending_bytes + size > MAX_PENDING_STORE_BYTES:
                self.skipped_pages += len(keys)
                return
            self._pending_bytes += size
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self.executor.submit(self._store, keys, payloads, size))

    def _store(self, keys: list[str], payloads: list[bytes], size: int) -> None:
        try:
            values = [encode_page(self.salt, k, p, mac=self.mac) for k, p in zip(keys, payloads)]
            ok = self.tier.batch_set(keys, values)
            stored = sum(1 for x in ok if x)
            self.counters.store_pages += stored
            self.counters.store_bytes += sum(len(v) for v, x in zip(values, ok) if x)
            if stored < len(keys):
                self.counters.errors += len(keys) - stored
                self.warn("write", "%d of %d pages not stored", len(keys) - stored, len(keys))
        except Exception as e:  # noqa: BLE001 - a broken tier loses the write, nothing else
            self.counters.errors += 1
            self.warn("write", "writing failed: %s: %s", type(e).__name__, e)
        finally:
            with self._lock:
                self._pending_bytes -= size

    def flush(self, timeout: float) -> bool:
        with self._lock:
            pending = list(self._pending)
        done, not_done = wait_futures(pending, timeout=timeout)
        return not not_done

    def close(self) -> None:
        """Let queued writes land for up to ``close_timeout`` seconds
        (``--hicache-storage-shutdown-timeout``), drop the rest, close the tier."""
        if not self.flush(self.close_timeout):
            with self._lock:
                dropped = sum(1 for f in self._pending if not f.done())
            logger.warning("HiCache storage tier %r: %d queued writes did not finish within "
                           "--hicache-storage-shutdown-timeout %g s; dropped", self.name, dropped, self.close_timeout)
        self.executor.shutdown()
        try:
            self.tier.close()
        except Exception:  # noqa: BLE001
            logger.exception("HiCache storage tier %r: close() raised", self.name)

"""The core's side of a HiCache storage tier: framing and verifying pages, a worker
thread, bounded queued writes, counters, and the measured read rate (:class:`RateMeter`)
that the ``auto`` prefetch policy weighs against recomputing."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from radixserve.hicache import (
    CacheTier,
    CacheTierContext,
    PageFormatError,
    TierCounters,
    decode_page,
    encode_page,
)

logger = logging.getLogger(__name__)

MAX_PENDING_STORE_BYTES = 256 << 20  # storage writes queued beyond this are skipped (counted)
CLOSE_FLUSH_SECONDS = 60.0
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


class StorageIO:
    """The core's side of a storage tier: framing, verification, a worker thread, counters
    and warnings that never repeat more than once a minute."""

    def __init__(self, tier: CacheTier, ctx: CacheTierContext, name: str, payload_bytes: int) -> None:
        self.tier, self.ctx, self.name = tier, ctx, name
        self.salt = ctx.model_key
        self.payload_bytes = payload_bytes
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="radixserve-hicache-storage")
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
    def submit_fetch(self, keys: list[str]) -> Future:
        return self.executor.submit(self._fetch, keys)

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
                out.append(decode_page(self.salt, key, value, self.payload_bytes))
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
            values = [encode_page(self.salt, k, p) for k, p in zip(keys, payloads)]
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
        if not self.flush(CLOSE_FLUSH_SECONDS):
            logger.warning("HiCache storage tier %r: pending writes did not finish in %.0f s; dropped",
                           self.name, CLOSE_FLUSH_SECONDS)
        self.executor.shutdown(wait=False, cancel_futures=True)
        try:
            self.tier.close()
        except Exception:  # noqa: BLE001
            logger.exception("HiCache storage tier %r: close() raised", self.name)

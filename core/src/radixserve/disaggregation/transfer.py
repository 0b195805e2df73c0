"""The KV transfer engine contract (plugin kind ``kv_transfer``, hook
``register_kv_transfer_backends``).

A transfer engine moves bytes from memory registered on one server rank into memory
registered on another rank, usually on another machine: the prefill server's KV pages into
the pages a decode server set aside for the same request. It knows nothing of pages,
requests or models; the core computes every segment (source address, destination address,
length) from both pools' layouts, checks the bytes end to end (a checksum per request), and
carries the control messages (which pages, done, failed) over its own bootstrap channel. A
transport therefore provides four things:

* ``address()``: the endpoint a peer passes to :meth:`TransferEngine.connect` (one per
  rank: with tensor parallelism on both sides, rank ``r`` of the prefill server writes to
  rank ``r``'s engine of the decode server, its own heads' pages);
* ``register_regions(regions)``: the memory a peer may write into (receiving side) or that
  this side reads from (sending side), as ``(base address, bytes)`` pairs, before any
  transfer; a write outside the receiver's registered regions must fail, never land;
* ``connect(peer)``: the handshake with a peer's address (idempotent; the first
  ``submit_write`` to a peer may also do it);
* ``submit_write(peer, src, dst, lengths) -> handle`` and ``poll(handle)``: an asynchronous
  write of ``lengths[i]`` bytes from local ``src[i]`` to the peer's ``dst[i]``, and its state:
  :data:`PENDING`, :data:`DONE` (every byte is in the peer's memory) or :data:`FAILED`. A
  write that cannot finish within the context's ``timeout`` (peer gone, network down) must
  become FAILED by then, never stay PENDING.

Threads: the core calls an engine from its scheduler thread and from a transfer worker
thread; an engine is built on the main thread. ``close()`` releases sockets and threads;
writes still in flight become FAILED.
"""

from __future__ import annotations

import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PENDING, DONE, FAILED = "pending", "done", "failed"
ROLES = ("prefill", "decode")


class TransferError(RuntimeError):
    """A transfer engine could not start, register memory or reach a peer."""


@dataclass
class TransferContext:
    """What a transfer engine is built from."""

    role: str  # "prefill" (writes pages) or "decode" (receives them)
    host: str = "127.0.0.1"  # the address peers reach this rank at
    ib_device: str | None = None  # --disaggregation-ib-device: the RDMA NIC(s); None over TCP
    tp_rank: int = 0
    tp_size: int = 1
    timeout: float = 30.0  # seconds a write may take before it must be FAILED
    extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"transfer role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if not self.timeout > 0:
            raise ValueError(f"transfer timeout must be positive, got {self.timeout!r}")

    def listen_port(self) -> int:
        """The port ``extra_config["port"]`` asks this rank to listen at: rank ``r`` of a server
        takes that port + ``r`` (every rank runs its own engine); 0 when none is given (any free port)."""
        port = int(self.extra_config.get("port") or 0)
        return port + self.tp_rank if port else 0


class TransferEngine(ABC):
    """One per server rank; see the module docstring for the contract."""

    name = ""

    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def address(self) -> str:
        """This rank's endpoint, as a peer passes it to :meth:`connect`."""

    @abstractmethod
    def register_regions(self, regions: Sequence[tuple[int, int]]) -> None:
        """Memory peers may write into, or that writes read from: ``(address, bytes)`` pairs."""

    @abstractmethod
    def connect(self, peer: str) -> None:
        """Handshake with ``peer`` (an :meth:`address` of another engine); raises
        :class:`TransferError` when it cannot be reached within the timeout."""

    @abstractmethod
    def submit_write(self, peer: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> int:
        """Start writing ``lengths[i]`` bytes from local ``src[i]`` to ``peer``'s ``dst[i]``;
        returns a handle for :meth:`poll`. May raise :class:`TransferError` at once."""

    @abstractmethod
    def poll(self, handle: int) -> str:
        """:data:`PENDING`, :data:`DONE` or :data:`FAILED` (once DONE or FAILED, it stays)."""

    def wait(self, handle: int, timeout: float | None = None) -> str:
        """Poll ``handle`` until it is DONE or FAILED, or ``timeout`` seconds (default the
        context's) pass; returns the last state."""
        deadline = time.monotonic() + (self.ctx.timeout if timeout is None else timeout)
        delay = 0.0002
        while True:
            state = self.poll(handle)
            if state != PENDING or time.monotonic() >= deadline:
                return state
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def stats(self) -> dict[str, int | float]:
        """Numbers for ``get_stats()`` (bytes written, transfers, failures, ...)."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Release sockets and threads; writes in flight become FAILED. Idempotent."""


class WriteBook:
    """The writes an engine has handed out: handle -> (the transport's own job, start time,
    state, bytes), and the counters ``stats()`` reports. Engines call :meth:`poll` with a
    function that reads a PENDING job's state; a write past the timeout is FAILED, and an
    ended write drops its job (``release(job)`` lets the transport free it)."""

    def __init__(self, timeout: float, release=None) -> None:
        self.timeout = timeout
        self.release = release
        self.lock = threading.Lock()
        self._ids = itertools.count(1)
        self._writes: dict[int, list] = {}
        self.counts = {"bytes_written": 0, "writes": 0, "failed": 0}

    def add(self, job: Any, nbytes: int, state: str = PENDING) -> int:
        handle = next(self._ids)
        with self.lock:
            self._writes[handle] = [job, time.monotonic(), PENDING, nbytes]
            if state != PENDING:
                self._end(handle, state)
        return handle

    def poll(self, handle: int, state_of) -> str:
        """The write's state; ``state_of(job)`` reads a pending one (PENDING, DONE or FAILED)."""
        with self.lock:
            job, started, state, _ = self._writes[handle]
            if state != PENDING:
                return state
            state = state_of(job)
            if state == PENDING and time.monotonic() - started > self.timeout:
                state = FAILED
            if state != PENDING:
                self._end(handle, state)
            return state

    def _end(self, handle: int, state: str) -> None:
        entry = self._writes[handle]
        job, entry[0], entry[2] = entry[0], None, state
        if job is not None and self.release is not None:
            self.release(job)
        self.counts["writes" if state == DONE else "failed"] += 1
        if state == DONE:
            self.counts["bytes_written"] += entry[3]


def coalesce(src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Merge segments that continue the previous one on both sides (consecutive pages of one
    layer usually do), dropping empty ones; the bytes moved are the same."""
    out_s: list[int] = []
    out_d: list[int] = []
    out_n: list[int] = []
    for s, d, n in zip(src, dst, lengths, strict=True):
        if n <= 0:
            continue
        if out_n and out_s[-1] + out_n[-1] == s and out_d[-1] + out_n[-1] == d:
            out_n[-1] += n
        else:
            out_s.append(s)
            out_d.append(d)
            out_n.append(n)
    return out_s, out_d, out_n

"""What both sides share: registered memory, views of raw addresses as tensors, process
group construction, and the message tags and control words of the wire protocol."""

from __future__ import annotations

import bisect
import ctypes
import queue
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from radixserve.plugin_api.disaggregation import TransferContext, TransferError

# Tags of the messages on a pair's process group (rank 0 sends, rank 1 receives).
TAG_HEADER, TAG_VERDICT, TAG_PAYLOAD, TAG_ACK = 1, 2, 3, 4
PAIRS_QUEUE = "pairs"  # the receiver's store queue that announces new pairs
CLOSE = "close"  # pushed by a closing receiver onto its own queues to wake its threads
BYE = "bye"  # pushed by a closing sender onto its pair's queue
MAX_SEGMENTS = 1 << 22  # a write announcing more segments is a protocol error
FOREVER = timedelta(days=3650)  # the idle wait of a receiver thread (woken by CLOSE)


class Regions:
    """Registered memory as disjoint, sorted ``[start, end)`` intervals (overlapping or
    touching registrations merge); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, regions: Sequence[tuple[int, int]]) -> None:
        new = []
        for entry in regions:
            try:
                base, size = (int(v) for v in entry)
            except (TypeError, ValueError) as e:
                raise TransferError(f"a region must be an (address, bytes) pair, got {entry!r}") from e
            if base <= 0 or size < 0:
                raise TransferError(f"invalid region (address {base:#x}, {size} bytes)")
            if size:
                new.append((base, base + size))
        with self._lock:
            merged: list[tuple[int, int]] = []
            for start, end in sorted([*zip(self._starts, self._ends), *new]):
                if merged and start <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], end))
                else:
                    merged.append((start, end))
            self._starts = [s for s, _ in merged]
            self._ends = [e for _, e in merged]

    def covers(self, addresses: Sequence[int], lengths: Sequence[int]) -> bool:
        """Whether every ``[address, address + length)`` (length > 0) lies inside one region."""
        with self._lock:
            starts, ends = self._starts, self._ends
        for a, n in zip(addresses, lengths):
            if n <= 0:
                return False
            i = bisect.bisect_right(starts, a) - 1
            if i < 0 or a + n > ends[i]:
                return False
        return True

    def __bool__(self) -> bool:
        return bool(self._starts)


def view(address: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of process memory at ``address`` as a uint8 tensor (no copy)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


class Staging:
    """A reusable host buffer for gathering or scattering several segments."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(max(nbytes, 2 * self._buf.numel()), dtype=torch.uint8)
        return self._buf[:nbytes]

    def gather(self, src: Sequence[int], lengths: Sequence[int], total: int) -> torch.Tensor:
        if len(src) == 1:
            return view(src[0], total)
        out = self.get(total)
        base, offset = out.data_ptr(), 0
        for s, n in zip(src, lengths):
            ctypes.memmove(base + offset, s, n)
            offset += n
        return out

    @staticmethod
    def scatter(buf: torch.Tensor, dst: Sequence[int], lengths: Sequence[int]) -> None:
        base, offset = buf.data_ptr(), 0
        for d, n in zip(dst, lengths):
            ctypes.memmove(d, base + offset, n)
            offset += n


def seconds(value: float) -> timedelta:
    """A positive timedelta (``timedelta(0)`` means "the default timeout" to c10d)."""
    return timedelta(seconds=max(value, 0.001))


def new_group(store: dist.Store, prefix: str, rank: int, ctx: TransferContext, timeout: float) -> dist.ProcessGroup:
    """This side (rank 0 sends, rank 1 receives) of a pair's 2-rank gloo process group."""
    pstore = dist.PrefixStore(prefix, store)
    interface = str(ctx.extra_config.get("gloo_interface") or "")
    device = (dist.ProcessGroupGloo.create_device(interface=interface) if interface
              else dist.ProcessGroupGloo.create_device(hostname=ctx.host))
    options = dist.ProcessGroupGloo._Options()
    options._devices = [device]
    options._timeout = seconds(timeout)
    return dist.ProcessGroupGloo(pstore, rank, 2, options)


def wait(work, deadline_left: float) -> None:
    """Wait for a gloo work item at most ``deadline_left`` seconds (at least a millisecond, so
    that gloo itself times the operation out); raises on failure or timeout. Gloo closes the
    pair's connection on a timeout, failing every other operation posted on it: the pair is
    dropped afterwards."""
    work.wait(seconds(deadline_left))


def hedged(make, timeout: float, stagger: float = 0.4):
    """``make()``, started again every ``stagger`` seconds while no attempt has finished, up
    to ``timeout``: the first attempt to succeed wins (later winners are dropped).

    c10d formats a new connection's peer address with a reverse name lookup; where the name
    server is slow or drops queries, opening a ``TCPStore`` connection (a server, a client, a
    ``clone()``) then stalls for the resolver's timeout (5 s by default) now and then.
    Hedging the open keeps those stalls out of a write's time budget."""
    results: queue.SimpleQueue = queue.SimpleQueue()

    def attempt() -> None:
        try:
            results.put((True, make()))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            results.put((False, e))

    def start() -> None:
        threading.Thread(target=attempt, daemon=True, name="torch_dist-open").start()

    deadline = time.monotonic() + timeout
    start()
    pending = 1
    while True:
        left = deadline - time.monotonic()
        try:
            ok, value = results.get(timeout=max(min(stagger, left), 0.001))
        except queue.Empty:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no connection within {timeout:.1f} s") from None
            start()
            pending += 1
            continue
        pending -= 1
        if ok:
            return value
        if pending == 0:  # a failure is not retried: only a stall is
            raise value

"""Conformance suite for KV transfer engines (``kv_transfer``): any ``TransferEngine``, ours
or a third party's. Each check raises AssertionError saying what went wrong::

    from radixserve.testing import kv_transfer_conformance as kc

    def new_context(role, **extra):
        return TransferContext(role=role, timeout=5.0, extra_config=extra)

    def test_conformance():
        kc.run_all(my_factory, new_context)

``make(ctx) -> TransferEngine`` is the engine's factory (what it registers);
``new_context(role, **extra)`` a :class:`~radixserve.disaggregation.transfer.TransferContext`
for a fresh engine of that role on this machine. Two engines of one test live in the same
process here (the suite moves real bytes between their memory, through the transport's own
sockets); the engines of a real pair live in two processes on two machines.

* :func:`check_address`: every engine has its own non-empty string address;
* :func:`check_round_trip`: scattered segments of many lengths land byte-exact, in a
  second registered region too, and nothing outside them changes;
* :func:`check_large`: one 16 MiB segment;
* :func:`check_in_flight`: several writes submitted before any is waited for;
* :func:`check_empty`: a write of no segments is DONE;
* :func:`check_outside_regions`: a write to memory the receiver did not register is FAILED
  and the memory is untouched;
* :func:`check_unreachable_peer`: a peer nobody listens at fails (``TransferError`` or
  FAILED) within the timeout;
* :func:`check_peer_closed`: after the receiver closes, a write fails within the timeout;
* :func:`check_thread`: an engine built on this thread writes from another.
"""

from __future__ import annotations

import ctypes
import random
import socket
import threading
import time
from collections.abc import Callable

from radixserve.disaggregation.transfer import DONE, FAILED, PENDING, TransferContext, TransferEngine, TransferError

Make = Callable[[TransferContext], TransferEngine]
NewContext = Callable[..., TransferContext]


class Buffer:
    """``size`` bytes of process memory at a fixed address, filled with ``fill``."""

    def __init__(self, size: int, fill: int = 0) -> None:
        self.size = size
        self.raw = (ctypes.c_uint8 * size)()
        ctypes.memset(self.raw, fill, size)
        self.address = ctypes.addressof(self.raw)

    def write(self, offset: int, data: bytes) -> None:
        ctypes.memmove(self.address + offset, data, len(data))

    def read(self, offset: int = 0, n: int | None = None) -> bytes:
        return ctypes.string_at(self.address + offset, self.size - offset if n is None else n)


def _pair(make: Make, new_context: NewContext) -> tuple[TransferEngine, TransferEngine]:
    return make(new_context("prefill")), make(new_context("decode"))


def _segments(rng: random.Random, size: int, count: int, max_len: int) -> list[tuple[int, int]]:
    """``count`` disjoint (offset, length) ranges inside ``size`` bytes, gaps between them."""
    out, offset = [], rng.randrange(0, 64)
    for _ in range(count):
        n = rng.randrange(1, max_len + 1)
        if offset + n > size:
            break
        out.append((offset, n))
        offset += n + rng.randrange(1, 256)
    return out


def _finish(engine: TransferEngine, handle: int, timeout: float) -> str:
    state = engine.wait(handle, timeout)
    assert state in (DONE, FAILED, PENDING), f"poll returned {state!r}"
    return state


def check_address(make: Make, new_context: NewContext) -> None:
    a, b = _pair(make, new_context)
    try:
        assert isinstance(a.address(), str) and a.address(), f"address() gave {a.address()!r}"
        assert a.address() != b.address(), "two engines share one address"
    finally:
        a.close()
        b.close()


def check_round_trip(make: Make, new_context: NewContext) -> None:
    sender, receiver = _pair(make, new_context)
    rng = random.Random(0)
    src, dst, dst2 = Buffer(1 << 20), Buffer(1 << 20, fill=0xEE), Buffer(1 << 16, fill=0xEE)
    src.write(0, rng.randbytes(src.size))
    try:
        sender.register_regions([(src.address, src.size)])
        receiver.register_regions([(dst.address, dst.size), (dst2.address, dst2.size)])
        sender.connect(receiver.address())
        sender.connect(receiver.address())  # idempotent
        segs = _segments(rng, dst.size, 200, 9000)
        src_off = [rng.randrange(0, src.size - n) for _, n in segs]
        small = _segments(rng, dst2.size, 20, 300)
        s = [src.address + o for o in src_off] + [src.address + o for o, _ in small]
        d = [dst.address + o for o, _ in segs] + [dst2.address + o for o, _ in small]
        lengths = [n for _, n in segs] + [n for _, n in small]
        handle = sender.submit_write(receiver.address(), s, d, lengths)
        state = _finish(sender, handle, sender.ctx.timeout)
        assert state == DONE, f"a write of {len(lengths)} segments ended {state}"
        assert sender.poll(handle) == DONE, "a DONE handle changed state"
        want, want2 = bytearray(b"\xee" * dst.size), bytearray(b"\xee" * dst2.size)
        data = src.read()
        for (o, n), so in zip(segs, src_off):
            want[o:o + n] = data[so:so + n]
        for o, n in small:
            want2[o:o + n] = data[o:o + n]
        assert dst.read() == bytes(want), "the destination differs from the segments written (or bytes outside changed)"
        assert dst2.read() == bytes(want2), "the second registered region differs"
    finally:
        sender.close()
        receiver.close()


def check_large(make: Make, new_context: NewContext) -> None:
    sender, receiver = _pair(make, new_context)
    size = 16 << 20
    src, dst = Buffer(size), Buffer(size)
    src.write(0, random.Random(1).randbytes(size))
    try:
        sender.register_regions([(src.address, size)])
        receiver.register_regions([(dst.address, size)])
        handle = sender.submit_write(receiver.address(), [src.address], [dst.address], [size])
        assert _finish(sender, handle, sender.ctx.timeout) == DONE, "a 16 MiB write did not finish"
        assert dst.read() == src.read(), "a 16 MiB write differs"
    finally:
        sender.close()
        receiver.close()


def check_in_flight(make: Make, new_context: NewContext) -> None:
    sender, receiver = _pair(make, new_context)
    n, chunk = 8, 64 << 10
    src, dst = Buffer(n * chunk), Buffer(n * chunk)
    src.write(0, random.Random(2).randbytes(n * chunk))
    try:
        sender.register_regions([(src.address, src.size)])
        receiver.register_regions([(dst.address, dst.size)])
        handles = [sender.submit_write(receiver.address(), [src.address + i * chunk],
                                       [dst.address + (n - 1 - i) * chunk], [chunk]) for i in range(n)]
        assert len(set(handles)) == n, "two writes in flight share a handle"
        for h in handles:
            assert _finish(sender, h, sender.ctx.timeout) == DONE, "a write in flight did not finish"
        for i in range(n):
            assert dst.read((n - 1 - i) * chunk, chunk) == src.read(i * chunk, chunk), f"write {i} landed wrong"
    finally:
        sender.close()
        receiver.close()


def check_empty(make: Make, new_context: NewContext) -> None:
    sender, receiver = _pair(make, new_context)
    src, dst = Buffer(4096), Buffer(4096)
    try:
        sender.register_regions([(src.address, src.size)])
        receiver.register_regions([(dst.address, dst.size)])
        handle = sender.submit_write(receiver.address(), [], [], [])
        assert _finish(sender, handle, sender.ctx.timeout) == DONE, "an empty write is not DONE"
    finally:
        sender.close()
        receiver.close()


def check_outside_regions(make: Make, new_context: NewContext) -> None:
    sender, receiver = _pair(make, new_context)
    src, dst, other = Buffer(1 << 16, fill=1), Buffer(1 << 16), Buffer(1 << 16)
    try:
        sender.register_regions([(src.address, src.size)])
        receiver.register_regions([(dst.address, dst.size)])
        for target, n in ((other.address, 4096), (dst.address + dst.size - 100, 200)):
            try:
                handle = sender.submit_write(receiver.address(), [src.address], [target], [n])
            except TransferError:
                continue
            state = _finish(sender, handle, sender.ctx.timeout)
            assert state == FAILED, f"a write outside the receiver's registered memory ended {state}"
        assert other.read() == bytes(other.size), "unregistered memory was written"
        assert dst.read(dst.size - 100) == bytes(100), "a write straddling the region's end landed in part"
    finally:
        sender.close()
        receiver.close()


def _dead_address() -> str:
    with socket.socket() as s:  # a port that was just free: nobody listens there
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _must_fail(sender: TransferEngine, start: Callable[[], int], what: str) -> None:
    """``start()`` (returning a write's handle) raises TransferError or its write is FAILED,
    within the sender's timeout (plus slack)."""
    t0 = time.monotonic()
    try:
        state = _finish(sender, start(), sender.ctx.timeout + 5)
        assert state == FAILED, f"a write to {what} ended {state}"
    except TransferError:
        pass
    took = time.monotonic() - t0
    assert took <= sender.ctx.timeout + 5, f"{what} took {took:.1f} s to fail"


def check_unreachable_peer(make: Make, new_context: NewContext) -> None:
    sender = make(new_context("prefill"))
    src = Buffer(4096)
    try:
        sender.register_regions([(src.address, src.size)])
        peer = _dead_address()

        def start() -> int:
            sender.connect(peer)
            return sender.submit_write(peer, [src.address], [src.address], [1024])

        _must_fail(sender, start, "an unreachable peer")
    finally:
        sender.close()


def check_peer_closed(make: Make, new_context: NewContext) -> None:
    sender, receiver = _pair(make, new_context)
    src, dst = Buffer(1 << 16, fill=3), Buffer(1 << 16)
    try:
        sender.register_regions([(src.address, src.size)])
        receiver.register_regions([(dst.address, dst.size)])
        peer = receiver.address()
        assert _finish(sender, sender.submit_write(peer, [src.address], [dst.address], [512]),
                       sender.ctx.timeout) == DONE, "the first write failed"
        receiver.close()
        _must_fail(sender, lambda: sender.submit_write(peer, [src.address], [dst.address + 512], [512]),
                   "a closed peer")
    finally:
        sender.close()
        receiver.close()


def check_thread(make: Make, new_context: NewContext) -> None:
    sender, receiver = _pair(make, new_context)
    src, dst = Buffer(1 << 16), Buffer(1 << 16)
    src.write(0, random.Random(3).randbytes(src.size))
    result: list[object] = []
    try:
        sender.register_regions([(src.address, src.size)])
        receiver.register_regions([(dst.address, dst.size)])

        def work() -> None:
            try:
                h = sender.submit_write(receiver.address(), [src.address], [dst.address], [src.size])
                result.append(sender.wait(h))
            except Exception as e:  # noqa: BLE001 - reported below
                result.append(e)

        t = threading.Thread(target=work)
        t.start()
        t.join(sender.ctx.timeout + 5)
        assert result == [DONE], f"a write from another thread gave {result}"
        assert dst.read() == src.read()
    finally:
        sender.close()
        receiver.close()


CHECKS = (check_address, check_round_trip, check_large, check_in_flight, check_empty, check_outside_regions,
          check_unreachable_peer, check_peer_closed, check_thread)


def run_all(make: Make, new_context: NewContext) -> None:
    for check in CHECKS:
        check(make, new_context)

"""The ``torch_dist`` KV transfer engine: the shared conformance suite (two engines in one
process), then what is particular to it: writes between two processes, the registry entry,
stats, addresses, refused and malformed requests, and a peer that pairs again after a
failure."""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import subprocess
import sys
import textwrap

# c10d looks up the name of every peer that connects to a TCPStore (a reverse lookup of
# ::ffff:127.0.0.1 here); in a sandbox whose name server drops queries now and then, that
# stalls the store for the resolver's timeout (5 s by default, longer than these tests'
# write timeout). Fail such lookups after 1 s (glibc reads this on its first lookup).
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

import pytest  # noqa: E402
from radixserve.disaggregation.transfer import DONE, FAILED, TransferContext, TransferError  # noqa: E402
from radixserve.testing import kv_transfer_conformance as kc  # noqa: E402
from radixserve_disagg_torch_dist import _probe  # noqa: E402
from radixserve_disagg_torch_dist.engine import TorchDistTransfer, parse_address  # noqa: E402


def new_context(role, **extra):
    return TransferContext(role=role, timeout=5.0, extra_config=extra)


def test_conformance():
    kc.run_all(TorchDistTransfer, new_context)


def test_probe_and_registry():
    assert _probe() is None
    from radixserve.registry import get_registry

    entry = get_registry().get("kv_transfer", "torch_dist")
    assert entry.factory is TorchDistTransfer


def test_parse_address():
    assert parse_address("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_address("[::1]:8080") == ("::1", 8080)
    for bad in ("", "host", "host:", ":12", "host:0", "host:70000", "host:x"):
        with pytest.raises(TransferError):
            parse_address(bad)


@pytest.fixture
def pair():
    sender, receiver = TorchDistTransfer(new_context("prefill")), TorchDistTransfer(new_context("decode"))
    yield sender, receiver
    sender.close()
    receiver.close()


def test_stats_reuse_and_bad_requests(pair):
    sender, receiver = pair
    src, dst = kc.Buffer(1 << 16), kc.Buffer(1 << 16)
    src.write(0, random.Random(5).randbytes(src.size))
    sender.register_regions([(src.address, 4096), (src.address + 4096, src.size - 4096)])  # touching: merged
    receiver.register_regions([(dst.address, dst.size)])
    peer = receiver.address()
    with pytest.raises(TransferError):  # a source outside the sender's registered memory
        sender.submit_write(peer, [dst.address], [dst.address], [16])
    with pytest.raises(TransferError):
        sender.submit_write(peer, [src.address], [dst.address], [16, 16])
    with pytest.raises(TransferError):
        sender.submit_write("nowhere", [src.address], [dst.address], [16])
    with pytest.raises(TransferError):
        sender.poll(12345)
    # a refused write leaves the pair usable: the next write on it lands
    assert sender.wait(sender.submit_write(peer, [src.address], [dst.address + dst.size - 8], [16])) == FAILED
    handles = [sender.submit_write(peer, [src.address + i * 1024, src.address + i * 1024 + 512],
                                   [dst.address + i * 1024, dst.address + i * 1024 + 512], [512, 512])
               for i in range(64)]  # consecutive segments: coalesced into one per write
    assert [sender.wait(h) for h in handles] == [DONE] * 64
    assert dst.read() == src.read()
    stats = sender.stats()
    assert stats["bytes_written"] == src.size and stats["writes"] == 64 and stats["failed"] == 1
    assert receiver.stats()["bytes_received"] == src.size and receiver.stats()["writes_refused"] == 1


def test_pairs_again_after_receiver_restarts_on_same_port(pair):
    sender, receiver = pair
    src, dst = kc.Buffer(4096, fill=7), kc.Buffer(4096)
    sender.register_regions([(src.address, src.size)])
    receiver.register_regions([(dst.address, dst.size)])
    port = parse_address(receiver.address())[1]
    assert sender.wait(sender.submit_write(receiver.address(), [src.address], [dst.address], [100])) == DONE
    receiver.close()
    assert sender.wait(sender.submit_write(receiver.address(), [src.address], [dst.address], [100])) == FAILED
    again = TorchDistTransfer(new_context("decode", port=port))
    try:
        again.register_regions([(dst.address, dst.size)])
        assert again.address() == receiver.address()
        assert sender.wait(sender.submit_write(again.address(), [src.address], [dst.address + 100], [200])) == DONE
        assert dst.read(0, 300) == b"\x07" * 300
    finally:
        again.close()


def test_close_fails_writes_in_flight(pair):
    sender, receiver = pair
    size = 8 << 20
    src, dst = kc.Buffer(size), kc.Buffer(size)
    sender.register_regions([(src.address, size)])
    receiver.register_regions([(dst.address, size)])
    handles = [sender.submit_write(receiver.address(), [src.address], [dst.address], [size]) for _ in range(4)]
    sender.close()
    sender.close()  # idempotent
    assert all(sender.poll(h) == FAILED for h in handles[1:])
    assert sender.poll(handles[0]) in (DONE, FAILED)
    with pytest.raises(TransferError):
        sender.submit_write(receiver.address(), [src.address], [dst.address], [1])


RECEIVER = textwrap.dedent("""
    import ctypes, hashlib, sys
    from radixserve.disaggregation.transfer import TransferContext
    from radixserve_disagg_torch_dist.engine import TorchDistTransfer
    size = int(sys.argv[1])
    buf = (ctypes.c_uint8 * size)()
    engine = TorchDistTransfer(TransferContext(role="decode", timeout=5.0))
    engine.register_regions([(ctypes.addressof(buf), size)])
    print(engine.address(), ctypes.addressof(buf), flush=True)
    sys.stdin.readline()  # the parent's writes are DONE
    print(hashlib.sha256(bytes(buf)).hexdigest(), engine.stats()["bytes_received"], flush=True)
    engine.close()
""")


def test_two_processes():
    size = 1 << 20
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    child = subprocess.Popen([sys.executable, "-c", RECEIVER, str(size)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    sender = TorchDistTransfer(new_context("prefill"))
    try:
        address, base = child.stdout.readline().split()
        base = int(base)
        src = kc.Buffer(size)
        src.write(0, random.Random(9).randbytes(size))
        sender.register_regions([(src.address, size)])
        sender.connect(address)
        rng = random.Random(10)
        segs = kc._segments(rng, size, 300, 6000)
        want = bytearray(size)
        handles = []
        for chunk in (segs[:100], segs[100:]):
            for o, n in chunk:
                want[o:o + n] = src.read(o, n)
            handles.append(sender.submit_write(address, [src.address + o for o, _ in chunk],
                                               [base + o for o, _ in chunk], [n for _, n in chunk]))
        handles.append(sender.submit_write(address, [src.address], [base + size - 10], [20]))  # refused
        assert [sender.wait(h) for h in handles] == [DONE, DONE, FAILED]
        child.stdin.write("\n")
        child.stdin.flush()
        digest, received = child.stdout.readline().split()
        assert digest == hashlib.sha256(bytes(want)).hexdigest()
        assert int(received) == sum(n for _, n in segs)
        assert child.wait(10) == 0
        # the receiver process is gone: a write fails at once (its connections are closed)
        assert sender.wait(sender.submit_write(address, [src.address], [base], [8])) == FAILED
    finally:
        sender.close()
        if child.poll() is None:
            child.kill()
            child.wait()


def test_many_segments_exact():
    sender, receiver = TorchDistTransfer(new_context("prefill")), TorchDistTransfer(new_context("decode"))
    try:
        src, dst = kc.Buffer(1 << 18), kc.Buffer(1 << 18, fill=0xAB)
        src.write(0, random.Random(11).randbytes(src.size))
        sender.register_regions([(src.address, src.size)])
        receiver.register_regions([(dst.address, dst.size)])
        order = list(range(0, src.size, 64))
        random.Random(12).shuffle(order)
        handle = sender.submit_write(receiver.address(), [src.address + o for o in order],
                                     [dst.address + o for o in order], [64] * len(order))
        assert sender.wait(handle) == DONE
        assert dst.read() == src.read()
        assert ctypes.sizeof(src.raw) == src.size
    finally:
        sender.close()
        receiver.close()

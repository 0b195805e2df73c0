"""The ``mooncake`` KV transfer engine over TCP on this machine: the shared conformance suite,
and a write between two processes."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap

import pytest
from radixserve.disaggregation.transfer import DONE, TransferContext
from radixserve.registry import get_registry
from radixserve.testing import kv_transfer_conformance as kc

REASON = get_registry().get("kv_transfer", "mooncake").unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"mooncake transfer engine unavailable: {REASON}")


def new_context(role: str, **extra) -> TransferContext:
    return TransferContext(role=role, timeout=5.0, extra_config=extra)


def make(ctx):
    from radixserve_disagg_mooncake import MooncakeTransfer

    return MooncakeTransfer(ctx)


@pytest.mark.parametrize("check", kc.CHECKS, ids=lambda c: c.__name__)
def test_conformance(check):
    check(make, new_context)


RECEIVER = textwrap.dedent("""
    import hashlib, sys
    from radixserve.disaggregation.transfer import TransferContext
    from radixserve.testing.kv_transfer_conformance import Buffer
    from radixserve_disagg_mooncake import MooncakeTransfer
    buf = Buffer(1 << 20)
    engine = MooncakeTransfer(TransferContext(role="decode", timeout=5.0))
    engine.register_regions([(buf.address, buf.size)])
    print(engine.address(), buf.address, flush=True)
    sys.stdin.readline()  # the sender is done
    print(hashlib.sha256(buf.read()).hexdigest(), flush=True)
    engine.close()
""")


def test_write_between_processes():
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        peer, base = proc.stdout.readline().split()
        src = kc.Buffer(1 << 20)
        src.write(0, bytes(range(256)) * 4096)
        sender = make(new_context("prefill"))
        sender.register_regions([(src.address, src.size)])
        sender.connect(peer)
        half = src.size // 2  # two segments, swapped halves
        handle = sender.submit_write(peer, [src.address, src.address + half], [int(base) + half, int(base)],
                                     [half, half])
        assert sender.wait(handle) == DONE
        sender.close()
        proc.stdin.write("\n")
        proc.stdin.flush()
        want = hashlib.sha256(src.read(half) + src.read(0, half)).hexdigest()
        assert proc.stdout.readline().strip() == want
    finally:
        proc.kill()
        proc.wait()

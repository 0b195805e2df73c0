"""The ``nixl`` KV transfer engine (NIXL's UCX backend, on CPU memory here): the shared
conformance suite."""

from __future__ import annotations

import pytest
from radixserve.disaggregation.transfer import TransferContext
from radixserve.registry import get_registry
from radixserve.testing import kv_transfer_conformance as kc

REASON = get_registry().get("kv_transfer", "nixl").unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"nixl transfer engine unavailable: {REASON}")


def new_context(role: str, **extra) -> TransferContext:
    return TransferContext(role=role, timeout=5.0, extra_config=extra)


def make(ctx):
    from radixserve_disagg_nixl import NixlTransfer

    return NixlTransfer(ctx)


@pytest.mark.parametrize("check", kc.CHECKS, ids=lambda c: c.__name__)
def test_conformance(check):
    check(make, new_context)

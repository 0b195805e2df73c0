"""The ``mooncake`` KV transfer engine: Mooncake's transfer engine (``mooncake.engine``),
peers found by its ``P2PHANDSHAKE`` (no metadata server: a peer's address is its host and
the engine's RPC port), TCP between machines without RDMA, RDMA on the NICs named by
``--disaggregation-ib-device``."""

from __future__ import annotations

import importlib.util

from radixserve.plugin_api import hookimpl

from radixserve_disagg_mooncake.engine import MooncakeTransfer

__all__ = ["MooncakeTransfer"]


def _probe() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        return ("mooncake is not installed (pip install mooncake-transfer-engine-non-cuda on CPU machines, "
                "which needs Debian's libibverbs1; mooncake-transfer-engine with CUDA)")
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except (ImportError, OSError) as e:  # e.g. libibverbs.so.1 missing
        return f"mooncake does not load here: {e}"
    return None


@hookimpl
def register_kv_transfer_backends(register):
    register("mooncake", MooncakeTransfer, probe=_probe,
             description="Mooncake transfer engine (P2P handshake; TCP, or RDMA with --disaggregation-ib-device)")

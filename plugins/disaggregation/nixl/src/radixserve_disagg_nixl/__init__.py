"""The ``nixl`` KV transfer engine: NVIDIA's NIXL agent (UCX backend) writing into a peer's
registered memory; peers exchange agent metadata through NIXL's own listener (an address is
``name@host:port``)."""

from __future__ import annotations

import importlib.util
import logging
import os

from radixserve.plugin_api import hookimpl

__all__ = ["NixlTransfer"]
MODULES = ("nixl_cu12", "nixl_cu13", "nixl")  # the wheels' import names, CUDA 12 first


def nixl_api():
    """NIXL's ``_api`` module (agent and config classes) from whichever wheel is installed."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent it starts to stdout at INFO
    for name in MODULES:
        if importlib.util.find_spec(name) is not None:
            api = importlib.import_module(f"{name}._api")
            logging.getLogger("nixl").setLevel(max(logging.WARNING, logging.getLogger("nixl").level))
            return api
    raise ImportError("NIXL is not installed (pip install nixl-cu12: it runs on CPU machines too)")


def __getattr__(name: str):
    if name == "NixlTransfer":
        from radixserve_disagg_nixl.engine import NixlTransfer

        return NixlTransfer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _probe() -> str | None:
    try:
        api = nixl_api()
        if "UCX" not in api.nixl_agent("radixserve-probe", api.nixl_agent_config(backends=[])).get_plugin_list():
            return "NIXL has no UCX backend plugin here"
    except Exception as e:  # noqa: BLE001 - any failure to load means unavailable
        return f"NIXL does not load here: {type(e).__name__}: {e}"
    return None


@hookimpl
def register_kv_transfer_backends(register):
    from radixserve_disagg_nixl.engine import NixlTransfer

    register("nixl", NixlTransfer, probe=_probe,
             description="NVIDIA NIXL (UCX backend): one-sided writes into the peer's registered memory")

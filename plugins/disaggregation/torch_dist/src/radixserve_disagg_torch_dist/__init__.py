"""radixserve KV transfer engine ``torch_dist``: KV writes over ``torch.distributed``
point-to-point messages (gloo), for prefill-decode disaggregation.

The engine is in :mod:`.engine` (sending side) and :mod:`.receiver` (receiving side); the
wire protocol is described in :mod:`.engine`. This module is what the entry point loads, so
it imports no torch: the class is imported by the hook and on first access as
``radixserve_disagg_torch_dist.TorchDistTransfer``.
"""

from __future__ import annotations

from radixserve.plugin_api import hookimpl

__all__ = ["TorchDistTransfer"]


def __getattr__(name: str):
    if name == "TorchDistTransfer":
        from radixserve_disagg_torch_dist.engine import TorchDistTransfer

        return TorchDistTransfer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _probe() -> str | None:
    try:
        import torch.distributed as dist
    except Exception as e:  # torch missing or broken
        return f"torch.distributed cannot be imported: {type(e).__name__}: {e}"
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    return None


@hookimpl
def register_kv_transfer_backends(register):
    from radixserve_disagg_torch_dist.engine import TorchDistTransfer

    register("torch_dist", TorchDistTransfer, probe=_probe,
             description="torch.distributed point-to-point over gloo (TCP): host memory, a TCPStore per "
                         "receiving rank, one process group per sender-receiver pair")

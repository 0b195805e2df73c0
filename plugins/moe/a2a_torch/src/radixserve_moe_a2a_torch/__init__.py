"""radixserve MoE all-to-all transport ``torch_distributed``: expert parallelism over
``torch.distributed`` collectives (gloo on CPU, NCCL on GPUs), no library of its own.

The transport is in :mod:`.transport` (see its docstring for dispatch and combine). This
module is what the entry point loads, so it imports no torch: the class is imported by the
hook, when the MoE all-to-all transports are asked for, and on first access as
``radixserve_moe_a2a_torch.TorchDistributedA2A``; the probe imports torch when it runs.
"""

from __future__ import annotations

from radixserve.plugin_api import hookimpl

__all__ = ["TorchDistributedA2A", "unavailable_reason"]


def __getattr__(name: str):
    if name == "TorchDistributedA2A":
        from radixserve_moe_a2a_torch.transport import TorchDistributedA2A

        return TorchDistributedA2A
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def unavailable_reason() -> str | None:
    import torch.distributed as dist

    if not dist.is_available():
        return "this torch build has no torch.distributed"
    return None


@hookimpl
def register_moe_a2a_backends(register):
    from radixserve_moe_a2a_torch.transport import TorchDistributedA2A

    register("torch_distributed", TorchDistributedA2A, probe=unavailable_reason,
             description="expert parallelism over torch.distributed: each EP rank's share of the tokens to the "
                         "experts' ranks with all_to_all_single and back, then an all-gather (gloo/NCCL)")

"""radixserve attention backend ``torch_native``: paged extend and decode in plain PyTorch.

The backend itself is in :mod:`.backend` (see its docstring for how extend and decode run).
This module is what the entry point loads, so it imports no torch: the class is imported
by the hook, when the attention backends are asked for, and on first access as
``radixserve_attention_torch.TorchNativeAttention``.
"""

from __future__ import annotations

from radixserve.plugin_api import hookimpl

__all__ = ["TorchNativeAttention"]


def __getattr__(name: str):
    if name == "TorchNativeAttention":
        from radixserve_attention_torch.backend import TorchNativeAttention

        return TorchNativeAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@hookimpl
def register_attention_backends(register):
    from radixserve_attention_torch.backend import TorchNativeAttention

    register("torch_native", TorchNativeAttention, description="plain PyTorch (SDPA extend, gather decode); any device")

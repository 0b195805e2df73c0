"""radixserve MoE runner ``torch_native``: experts over dispatched tokens, with no Python
loop over tokens.

The runner is in :mod:`.runner` (see its docstring for the CPU-kernel and PyTorch paths).
This module is what the entry point loads, so it imports no torch: the runner is imported
by the hook, when the MoE runners are asked for, and on first access as
``radixserve_moe_torch.TorchNativeMoERunner`` (likewise ``make_runner``, ``PackedExperts``).
"""

from __future__ import annotations

from radixserve.plugin_api import hookimpl

__all__ = ["PackedExperts", "TorchNativeMoERunner", "make_runner"]


def __getattr__(name: str):
    if name in __all__:
        from radixserve_moe_torch import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@hookimpl
def register_moe_runners(register):
    from radixserve_moe_torch.runner import TorchNativeMoERunner

    register("torch_native", TorchNativeMoERunner,
             description="PyTorch + radixserve CPU kernels: tokens sorted by expert, one grouped "
                         "GEMM per projection over packed experts on CPU float32, a GEMM per "
                         "expert slice elsewhere (runs anywhere)")

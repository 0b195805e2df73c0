"""radixserve MoE all-to-all transport ``deepep`` over DeepEP (deepseek-ai/DeepEP).

``--moe-a2a-backend deepep --deepep-mode auto|normal|low_latency`` (SGLang's flags): DeepEP's
high-throughput kernels for prefill, its low-latency kernels for decode (see
:mod:`.transport`). Needs NVIDIA GPUs (Hopper sm90 for DeepEP's SM90 build) linked by NVLink
within a node (RDMA across nodes), bf16 activations, at most 11 experts per token for the
low-latency kernels (32 for the normal ones), and ``deep_ep`` installed with DeepEP 2.1.0's
``Buffer`` API (the PyPI name ``deep-ep`` is a placeholder; see the README). ``deep_ep`` is
imported by the factory and, on a GPU only, by the probe, which also checks that every
``Buffer`` method the transport calls is there (:mod:`.api`); :mod:`.convert` and
:mod:`.transport` never import it. The factory lives in :mod:`.factory`, imported by the
hook, so this module imports no torch.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from radixserve.plugin_api import hookimpl, option

__all__ = ["DEEPEP_MODES", "LOW_LATENCY_MAX_TOPK", "DeepEPA2A", "DeepEPOptions", "make_transport",
           "unavailable_reason"]


@dataclass
class DeepEPOptions:
    """The flags of ``--moe-a2a-backend deepep`` (SGLang's names)."""

    deepep_mode: str = option("auto", "--moe-a2a-backend deepep: DeepEP's normal kernels (prefill), "
                              "low_latency ones (decode), or auto (low_latency when every EP rank's share of the "
                              "step's tokens fits its low-latency buffer, normal otherwise)",
                              choices=("auto", "normal", "low_latency"))

#: hidden sizes DeepEP's low-latency kernels are compiled for (SWITCH_HIDDEN in
#: csrc/kernels/legacy/launch.cuh)
LOW_LATENCY_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
#: the most experts per token DeepEP's low-latency kernels take: ``kNumMaxTopK = 11`` and
#: ``EP_HOST_ASSERT(num_topk <= kNumMaxTopK)`` in both ``dispatch`` and ``combine`` of
#: csrc/kernels/legacy/internode_ll.cu (DeepEP commit dd758ca)
LOW_LATENCY_MAX_TOPK = 11
#: the same for the normal kernels: ``EP_DEVICE_ASSERT(num_topk <= 32)`` in the dispatch and
#: combine kernels of csrc/kernels/legacy/intranode.cu and internode.cu
NORMAL_MAX_TOPK = 32


# names that live in submodules importing torch, loaded on first access
_LAZY = {"DEEPEP_MODES": "transport", "DEFAULT_LL_MAX_TOKENS_PER_RANK": "transport", "DeepEPA2A": "transport",
         "make_transport": "factory"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def unavailable_reason() -> str | None:
    """``None`` where DeepEP can run, else why not. Beyond the GPU and the import, the imported
    ``deep_ep`` must have every ``Buffer`` method the transport calls, taking the call's
    arguments (:func:`.api.api_mismatch`), so an incompatible build is refused here, naming
    what is missing, not at the first layer call."""
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA: NVIDIA sm90 (Hopper) GPUs linked by NVLink, with deep_ep installed"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"needs an sm90 (Hopper) or newer GPU; this one is sm{major}{minor}"
    if importlib.util.find_spec("deep_ep") is None:
        return "deep_ep is not installed (see plugins/moe/deepep/README.md)"
    try:
        import deep_ep
    except Exception as e:  # noqa: BLE001 - a broken build is reported, not raised
        return f"deep_ep failed to import: {type(e).__name__}: {e}"
    from radixserve_a2a_deepep.api import api_mismatch

    return api_mismatch(deep_ep)


@hookimpl
def register_moe_a2a_backends(register):
    from radixserve_a2a_deepep.factory import make_transport

    register("deepep", make_transport, probe=unavailable_reason, options=DeepEPOptions,
             description="DeepEP all-to-all: normal (prefill) and low-latency (decode) dispatch/combine, "
                         "--deepep-mode auto|normal|low_latency; NVLink/RDMA GPUs, bf16")

"""radixserve LoRA backend ``triton``: the adapters' deltas of a step as two kernels per layer,
SGMV-style (segmented gathered matrix-vector products, as in Punica and S-LoRA).

Once per step the rows that use an adapter are grouped by slot into segments (a permutation of
the rows and each segment's slot, start and length). Per layer, the *shrink* kernel computes
``h = scaling[s] * x[rows] @ a[s].T`` for every segment at once (all the layer's parts: one
launch), and the *expand* kernel adds ``h_p @ b_p[s]`` to each part's output rows in place (one
launch per part). Rows are gathered and scattered through the permutation, so a decode batch
whose adapters are interleaved needs no copy of its activations, and no weights are merged.

Runs where Triton runs: a CUDA or ROCm GPU, or CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, slow; for tests). Triton is imported by the factory, not here.
"""

from __future__ import annotations

from radixserve.plugin_api import hookimpl
from radixserve.plugin_api.kernels import triton_unavailable_reason as unavailable_reason

__all__ = ["unavailable_reason"]


def make_backend(ctx):
    """Factory: imports Triton and builds :class:`~.backend.TritonLoRA`."""
    from radixserve_lora_triton.backend import TritonLoRA

    return TritonLoRA(ctx)


@hookimpl
def register_lora_backends(register):
    register("triton", make_backend, probe=unavailable_reason,
             description="SGMV shrink/expand kernels in Triton; GPU or TRITON_INTERPRET=1")

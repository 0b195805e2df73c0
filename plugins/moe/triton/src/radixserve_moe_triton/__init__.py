"""radixserve MoE runner ``triton``: a fused MoE in Triton kernels.

The (token, choice) pairs are sorted by expert and each expert's segment is padded to the
GEMM's block size (align.py); one grouped GEMM computes the gate and up projections of
every block with SiLU * up in its epilogue, a second the down projection with the routing
weight applied, and a last kernel sums each token's choices (kernels.py, fused_moe.py).

Runs where Triton runs: a CUDA or ROCm GPU, or CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, slow; for tests). Triton and the kernels are imported by the
factory, not here, so listing plugins stays fast and works without Triton.
"""

from __future__ import annotations

from radixserve.plugin_api import hookimpl
from radixserve.plugin_api.kernels import interpreter_enabled
from radixserve.plugin_api.kernels import triton_unavailable_reason as unavailable_reason

__all__ = ["interpreter_enabled", "unavailable_reason"]


def make_runner(ctx, **kwargs):
    """Factory: imports Triton and builds :class:`~.runner.TritonMoERunner`."""
    from radixserve_moe_triton.runner import TritonMoERunner

    return TritonMoERunner(ctx, **kwargs)


@hookimpl
def register_moe_runners(register):
    register(
        "triton",
        make_runner,
        probe=unavailable_reason,
        description="fused MoE in Triton: aligned grouped GEMMs, SiLU*up and routing weight "
        "fused; GPU or TRITON_INTERPRET=1",
    )

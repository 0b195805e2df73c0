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

import os

from radixserve.hookspecs import hookimpl

_TRUE = ("1", "true", "on", "yes")


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton to interpret kernels on CPU."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def unavailable_reason() -> str | None:
    """``None`` when Triton can run the kernels here, else why not."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not importable ({type(e).__name__}: {e}); pip install triton"
    if interpreter_enabled():
        return None
    import torch

    if torch.cuda.is_available():  # CUDA, or ROCm through torch's HIP build
        return None
    return "needs a GPU; on CPU set TRITON_INTERPRET=1 (slow, for tests)"


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

"""radixserve attention backend ``triton``: paged extend and flash-decoding kernels in Triton.

Extend runs one kernel launch for every request of the step: each program takes a block
of one request's new tokens for one query head, reads the cached prefix through the
token-slot table (paged) and the new tokens causally, with an online softmax; target
verify (speculative decoding) runs the same kernel with each request's tree mask in
place of the causal one. Decode
splits each request's KV across programs (split-K) and merges the splits by
log-sum-exp in a second kernel; one program serves all query heads of a KV head.

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
    """``None`` when Triton can run kernels here, else why not."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not importable ({type(e).__name__}: {e}); pip install triton"
    if interpreter_enabled():
        return None
    import torch

    if torch.cuda.is_available():  # CUDA, or ROCm through torch's HIP build
        return None
    return "needs a CUDA or ROCm GPU, or TRITON_INTERPRET=1 to run the kernels on CPU (slow)"


def make_backend(ctx, **kwargs):
    """Factory: imports Triton and builds :class:`~.backend.TritonAttention`."""
    from radixserve_attention_triton.backend import TritonAttention

    return TritonAttention(ctx, **kwargs)


@hookimpl
def register_attention_backends(register):
    register(
        "triton",
        make_backend,
        probe=unavailable_reason,
        description="Triton kernels: paged extend, split-K decode; GPU or TRITON_INTERPRET=1",
    )

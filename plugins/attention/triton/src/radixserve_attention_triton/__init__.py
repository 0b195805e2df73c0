"""radixserve attention backend ``triton``: paged extend and flash-decoding kernels in Triton.

Extend runs one kernel launch for every request of the step: each program takes a block
of one request's new tokens for one query head, reads the cached prefix through the
token-slot table (paged) and the new tokens causally, with an online softmax; target
verify (speculative decoding) runs the same kernel with each request's tree mask in
place of the causal one. MLA (DeepSeek's latent cache) runs in both kernels. Decode
splits each request's KV across programs (split-K) and merges the splits by
log-sum-exp in a second kernel; one program serves all query heads of a KV head.

Runs where Triton runs: a CUDA or ROCm GPU, or CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, slow; for tests). Triton and the kernels are imported by the
factory, not here, so listing plugins stays fast and works without Triton.
"""

from __future__ import annotations

from radixserve.plugin_api import hookimpl
from radixserve.plugin_api.kernels import interpreter_enabled
from radixserve.plugin_api.kernels import triton_unavailable_reason as unavailable_reason

__all__ = ["interpreter_enabled", "unavailable_reason"]


def make_backend(ctx, **kwargs):
    """Factory: imports Triton and builds :class:`~.backend.TritonAttention`."""
    from radixserve_attention_triton.backend import TritonAttention

    return TritonAttention(ctx, **kwargs)


# what the backend class declares (radixserve plugins lists it; an MLA model's refusal names the backends with MLA)
make_backend.supports_target_verify = True
make_backend.supports_mla = True


@hookimpl
def register_attention_backends(register):
    register(
        "triton",
        make_backend,
        probe=unavailable_reason,
        description="Triton kernels: paged extend, split-K decode; GPU or TRITON_INTERPRET=1",
    )

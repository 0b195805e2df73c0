"""Kernels plugins may call: radixserve's compiled CPU kernels (``cpu_kernels.load()``: the
library, or None where it cannot be built) and the Triton helpers (interpreter mode,
availability, ahead-of-time compile checks)."""

from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels.triton_support import (
    compile_for_arch,
    interpreter_enabled,
    triton_unavailable_reason,
)

__all__ = ["compile_for_arch", "cpu_kernels", "interpreter_enabled", "triton_unavailable_reason"]

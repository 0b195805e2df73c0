"""Whether Triton kernels can run here: the availability probe shared by every plugin
that ships Triton kernels (attention, MoE, ...). Imports nothing heavy until asked."""

from __future__ import annotations

import os

_TRUE = ("1", "true", "on", "yes")
GPU_OR_INTERPRETER = "needs a CUDA or ROCm GPU; on CPU set TRITON_INTERPRET=1 (slow, for tests)"


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton to interpret kernels on CPU."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def triton_unavailable_reason() -> str | None:
    """``None`` when Triton can run kernels here (a CUDA/ROCm GPU, or the interpreter),
    else why not."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not importable ({type(e).__name__}: {e}); pip install triton"
    if interpreter_enabled():
        return None
    import torch

    if torch.cuda.is_available():  # CUDA, or ROCm through torch's HIP build
        return None
    return GPU_OR_INTERPRETER


def compile_for_arch(jobs: dict, arch: int) -> dict[str, int]:
    """Compile Triton kernels for ``sm_<arch>`` without a GPU; returns each kernel's shared
    memory in bytes. ``jobs``: ``{name: (kernel, {arg: type}, {constexpr: value}, options)}``;
    arguments not typed are ``i32``. Used by the plugins' ``compile_check`` commands."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    shared = {}
    for name, (fn, types, constexprs, options) in jobs.items():
        signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in fn.arg_names}
        src = ASTSource(fn, signature, constexprs)
        shared[name] = triton.compile(src, target=target, options=options).metadata.shared
    return shared

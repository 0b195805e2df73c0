"""radixserve MoE runners over DeepGEMM's grouped GEMMs (deepseek-ai/DeepGEMM).

``--moe-runner-backend deep_gemm`` (SGLang's name): FP8 ``float8_e4m3fn`` with DeepGEMM's
block scales (1x128 per token for activations, 128x128 for weights), the weights
quantised once at load. ``--moe-runner-backend deep_gemm_bf16``: the same with DeepGEMM's
BF16 grouped GEMMs, no quantisation. Both: the contiguous grouped layout for large batches
(prefill), the masked layout for small ones (decode); see :mod:`.runner`.

Needs an NVIDIA sm90 (Hopper) or sm100 (Blackwell) GPU and a ``deep_gemm`` with the API of
sgl-deep-gemm 0.2.5 / DeepGEMM 2.6.1 (the PyPI name ``deep-gemm`` is a placeholder; see the
README). ``deep_gemm`` is imported by the factory and, on such a GPU only, by the
availability probe, which also checks that every function the runner calls is there
(:mod:`.api`); :mod:`.layout` and :mod:`.runner` never import it.
"""

from __future__ import annotations

import importlib.util

from radixserve.plugin_api import hookimpl


def _supported_dtype():
    """What the factory accepts (``torch.bfloat16``): DeepGEMM's GEMMs write bf16 and read
    bf16 or fp8. A function, and ``SUPPORTED_DTYPE`` through :func:`__getattr__`, so that
    this module (the entry point) imports no torch."""
    import torch

    return torch.bfloat16


def __getattr__(name: str):
    if name == "SUPPORTED_DTYPE":
        return _supported_dtype()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def unavailable_reason(fp8: bool = True) -> str | None:
    """``None`` where DeepGEMM can run the ``deep_gemm`` runner (``fp8``) or ``deep_gemm_bf16``,
    else why not. Beyond the GPU and the import, the imported ``deep_gemm`` must have every
    function that runner calls, taking the call's arguments (:func:`.api.api_mismatch`), so a
    DeepGEMM 1.x (other names) is refused here, naming what is missing, not at the first forward."""
    import torch

    if not torch.cuda.is_available():
        return "needs CUDA: an NVIDIA sm90 (Hopper) or sm100 GPU with deep_gemm installed"
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10):
        return f"needs an sm90 (Hopper) or sm100 GPU; this one is sm{major}{minor}"
    if importlib.util.find_spec("deep_gemm") is None:
        return "deep_gemm is not installed (see plugins/moe/deepgemm/README.md)"
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001 - a broken build is reported, not raised
        return f"deep_gemm failed to import: {type(e).__name__}: {e}"
    from radixserve_moe_deepgemm.api import api_mismatch

    return api_mismatch(deep_gemm, fp8)


def bf16_unavailable_reason() -> str | None:
    """The probe of ``deep_gemm_bf16``: :func:`unavailable_reason` for the BF16 GEMMs."""
    return unavailable_reason(fp8=False)


def check_context(ctx) -> None:
    """The shapes and dtype DeepGEMM's kernels take; a clear error instead of a kernel assert."""
    if ctx.dtype != _supported_dtype():
        raise ValueError(f"--moe-runner-backend deep_gemm: the model runs in {ctx.dtype}, DeepGEMM's grouped GEMMs "
                         "need bfloat16 activations; use --dtype bfloat16 or another MoE runner")
    if ctx.device.type != "cuda":
        raise ValueError(f"--moe-runner-backend deep_gemm runs on CUDA; the model is on {ctx.device}")
    for what, size in (("hidden size", ctx.hidden_size), ("intermediate size (this rank's slice)",
                                                          ctx.intermediate_size)):
        if size % 128:
            raise ValueError(f"--moe-runner-backend deep_gemm: the MoE {what} {size} is not a multiple of 128 "
                             "(DeepGEMM's block size); use another MoE runner for this model")


def _make(ctx, fp8: bool, masked_max_rows: int):
    reason = unavailable_reason(fp8)
    if reason is not None:
        name = "deep_gemm" if fp8 else "deep_gemm_bf16"
        raise RuntimeError(f"--moe-runner-backend {name} is unavailable: {reason}")
    check_context(ctx)
    from radixserve_moe_deepgemm.kernels import DeepGemmKernels
    from radixserve_moe_deepgemm.runner import DeepGemmMoERunner

    return DeepGemmMoERunner(ctx, DeepGemmKernels(fp8, ctx.device), masked_max_rows=masked_max_rows)


def make_runner(ctx, masked_max_rows: int = 128):
    """Factory of ``deep_gemm``: FP8 block-scaled grouped GEMMs."""
    return _make(ctx, True, masked_max_rows)


def make_bf16_runner(ctx, masked_max_rows: int = 128):
    """Factory of ``deep_gemm_bf16``: BF16 grouped GEMMs."""
    return _make(ctx, False, masked_max_rows)


@hookimpl
def register_moe_runners(register):
    register("deep_gemm", make_runner, probe=unavailable_reason,
             description="DeepGEMM FP8 grouped GEMMs (1x128 activation, 128x128 weight block scales; contiguous "
                         "layout for prefill, masked for decode); sm90/sm100, bf16 models")
    register("deep_gemm_bf16", make_bf16_runner, probe=bf16_unavailable_reason,
             description="DeepGEMM BF16 grouped GEMMs (contiguous layout for prefill, masked for decode); "
                         "sm90/sm100, bf16 models")

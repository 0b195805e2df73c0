"""``w8a16_int8`` and ``int4wo`` off the CPU, through torchao's weight-only tensors.

radixserve's own int8/int4 kernels are CPU code. On CUDA the same methods hand the
float weight, once loaded, to torchao (``quantize_`` with ``Int8WeightOnlyConfig`` or
``Int4WeightOnlyConfig(group_size=...)`` on a one-layer ``nn.Linear``) and keep the
tensor subclass it returns; ``F.linear`` on that tensor runs torchao's kernels (int4:
PyTorch's tinygemm ``_weight_int4pack_mm``, which wants bfloat16 activations). torchao is
an optional dependency: without it, or without CUDA, :func:`torchao_probe` says why and
``--quantization`` refuses the method on that device, naming the flag.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# what each method asks torchao for, and the activation dtypes its kernels take
TORCHAO_CONFIGS = {
    "w8a16_int8": ("Int8WeightOnlyConfig", (torch.bfloat16, torch.float16, torch.float32)),
    "int4wo": ("Int4WeightOnlyConfig", (torch.bfloat16,)),
}


def torchao_probe(device: torch.device) -> str | None:
    """Why torchao's weight-only path cannot run on ``device`` (None: it can)."""
    if device.type != "cuda":
        return f"torchao's weight-only kernels are used on CUDA only, not {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import torchao.quantization as tq
    except Exception as e:  # noqa: BLE001 - any import failure means "unavailable"
        return f"torchao is not installed or does not import ({type(e).__name__}: {e}); pip install torchao"
    missing = [name for name, _ in TORCHAO_CONFIGS.values() if not hasattr(tq, name)]
    if missing or not hasattr(tq, "quantize_"):
        return f"this torchao ({getattr(tq, '__version__', '?')}) lacks {', '.join(missing) or 'quantize_'}"
    return None


def check_torchao_dtype(method: str, dtype: torch.dtype) -> str | None:
    """Why ``method`` cannot run with activations in ``dtype`` (None: it can)."""
    _, dtypes = TORCHAO_CONFIGS[method]
    if dtype in dtypes:
        return None
    names = "|".join(str(d).removeprefix("torch.") for d in dtypes)
    return f"its torchao kernels take --dtype {names} activations, not {str(dtype).removeprefix('torch.')}"


class TorchAOMatrix:
    """A ``[N, K]`` weight quantized by torchao; ``linear(x, bias)`` is ``F.linear`` on it."""

    def __init__(self, weight: torch.Tensor, method: str, dtype: torch.dtype, group_size: int | None = None) -> None:
        import torchao.quantization as tq

        config_name, _ = TORCHAO_CONFIGS[method]
        config_cls = getattr(tq, config_name)
        config = config_cls(group_size=group_size) if group_size is not None else config_cls()
        self.n, self.k = weight.shape
        holder = nn.Linear(self.k, self.n, bias=False, device=weight.device, dtype=dtype)
        with torch.no_grad():
            holder.weight.copy_(weight.to(dtype))
        tq.quantize_(holder, config)
        self.weight = holder.weight.detach()
        self.kind = method
        self.path = f"torchao-{config_name}"

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def nbytes(self) -> int:
        """Bytes of the tensors torchao keeps (its quantized data, scales, zero points)."""
        flatten = getattr(self.weight, "__tensor_flatten__", None)
        if flatten is None:  # a plain tensor: the method left it unquantized
            return self.weight.numel() * self.weight.element_size()
        names, _ = flatten()
        total = 0
        for name in names:
            inner = getattr(self.weight, name)
            if isinstance(inner, torch.Tensor):
                total += inner.numel() * inner.element_size()
        return total

"""The quantization contract's types: what a method is told, what it returns, and the
scope a model is built in. Re-exported by :mod:`radixserve.quantization`."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class QuantizationContext:
    """What a quantization method is told about the run when it is chosen."""

    device: torch.device
    dtype: torch.dtype  # the activation dtype
    checkpoint_format: str  # "gguf" or "hf"
    # the float weights' dtype when it differs from the activations' (--dtype bfloat16 on CPU:
    # bf16 weights, float32 activations and accumulation); None: the activation dtype
    weight_dtype: torch.dtype | None = None
    # keep float16/bfloat16 checkpoint weights in their 16 bits on CPU (linear weights widened in
    # the kernels' registers, embedding rows when looked up); False: widened to float32 at load
    # (--dtype float32). Set by --dtype auto on CPU.
    keep_16bit_weights: bool = False


class QuantizationError(ValueError):
    """A quantization method cannot serve this checkpoint or device; the message names the flag."""


class GGUFTensor:
    """One 2-D GGUF tensor kept in its stored blocks: ``data  # uint8 [rows, row_bytes]``, each
    row ``cols`` weights of block type ``qtype`` (a ``gguf.GGMLQuantizationType`` value).

    It behaves like the float tensor it stands for where loading needs it: ``shape``,
    ``dim()``, ``narrow`` (rows freely; columns only at block boundaries) and
    :meth:`take_rows` (a row permutation); :meth:`dequantize` gives the float32 tensor."""

    def __init__(self, qtype: int, data: torch.Tensor, cols: int) -> None:
        self.qtype, self.data, self.cols = int(qtype), data, int(cols)
        self.shape = torch.Size((data.shape[0], self.cols))

    def dim(self) -> int:
        return 2

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.qtype).name

    @property
    def block(self) -> tuple[int, int]:
        """(weights per block, bytes per block)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        return GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)]

    def narrow(self, dim: int, start: int, length: int) -> GGUFTensor:
        if dim == 0:
            return GGUFTensor(self.qtype, self.data.narrow(0, start, length), self.cols)
        if dim not in (1, -1):
            raise IndexError(f"GGUFTensor.narrow: dim {dim} of a 2-D tensor")
        per, nbytes = self.block
        if start % per or length % per:
            raise QuantizationError(
                f"columns {start}:{start + length} of a {self.type_name} tensor do not fall on its "
                f"{per}-weight blocks; use --quantization none for this tensor-parallel split")
        return GGUFTensor(self.qtype, self.data.narrow(1, start // per * nbytes, length // per * nbytes), length)

    def take_rows(self, order: torch.Tensor) -> GGUFTensor:
        """Rows ``order`` (int64 [rows]) of this tensor, in that order."""
        return GGUFTensor(self.qtype, self.data.index_select(0, order), self.cols)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[rows, cols]`` tensor these blocks encode (the ``gguf`` package's
        dequantisation, the reference every kernel is tested against)."""
        import numpy as np
        from gguf import GGMLQuantizationType, dequantize

        out = dequantize(self.data.contiguous().numpy(), GGMLQuantizationType(self.qtype))
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(self.shape)

    def __repr__(self) -> str:
        return f"GGUFTensor({self.type_name}, shape={tuple(self.shape)})"


class LinearMethod:
    """How one linear layer stores and multiplies its weight (see the module docstring).

    The base class is the float method's loading: a ``weight  # [out, in]`` parameter (and
    ``bias  # [out]`` when the layer has one) that checkpoint rows are copied into. A
    method that keeps other tensors overrides all four steps."""

    name = "none"

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features))  # [out, in]
        layer.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def load_weight(self, layer: nn.Module, name: str, tensor, rows: tuple[int, int]) -> None:
        """Copy ``tensor`` (this rank's ``[size, in]`` rows, or ``[size]`` of the bias) into
        output rows ``rows = (start, size)``."""
        if isinstance(tensor, GGUFTensor):
            tensor = tensor.dequantize()
        start, size = rows
        dst = getattr(layer, "bias" if name == "bias" else "weight").narrow(0, start, size)
        if dst.shape != tensor.shape:
            raise ValueError(f"checkpoint {name} of shape {tuple(tensor.shape)} does not fit "
                             f"{layer.out_features}x{layer.in_features} rows {start}:{start + size}")
        dst.copy_(tensor)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once, after the model is on its device and dtype."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define apply (see LinearMethod)")

    def weight_nbytes(self, layer: nn.Module) -> int:
        """Bytes the layer keeps resident for its weight and bias once processed."""
        return sum(t.numel() * t.element_size() for t in (layer.weight, layer.bias) if t is not None)

    def describe(self, layer: nn.Module) -> str:
        """One word for logs and tests: which storage and kernel the layer ended up with."""
        return self.name


class QuantizationConfig:
    """One ``--quantization`` choice for one model: which method each linear layer gets and
    how the checkpoint is read. Subclasses override :meth:`linear_method`."""

    name = "none"
    # read GGUF tensors that have kernels as GGUFTensor (blocks as stored) instead of float32
    keep_gguf_blocks = False
    # checkpoint formats the method can serve
    checkpoint_formats: tuple[str, ...] = ("hf", "gguf")

    def __init__(self, ctx: QuantizationContext) -> None:
        self.ctx = ctx
        if ctx.checkpoint_format not in self.checkpoint_formats:
            raise QuantizationError(
                f"--quantization {self.name}: needs a {' or '.join(self.checkpoint_formats)} checkpoint, "
                f"the model is a {ctx.checkpoint_format} checkpoint")

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        """The method for ``layer`` (a :class:`radixserve.layers.linear.Linear`; its
        ``in_features``/``out_features`` are set)."""
        raise NotImplementedError(f"{type(self).__name__} must define linear_method (see QuantizationConfig)")

    def embedding_keeps_blocks(self) -> bool:
        """Whether the token embedding keeps a GGUF table in its blocks (looked up row by row,
        on CPU only: a GPU looks rows up in a float table on the device, without a round trip
        through host memory, so a decode step stays capturable in a CUDA graph)."""
        return self.keep_gguf_blocks and self.ctx.device.type == "cpu"

    def embedding_keeps_16bit(self) -> bool:
        """Whether the token embedding keeps a float16/bfloat16 table in its 16 bits (widening
        the rows it looks up; CPU only, as :meth:`embedding_keeps_blocks`)."""
        return self.ctx.keep_16bit_weights and self.ctx.device.type == "cpu"


_current: contextvars.ContextVar[QuantizationConfig | None] = contextvars.ContextVar(
    "radixserve_quantization", default=None)


@contextlib.contextmanager
def quantization_scope(config: QuantizationConfig | None) -> Iterator[None]:
    """Build a model inside this block and its linear layers take their methods from ``config``."""
    token = _current.set(config)
    try:
        yield
    finally:
        _current.reset(token)


def current_config() -> QuantizationConfig | None:
    return _current.get()

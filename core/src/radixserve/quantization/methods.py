"""The built-in quantization methods: ``none``, ``gguf``, ``w8a16_int8`` and ``int4wo``.

Each keeps its weight as a *matrix*: an object with ``linear(x, bias)`` (``x  # [M, K]``
float32 -> ``# [M, N]``) and ``nbytes()``. The float matrix is radixserve's packed kernel
(or oneDNN, or ``F.linear``); the GGUF matrix is :class:`radixserve.kernels.gguf.GGUFMatrix`;
the int8/int4 ones are :mod:`radixserve.kernels.woq`'s. Where the C kernels are unavailable
(no compiler, another device) a quantized method still runs correctly: GGUF blocks are
dequantised at load, int8/int4 use the PyTorch path of the same stored values. On CUDA the
int8/int4 methods quantize through torchao instead (:mod:`radixserve.quantization.torchao_gpu`).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels import cpu as cpu_kernels
from radixserve.quantization.base import (
    GGUFTensor,
    LinearMethod,
    QuantizationConfig,
    QuantizationError,
)

logger = logging.getLogger(__name__)


def _onednn_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class FloatMatrix:
    """A float ``[N, K]`` weight on the fastest path that applies here:

    * ``radixserve``: radixserve's own kernel (:mod:`radixserve.kernels.cpu`), weights in
      column panels that stream sequentially (~1.8x oneDNN's read rate at batch 1);
    * ``onednn``: oneDNN's blocked layout through ``torch.ops.mkldnn._linear_pointwise``;
    * ``torch``: plain ``F.linear`` (CUDA, half precision, or when neither packs correctly).

    Each packed path is checked against ``F.linear`` on a probe before it is used."""

    def __init__(self, weight: torch.Tensor, use_kernels: bool = True) -> None:
        self.n, self.k = weight.shape
        self.weight: torch.Tensor | None = weight
        self.panels = self.packed = None
        self.kernels = None
        self.path = "torch"
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return
        with torch.no_grad():
            probe = torch.randn(3, self.k)
            ref = F.linear(probe, weight)
            tol = dict(rtol=1e-4, atol=1e-4 * float(ref.abs().max()) + 1e-6)
            kernels = cpu_kernels.load() if use_kernels else None
            if kernels is not None:
                panels = kernels.pack(weight)
                if torch.allclose(kernels.linear(probe, panels, None, self.n), ref, **tol):
                    self.panels, self.kernels, self.weight, self.path = panels, kernels, None, "radixserve"
                    return
            if not _onednn_usable(weight.device, weight.dtype):
                return
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            if torch.allclose(torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], ""), ref, **tol):
                self.packed, self.weight, self.path = packed, None, "onednn"

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.panels is not None:
            return self.kernels.linear(x if x.is_contiguous() else x.contiguous(), self.panels, bias, self.n)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)

    def nbytes(self) -> int:
        t = next(t for t in (self.panels, self.packed, self.weight) if t is not None)
        return t.numel() * t.element_size()


class UnquantizedLinearMethod(LinearMethod):
    """``none``: the weight in the model's dtype, packed for the CPU kernels when float32."""

    name = "none"

    def __init__(self, use_kernels: bool = True, bf16_weights: bool = False) -> None:
        self.use_kernels = use_kernels
        self.bf16_weights = bf16_weights  # keep a float32 layer's weight as bf16 for the CPU kernel

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight is None:  # processed already
            return
        w = layer.weight.detach()
        if self.bf16_weights and w.device.type == "cpu" and w.dtype == torch.float32 and self.use_kernels:
            # --dtype bfloat16 on CPU: the kernel streams bf16 weights (half the bytes of float32)
            # and multiplies float32 activations in float32, on any CPU with AVX2 or AVX-512
            kernels = cpu_kernels.load()
            if kernels is not None:
                from radixserve.kernels import woq

                matrix = woq.BF16Matrix.prepare(kernels, w)
                matrix.path = "radixserve-bf16"
                layer.matrix, layer.weight = matrix, None
                return
        matrix = FloatMatrix(w, self.use_kernels)
        if matrix.path != "torch":
            layer.matrix, layer.weight = matrix, None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        matrix = getattr(layer, "matrix", None)
        if matrix is None:
            return F.linear(x, layer.weight, bias)
        return matrix.linear(x if x.is_contiguous() else x.contiguous(), bias)

    def weight_nbytes(self, layer: nn.Module) -> int:
        matrix = getattr(layer, "matrix", None)
        bias = 0 if layer.bias is None else layer.bias.numel() * layer.bias.element_size()
        return bias + (matrix.nbytes() if matrix is not None else layer.weight.numel() * layer.weight.element_size())

    def describe(self, layer: nn.Module) -> str:
        matrix = getattr(layer, "matrix", None)
        return matrix.path if matrix is not None else "torch"


class HalfLinearMethod(UnquantizedLinearMethod):
    """``none`` on CPU under ``--dtype auto``: a float16/bfloat16 checkpoint weight stays in its
    16 bits (:class:`~radixserve.kernels.woq.F16Matrix` / ``BF16Matrix``, widened exactly in
    registers; float32 activations), from load on: no float32 copy is made. A float32 weight,
    or one the kernels cannot widen here (logged), takes the float32 path of ``none``."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = None  # rows are kept as the checkpoint stores them until processed
        layer.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        layer.segments = []  # [(first row, rows, tensor as loaded)]

    def load_weight(self, layer: nn.Module, name: str, tensor, rows: tuple[int, int]) -> None:
        if name == "bias":
            super().load_weight(layer, name, tensor, rows)
            return
        if isinstance(tensor, GGUFTensor):
            tensor = tensor.dequantize()
        if tuple(tensor.shape) != (rows[1], layer.in_features):
            raise ValueError(f"checkpoint {name} of shape {tuple(tensor.shape)} does not fit "
                             f"{layer.out_features}x{layer.in_features} rows {rows[0]}:{rows[0] + rows[1]}")
        layer.segments.append((*rows, tensor.detach()))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.segments:
            return
        segments = sorted(layer.segments, key=lambda s: s[0])
        starts = [sum(s[1] for s in segments[:i]) for i in range(len(segments))]
        if [s[0] for s in segments] != starts or sum(s[1] for s in segments) != layer.out_features:
            raise ValueError(f"linear layer: rows {[(s[0], s[1]) for s in segments]} do not cover "
                             f"its {layer.out_features} rows once")
        tensors = [s[2] for s in segments]
        layer.segments = []
        dtype = tensors[0].dtype if len({t.dtype for t in tensors}) == 1 else torch.float32
        why = _half_path_missing(dtype, self.use_kernels)
        if why is None:
            from radixserve.kernels import woq

            matrix = woq.HALF_MATRICES[dtype].prepare(cpu_kernels.load(), torch.cat(tensors))
            matrix.path = "radixserve-f16" if dtype == torch.float16 else "radixserve-bf16"
            layer.matrix = matrix
            return
        if why:
            _log_widened(why)
        layer.weight = nn.Parameter(torch.cat([t.float() for t in tensors]), requires_grad=False)
        super().process_weights_after_loading(layer)


def _half_path_missing(dtype: torch.dtype, use_kernels: bool) -> str | None:
    """Why a ``dtype`` weight cannot stay 16-bit here ('' for a weight that is not 16-bit)."""
    from radixserve.kernels import woq

    if dtype not in woq.HALF_MATRICES:
        return ""
    if not use_kernels:
        return "radixserve's CPU kernels are turned off"
    if cpu_kernels.load() is None:
        return f"radixserve's CPU kernels are unavailable ({cpu_kernels.status()})"
    return woq.half_kernel_missing(dtype)


@functools.cache
def _log_widened(why: str) -> None:
    logger.warning("16-bit checkpoint weights widened to float32 at load: %s", why)


class _MatrixMethod(LinearMethod):
    """Shared by the quantized methods: ``layer.matrices = [(first row, rows, matrix)]`` after
    processing; :meth:`apply` runs each part's matrix (one part in the common case)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        dtype = x.dtype
        if x.device.type != "cpu":  # dequantised float matrices in the model's dtype (no CPU kernels there)
            return torch.cat([m.linear(x) for _, _, m in layer.matrices], dim=1) + (0 if bias is None else bias)
        if dtype != torch.float32:
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        parts = layer.matrices
        if len(parts) == 1:
            y = parts[0][2].linear(x, None if bias is None else bias.float())
        else:
            y = torch.cat([m.linear(x) for _, _, m in parts], dim=1)  # [M, N]
            if bias is not None:
                y += bias.float()
        return y if dtype == torch.float32 else y.to(dtype)

    def weight_nbytes(self, layer: nn.Module) -> int:
        bias = 0 if layer.bias is None else layer.bias.numel() * layer.bias.element_size()
        return bias + sum(m.nbytes() for _, _, m in layer.matrices)

    def describe(self, layer: nn.Module) -> str:
        return "+".join(sorted({getattr(m, "kind", type(m).__name__) for _, _, m in layer.matrices}))


class GGUFLinearMethod(_MatrixMethod):
    """``gguf``: the weight stays in the GGUF file's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    Q4_K, Q5_K, Q6_K), multiplied by kernels that dequantise inside the dot product; a
    float16/bfloat16 weight stays 16-bit on CPU (widened in registers: half the bytes of float32)
    whatever ``--dtype`` says (``--quantization none`` is a GGUF file's float32 path).

    A fused layer (QKV, gate/up) may hold parts of different block types; consecutive parts
    of one type are concatenated into one matrix. Float parts (F32/F16 tensors, types without
    a kernel) and every part on a device without the kernels are dequantised at load."""

    name = "gguf"

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = None  # nothing float is allocated: rows arrive as blocks
        layer.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        layer.segments = []  # [(first row, rows, GGUFTensor | float tensor)] as loaded
        layer.matrices = []

    def load_weight(self, layer: nn.Module, name: str, tensor, rows: tuple[int, int]) -> None:
        if name == "bias":
            super().load_weight(layer, name, tensor, rows)
            return
        start, size = rows
        if tuple(tensor.shape) != (size, layer.in_features):
            raise ValueError(f"checkpoint {name} of shape {tuple(tensor.shape)} does not fit "
                             f"{layer.out_features}x{layer.in_features} rows {start}:{start + size}")
        if not isinstance(tensor, GGUFTensor):
            tensor = tensor.detach().float().contiguous().clone()
        layer.segments.append((start, size, tensor))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.segments:
            return
        segments = sorted(layer.segments, key=lambda s: s[0])
        covered = 0
        for start, size, _ in segments:
            if start != covered:
                raise ValueError(f"GGUF linear layer: rows {covered}:{start} were never loaded")
            covered += size
        if covered != layer.out_features:
            raise ValueError(f"GGUF linear layer: {covered} of {layer.out_features} rows loaded")
        groups: list[list] = []  # runs of consecutive segments of one block type (None: float)
        for seg in segments:
            kind = seg[2].qtype if isinstance(seg[2], GGUFTensor) else None
            if groups and groups[-1][0] == kind:
                groups[-1][1].append(seg)
            else:
                groups.append([kind, [seg]])
        layer.matrices = [(segs[0][0], sum(s[1] for s in segs), self._matrix(kind, [s[2] for s in segs], layer))
                       for kind, segs in groups]
        layer.segments = []

    def _matrix(self, qtype: int | None, tensors: list, layer: nn.Module):
        from radixserve.kernels import gguf as gguf_kernels
        from radixserve.kernels import woq

        kernels = cpu_kernels.load() if self.device.type == "cpu" else None
        half = gguf_kernels.HALF_TYPES.get(qtype)
        if half is not None and kernels is not None:  # kept 16-bit, widened in registers
            if woq.half_kernel_missing(half) is None:
                data = torch.cat([t.data for t in tensors]) if len(tensors) > 1 else tensors[0].data
                matrix = woq.HALF_MATRICES[half].prepare(kernels, data.contiguous().view(half))
                matrix.kind = f"gguf-{tensors[0].type_name}"
                return matrix
        if qtype is not None and kernels is not None and qtype in gguf_kernels.KERNEL_TYPES:
            data = torch.cat([t.data for t in tensors]) if len(tensors) > 1 else tensors[0].data
            matrix = gguf_kernels.GGUFMatrix.prepare(kernels, qtype, data.contiguous(), layer.in_features)
            matrix.kind = f"gguf-{tensors[0].type_name}"
            return matrix
        if qtype is not None:
            why = (f"no CPU kernels on {self.device.type} ({cpu_kernels.status()})" if kernels is None
                   else "no kernel for this block type" if half is None
                   else woq.half_kernel_missing(half))
            logger.info("GGUF %s weight dequantised at load: %s", tensors[0].type_name, why)
        weight = torch.cat([t.dequantize() if isinstance(t, GGUFTensor) else t for t in tensors])
        # CPU: float32 (the activations the kernels take); elsewhere the model's dtype
        dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        matrix = FloatMatrix(weight.to(device=self.device, dtype=dtype))
        matrix.kind = "float"
        return matrix


class _WeightOnlyMethod(_MatrixMethod):
    """A float checkpoint quantized at load: the float weight loads as usual, and
    :meth:`process_weights_after_loading` replaces it with ``matrix_cls.prepare(...)``."""

    matrix_name = ""

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.float32, **options) -> None:
        self.device, self.dtype, self.options = device, dtype, options

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, bias: bool) -> None:
        super().create_weights(layer, in_features, out_features, bias)
        layer.matrices = []

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight is None:
            return
        from radixserve.kernels import woq

        if self.device.type != "cpu":  # torchao's kernels (the config checked that they run here)
            from radixserve.quantization.torchao_gpu import TorchAOMatrix

            matrix = TorchAOMatrix(layer.weight.detach(), self.name, self.dtype, self.options.get("group_size"))
            layer.matrices, layer.weight = [(0, layer.out_features, matrix)], None
            return
        kernels = cpu_kernels.load()
        weight = layer.weight.detach().float()
        matrix = getattr(woq, self.matrix_name).prepare(kernels, weight.contiguous(), **self.options)
        matrix.kind = self.name
        layer.matrices, layer.weight = [(0, layer.out_features, matrix)], None


class Int8WeightOnlyMethod(_WeightOnlyMethod):
    """``w8a16_int8``: per-output-channel symmetric int8 weights, float activations."""

    name = "w8a16_int8"
    matrix_name = "Int8Matrix"


class Int4WeightOnlyMethod(_WeightOnlyMethod):
    """``int4wo``: per-group asymmetric int4 weights, float activations."""

    name = "int4wo"
    matrix_name = "Int4Matrix"


# ------------------------------------------------------------------ configs (the registered factories)
class NoQuantization(QuantizationConfig):
    name = "none"

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        if self.ctx.keep_16bit_weights and self.ctx.device.type == "cpu":
            return HalfLinearMethod()
        return UnquantizedLinearMethod(bf16_weights=self.ctx.weight_dtype == torch.bfloat16)


class GGUFQuantization(QuantizationConfig):
    name = "gguf"
    keep_gguf_blocks = True
    checkpoint_formats = ("gguf",)

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        return GGUFLinearMethod(self.ctx.device, self.ctx.dtype)

    def embedding_keeps_16bit(self) -> bool:  # the file's F16/BF16 table as stored, whatever --dtype says
        return self.embedding_keeps_blocks()


class _WeightOnlyQuantization(QuantizationConfig):
    method_cls: type[_WeightOnlyMethod] = _WeightOnlyMethod
    options: dict = {}

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        if ctx.device.type != "cpu":  # torchao's weight-only kernels
            from radixserve.quantization.torchao_gpu import check_torchao_dtype, torchao_probe

            why = torchao_probe(ctx.device) or check_torchao_dtype(self.method_cls.name, ctx.dtype)
            if why is None and self.method_cls.name != "w8a16_int8":  # the LM head is int8 too
                why = check_torchao_dtype("w8a16_int8", ctx.dtype)
            if why is not None:
                raise QuantizationError(f"--quantization {self.name} on {ctx.device.type}: {why} "
                                        f"(or use --quantization none, or gguf for a .gguf file)")

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        return self.method_cls(self.ctx.device, self.ctx.dtype, **self.options)


class Int8WeightOnly(_WeightOnlyQuantization):
    name = "w8a16_int8"
    method_cls = Int8WeightOnlyMethod


class Int4WeightOnly(_WeightOnlyQuantization):
    """int4 per group of ``group_size`` input columns; the LM head stays int8 (one output per
    vocabulary entry: 4-bit logits cost far more accuracy than they save, as llama.cpp's
    mixes also keep the output layer wider)."""

    name = "int4wo"
    method_cls = Int4WeightOnlyMethod
    options = {"group_size": 128}

    def linear_method(self, layer: nn.Module) -> LinearMethod:
        if getattr(layer, "is_lm_head", False):
            return Int8WeightOnlyMethod(self.ctx.device, self.ctx.dtype)
        return super().linear_method(layer)


def _int4wo(group_size: int) -> type[Int4WeightOnly]:
    """``int4wo-<group_size>`` (torchao's spelling, as in SGLang's ``--torchao-config``)."""
    return type(f"Int4WeightOnly{group_size}", (Int4WeightOnly,),
                {"name": f"int4wo-{group_size}", "options": {"group_size": group_size}})


def woq_probe() -> str | None:
    """Why the weight-only methods cannot run here (None: they can)."""
    try:
        from radixserve.kernels import woq  # noqa: F401
    except ImportError as e:
        return f"radixserve.kernels.woq is missing: {e}"
    return None


BUILTIN = {
    "none": (NoQuantization, None, "weights in --dtype (float32 on CPU: radixserve's packed kernel)"),
    "gguf": (GGUFQuantization, None, "a GGUF file's blocks as stored (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K), "
                                      "dequantised inside the matmul"),
    "w8a16_int8": (Int8WeightOnly, woq_probe, "per-channel int8 weights quantized at load, float activations"),
    "int4wo": (Int4WeightOnly, woq_probe, "int4 weights per group of 128 input columns, quantized at load "
                                          "(LM head int8), float activations"),
    **{f"int4wo-{g}": (_int4wo(g), woq_probe, f"int4wo with groups of {g} input columns") for g in (32, 64, 128, 256)},
}

__all__ = ["BUILTIN", "FloatMatrix", "GGUFLinearMethod", "QuantizationError", "UnquantizedLinearMethod"]

"""Dense linear layers; how each stores and multiplies its weight is its linear method.

Weights are ``[out, in]`` like ``nn.Linear``. The layer's :class:`~radixserve.quantization.LinearMethod`
(chosen by ``--quantization`` while the model is built, see :mod:`radixserve.quantization`)
creates what the checkpoint loads into, takes each checkpoint tensor, processes the weight once
the model is placed (:meth:`Linear.pack`) and runs the product. The float method packs a
float32 weight on CPU for radixserve's kernel (or oneDNN); the quantized ones keep GGUF blocks
or int8/int4 weights.

Tensor parallelism (:mod:`radixserve.distributed`) splits a layer over the ranks of a
replica; each rank holds and packs only its shard, so the fast paths above apply per rank:

* :class:`Linear`: replicated, every rank holds the whole layer (routers, small gates);
* :class:`ColumnParallelLinear`: output rows split; a fused layer (QKV, gate/up) splits each
  of its parts on its own, so a rank's shard is its q rows, k rows, v rows stacked;
* :class:`RowParallelLinear`: input columns split; each rank's output is a partial sum and
  one ``tp_all_reduce`` makes it whole (or the caller does, to share one reduction).

Every layer loads from the *full* checkpoint tensor (``load(name, tensor, part)``) and
keeps the rank's shard of it. On a single rank the shards are the whole layer and the
reduction is the identity: the same kernels run as without tensor parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.distributed import get_parallel_state, split_range, tp_all_reduce
from radixserve.quantization import LinearMethod, linear_method_for


class Linear(nn.Module):
    """``quantize=False`` keeps the layer in float whatever ``--quantization`` says (routers
    and other layers whose exact output decides something discrete). ``lora``: the layer's
    adapter stacks when LoRA adapters may target it (:mod:`radixserve.lora`): the step's
    adapters' deltas are added to the output (before a row-parallel layer's all-reduce)."""

    lora = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quantize: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.method: LinearMethod = linear_method_for(self, quantize)
        self.method.create_weights(self, in_features, out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            lead = x.shape[:-1]
            return self.forward(x.reshape(-1, self.in_features)).reshape(*lead, -1)
        y = self.method.apply(self, x, self.bias)
        if self.lora is not None:
            self.lora.apply(x, y)
        return y

    @property
    def path(self) -> str:
        """Which storage and kernel runs the layer: 'radixserve', 'onednn' or 'torch' for a
        float weight, the method's own word (e.g. 'gguf-Q4_1', 'w8a16_int8') otherwise."""
        return self.method.describe(self)

    def weight_nbytes(self) -> int:
        """Resident bytes of the weight and bias as processed."""
        return self.method.weight_nbytes(self)

    @torch.no_grad()
    def pack(self, use_kernels: bool = True) -> bool:
        """Process the loaded weight for its method's kernel (the float method: radixserve's
        packed kernel first, unless ``use_kernels`` is false, then oneDNN). Returns whether
        the layer left the plain ``F.linear`` path. Call once, after the weights are loaded
        and placed."""
        if hasattr(self.method, "use_kernels"):
            self.method.use_kernels = use_kernels
        self.method.process_weights_after_loading(self)
        return self.path != "torch"

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, part: str | None = None) -> None:
        """Copy a checkpoint tensor (``[out, in]`` weight or ``[out]`` bias) into the layer.
        ``part`` names a part of a fused layer (:class:`ColumnParallelLinear`); a plain
        layer has none."""
        if part is not None:
            raise ValueError(f"checkpoint {name} part {part!r}: this layer is not fused")
        self._copy_rows(name, tensor, (0, self.out_features))

    def _copy_rows(self, name: str, tensor: torch.Tensor, rows: tuple[int, int]) -> None:
        """Copy ``tensor`` into output rows ``rows = (start, size)`` of this rank's layer."""
        self.method.load_weight(self, name, tensor, rows)


def even_shard(full: int) -> tuple[int, int, int]:
    """``(full, start, size)``: this rank's share of ``full`` rows or columns, split as evenly
    as possible over the tensor-parallel ranks in rank order."""
    state = get_parallel_state()
    return (full, *split_range(full, state.tp_size, state.tp_rank))


class ColumnParallelLinear(Linear):
    """Output rows split over the tensor-parallel ranks; the output stays split.

    The full layer is a stack of named ``parts`` (one part, or ``q_proj``/``k_proj``/``v_proj``
    of a fused QKV projection, ``gate_proj``/``up_proj`` of a fused gate/up); ``parts[name] =
    (full rows, first row held, rows held)``, and this rank's weight stacks the rows it holds
    of each part in that order. A one-part layer may use the empty name."""

    def __init__(self, in_features: int, parts: dict[str, tuple[int, int, int]], bias: bool = False) -> None:
        super().__init__(in_features, sum(size for _, _, size in parts.values()), bias)
        self.parts = dict(parts)
        self._offsets, offset = {}, 0
        for name, (full, start, size) in self.parts.items():
            if not (0 <= start and size >= 0 and start + size <= full):
                raise ValueError(f"part {name!r}: rows {start}:{start + size} outside its {full} rows")
            self._offsets[name] = offset
            offset += size

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, part: str | None = None) -> None:
        """Copy this rank's rows of the full checkpoint tensor of ``part`` (the only part
        when None)."""
        if part is None:
            if len(self.parts) != 1:
                raise ValueError(f"checkpoint {name}: a fused layer loads by part ({', '.join(self.parts)})")
            part = next(iter(self.parts))
        full, start, size = self.parts[part]
        if tensor.dim() == 0 or tensor.shape[0] != full:
            raise ValueError(f"checkpoint {name}{' (' + part + ')' if part else ''} of shape {tuple(tensor.shape)}: "
                             f"expected {full} rows")
        self._copy_rows(name, tensor.narrow(0, start, size), (self._offsets[part], size))


class RowParallelLinear(Linear):
    """Input columns split over the tensor-parallel ranks: the input is a column-parallel
    layer's split output, each rank's product is a partial sum, and ``tp_all_reduce`` adds
    them up. ``shard = (full columns, first column held, columns held)`` (default: an even
    split). The bias counts once: rank 0 holds it, the other ranks hold zeros.

    ``reduce_results=False`` leaves the sum to the caller, so a block whose output adds
    several row-parallel partial sums (shared and routed experts) reduces once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shard: tuple[int, int, int] | None = None, reduce_results: bool = True) -> None:
        full, start, size = shard if shard is not None else even_shard(in_features)
        if full != in_features or not (0 <= start and start + size <= full):
            raise ValueError(f"shard {shard} does not fit {in_features} input columns")
        super().__init__(size, out_features, bias)
        self.full_in_features, self.in_start = full, start
        self.reduce = reduce_results and get_parallel_state().tp_size > 1
        self._holds_bias = get_parallel_state().tp_rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # [T, out], this rank's partial sum
        return tp_all_reduce(y) if self.reduce else y

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, part: str | None = None) -> None:
        """Copy this rank's columns of the full checkpoint weight ``[out, in]`` (the bias
        on rank 0 only)."""
        if part is not None:
            raise ValueError(f"checkpoint {name} part {part!r}: this layer is not fused")
        if name == "bias":
            self._copy_rows(name, tensor if self._holds_bias else torch.zeros_like(tensor), (0, self.out_features))
            return
        if tensor.dim() != 2 or tensor.shape[1] != self.full_in_features:
            raise ValueError(f"checkpoint {name} of shape {tuple(tensor.shape)}: expected "
                             f"[{self.out_features}, {self.full_in_features}]")
        self._copy_rows(name, tensor.narrow(1, self.in_start, self.in_features), (0, self.out_features))

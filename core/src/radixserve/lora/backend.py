"""The LoRA backend contract (``--lora-backend``): the adapters' deltas of one linear layer
for a batch whose rows use different adapters.

The engine keeps the loaded adapters in a pool of ``max_loras`` slots
(:class:`~radixserve.lora.manager.LoRAManager`); every adapted linear layer holds its ``P``
parts' adapters over the slots (``q_proj``/``k_proj``/``v_proj`` of a fused QKV, ``gate_proj``/
``up_proj``, or the whole layer): one ``a  # [S, P * R, K]`` (part ``p``'s A in rows
``[p R, (p + 1) R)``, since the parts share their input) and per part ``b_p  # [S, R, N_p]``
(B transposed: each rank's output row contiguous), a slot's unused rank rows zero. Once per
step the backend turns the rows' slots into what it needs (:meth:`LoRABackend.prepare`); then
each layer calls :meth:`LoRABackend.apply` once, with its input and its output's columns of each
part:

    h = x[t] @ a[s].T                                   (the "shrink", all parts at once)
    outs[p][t] += scaling[s] * h[p R:(p + 1) R] @ b_p[s]      (the "expand", per part)

for every row ``t`` whose slot ``s >= 0``, never by merging weights. Rows of slot ``-1`` (the
base model) are left as they are. ``x`` is float32 or the activations' dtype; each ``outs[p]``
may be a strided column view of the layer's output.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LoRAContext:
    max_loras: int  # slots of the adapter pool (--max-loras-per-batch)
    max_rank: int  # R (--max-lora-rank)
    dtype: torch.dtype  # the activations'
    device: torch.device
    options: Any = None  # the options the backend declares (radixserve.options)


class LoRABackend(ABC):
    name: str = "?"
    #: whether decode graphs (CUDA graphs; kernel tapes on CPU) may record :meth:`apply`'s calls
    #: and replay them at later steps: :meth:`prepare` writes each step's plan into buffers that
    #: keep their addresses, and a step with no adapter row still makes the calls while a graph
    #: is recorded (the engine records its graphs under such an empty step)
    supports_cuda_graph: bool = False

    def __init__(self, ctx: LoRAContext) -> None:
        self.ctx = ctx

    def prepare(self, token_slots: torch.Tensor) -> Any:
        """Once per step: ``token_slots  # [T] int64`` (each row's slot, ``-1``: none) -> what
        :meth:`apply` receives as ``info`` for every layer of the step. Default: the slots."""
        return token_slots

    @abstractmethod
    def apply(self, x: torch.Tensor, outs: list[torch.Tensor], a: torch.Tensor, bs: list[torch.Tensor],
              scaling: torch.Tensor, info: Any) -> None:
        """Add each row's adapter delta to every part's output in place (see the module
        docstring): ``x  # [T, K]``, ``outs[p]  # [T, N_p]``, ``a  # [S, P * R, K]``,
        ``bs[p]  # [S, R, N_p]``, ``scaling  # [S] float32``."""


def reference_apply(x: torch.Tensor, outs: list[torch.Tensor], a: torch.Tensor, bs: list[torch.Tensor],
                    scaling: torch.Tensor, token_slots: torch.Tensor) -> None:
    """The contract one row at a time in float64: the conformance suite's oracle."""
    r = a.shape[1] // len(bs)
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            h = x[t].double() @ a[s].double().T
            for p, (out, b) in enumerate(zip(outs, bs)):
                out[t] += (h[p * r:(p + 1) * r] @ b[s].double() * float(scaling[s])).to(out.dtype)


@dataclass
class LoRAStep:
    """The step being run: its backend and what the backend prepared for it."""

    backend: LoRABackend
    info: Any


_current: LoRAStep | None = None


def current_lora() -> LoRAStep | None:
    """The LoRA step being run in this process (None: no adapter in the step)."""
    return _current


@contextlib.contextmanager
def lora_step(step: LoRAStep | None) -> Iterator[None]:
    """Run the adapted layers under ``step`` (restoring the outer step after: a decode graph may be
    recorded, under an empty step, in the middle of a real one)."""
    global _current
    outer, _current = _current, step
    try:
        yield
    finally:
        _current = outer


class LoRALayer:
    """One linear layer's adapter stacks: ``a  # [S, P * R, K]`` for its parts, and per part its
    first output column in the layer's output (this rank's) and ``b  # [S, R, N_part]``;
    ``scaling  # [S]`` is the pool's, shared by every layer."""

    def __init__(self, a: torch.Tensor, parts: list[tuple[int, torch.Tensor]], scaling: torch.Tensor) -> None:
        self.a = a
        self.offsets = [offset for offset, _ in parts]
        self.bs = [b for _, b in parts]
        self.sizes = [b.shape[2] for b in self.bs]
        self.scaling = scaling
        # the parts side by side from column 0 (a fused layer's, or one part: the whole layer):
        # one split gives every part's view
        self._tiled = self.offsets == [sum(self.sizes[:p]) for p in range(len(parts))]

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        step = _current
        if step is None:
            return
        if self._tiled and y.shape[1] == sum(self.sizes):
            outs = [y] if len(self.sizes) == 1 else list(y.split(self.sizes, dim=1))
        else:
            outs = [y[:, o:o + n] for o, n in zip(self.offsets, self.sizes)]
        step.backend.apply(x, outs, self.a, self.bs, self.scaling, step.info)

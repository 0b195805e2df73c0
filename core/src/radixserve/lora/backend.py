"""The LoRA backend contract (``--lora-backend``): the adapters' deltas of one linear layer
for a batch whose rows use different adapters.

The engine keeps the loaded adapters in a pool of ``max_loras`` slots
(:class:`~radixserve.lora.manager.LoRAManager`); every adapted linear layer holds, per part
(``q_proj``/``k_proj``/``v_proj`` of a fused QKV, ``gate_proj``/``up_proj``, or the whole
layer), ``a  # [S, R, K]`` and ``b  # [S, N, R]`` over the slots, a slot's unused rank rows and
columns zero. Once per step the backend turns the rows' slots into what it needs
(:meth:`LoRABackend.prepare`); then each layer calls :meth:`LoRABackend.apply` once per part
with the layer's input and its output columns of that part:

    out[t] += scaling[s] * (x[t] @ a[s].T) @ b[s].T    for every row t whose slot s >= 0

(the "shrink" to rank R, then the "expand"), never by merging weights. Rows of slot ``-1``
(the base model) are left as they are. ``x`` is float32 or the activations' dtype; ``out`` may
be a strided column view of the layer's output.
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

    def __init__(self, ctx: LoRAContext) -> None:
        self.ctx = ctx

    def prepare(self, token_slots: torch.Tensor) -> Any:
        """Once per step: ``token_slots  # [T] int64`` (each row's slot, ``-1``: none) -> what
        :meth:`apply` receives as ``info`` for every layer of the step. Default: the slots."""
        return token_slots

    @abstractmethod
    def apply(self, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              scaling: torch.Tensor, info: Any) -> None:
        """Add each row's adapter delta to ``out`` in place (see the module docstring):
        ``x  # [T, K]``, ``out  # [T, N]``, ``a  # [S, R, K]``, ``b  # [S, N, R]``,
        ``scaling  # [S] float32``."""


def reference_apply(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                    token_slots: torch.Tensor) -> None:
    """The contract one row at a time in float64: the conformance suite's oracle."""
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            delta = (x[t].double() @ a[s].double().T) @ b[s].double().T * float(scaling[s])
            out[t] += delta.to(out.dtype)


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
    global _current
    _current = step
    try:
        yield
    finally:
        _current = None


class LoRALayer:
    """One linear layer's adapter stacks: per part, its first output column in the layer's
    output (this rank's), its ``a  # [S, R, K]`` and ``b  # [S, N_part, R]``; ``scaling  # [S]``
    is the pool's, shared by every layer."""

    def __init__(self, parts: dict[str, tuple[int, torch.Tensor, torch.Tensor]], scaling: torch.Tensor) -> None:
        self.parts = parts
        self.scaling = scaling

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> None:
        step = _current
        if step is None:
            return
        for offset, a, b in self.parts.values():
            step.backend.apply(x, y[:, offset:offset + b.shape[1]], a, b, self.scaling, step.info)

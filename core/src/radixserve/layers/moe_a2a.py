"""The MoE all-to-all transport contract (``--moe-a2a-backend``) and the single-rank one.

A transport moves each token to the ranks that hold its chosen experts (``dispatch``, into the
dispatched layout that :mod:`radixserve.layers.moe` describes) and the experts' rows back into
token order (``combine``). Both have asynchronous forms, :meth:`MoEA2ABackend.dispatch_async`
and :meth:`MoEA2ABackend.combine_async`, that start the communication and return a
:class:`Pending` whose ``wait()`` gives the result: between the two the layer computes what does
not need it (single-batch overlap: the shared experts; two-batch overlap: the other
micro-batch's layers). Their defaults run the synchronous form at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixserve.distributed import all_reduce_in

if TYPE_CHECKING:
    from radixserve.layers.moe import MoEContext


@dataclass
class DispatchOutput:
    """The tokens this rank's experts must see, in the dispatched layout."""

    hidden_states: torch.Tensor  # [N, H]
    topk_ids: torch.Tensor  # [N, K] int32 local expert ids, -1: not on this rank
    topk_weights: torch.Tensor  # [N, K] float32
    handle: Any = None  # the transport's own state, for combine


class Pending:
    """A result in flight (a transport's ``dispatch_async`` or ``combine_async``, an asynchronous
    all-reduce): ``wait()`` returns it, once computed. Built from a finished result, or from
    ``finish``, a callable that waits for the communication and returns the result."""

    def __init__(self, done: Any = None, finish: Any = None) -> None:
        self._done, self._finish = done, finish

    def wait(self) -> Any:
        if self._finish is not None:
            self._done, self._finish = self._finish(), None
        return self._done


#: what :meth:`MoEA2ABackend.dispatch_async` returns (its ``wait()`` gives a :class:`DispatchOutput`)
PendingDispatch = Pending


class MoEA2ABackend(ABC):
    """Moves tokens to the ranks that hold their experts and back (``--moe-a2a-backend``)."""

    name: str = "?"

    def __init__(self, ctx: MoEContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> DispatchOutput:
        """``hidden_states  # [T, H]``, ``topk_ids  # [T, K]`` (global expert ids, int64 or
        int32) and ``topk_weights  # [T, K] float32`` -> the dispatched layout."""

    @abstractmethod
    def combine(self, expert_output: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor:
        """The runner's ``# [N, H]`` -> ``# [T, H]`` in the order ``dispatch`` received."""

    def dispatch_async(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor) -> Pending:
        """Optional: start :meth:`dispatch` and return at once; ``.wait()`` gives its
        :class:`DispatchOutput`. The default dispatches now."""
        return Pending(self.dispatch(hidden_states, topk_ids, topk_weights))

    def combine_async(self, expert_output: torch.Tensor, dispatched: DispatchOutput) -> Pending:
        """Optional: start :meth:`combine` and return at once; ``.wait()`` gives its ``# [T, H]``.
        The default combines now."""
        return Pending(self.combine(expert_output, dispatched))

    def combine_partial(self, expert_output: torch.Tensor, dispatched: DispatchOutput) -> torch.Tensor | None:
        """Optional: this rank's ``# [T, H]`` share of :meth:`combine`'s result, without
        communicating: summed over the EP group it equals ``combine``'s output. The layer
        then folds that sum into the one all-reduce it needs anyway. ``None`` (the
        default): not offered, the layer calls ``combine``."""
        return None


class NoA2A(MoEA2ABackend):
    """No token movement. On one rank every expert is local and dispatch and combine are
    the identity. On ``ep_size`` ranks every rank already holds every token (attention is
    tensor-parallel), so dispatch keeps all ``T`` rows and maps global ids to local ones
    (``-1`` for experts elsewhere), and combine sums the ranks' partial outputs with one
    all-reduce over the EP group."""

    name = "none"

    def dispatch(self, hidden_states, topk_ids, topk_weights):
        ids = topk_ids.to(torch.int32)
        if self.ctx.ep_size > 1:
            local = ids - self.ctx.first_local_expert
            ids = torch.where((local >= 0) & (local < self.ctx.num_local_experts), local, torch.full_like(local, -1))
        return DispatchOutput(hidden_states, ids, topk_weights.float())

    def combine(self, expert_output, dispatched):
        return all_reduce_in(expert_output, self.ctx.ep_group_or_default(), self.ctx.ep_size)

    def combine_partial(self, expert_output, dispatched):
        return expert_output  # every row is already in token order; the sum is the all-reduce

"""Speculative decoding: the proposer contract.

A speculative method (a plugin registered through ``register_speculative_algorithms``,
chosen with ``--speculative-algorithm``; names are matched case-insensitively) is built
once at start-up by its factory::

    factory(ctx: SpeculativeContext) -> Proposer

Each decode step the scheduler asks the proposer for a draft per running request
(:meth:`Proposer.propose`), runs **one** target forward over the roots and drafts of the
whole batch (the attention backends' target-verify mode: each draft token sees the cached
prefix and its ancestors in the draft tree), accepts a prefix of each draft path exactly
as plain decoding would have produced it (greedy: argmax match; sampling: tree rejection
sampling against the target's processed distribution), and reports the outcome back
(:meth:`Proposer.observe`). A request whose draft is ``None`` or empty decodes one token
in the same forward.

The core owns every KV slot: drafts' slots are allocated before :meth:`Proposer.propose`
and written into the request-to-token table, so a proposer with a model of its own may
keep a KV pool *indexed by the target's slots* (the same page allocator and the same
prefix cache cover both): its K/V for position ``p`` of a request lives at the target's
slot of ``p``. See :class:`radixserve.speculative.draft_model.DraftModel`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve.speculative.tree import Draft, DraftError, validate

if TYPE_CHECKING:  # torch only in annotations: a proposer plugin's module imports this without torch
    import torch

    from radixserve.engine.request import Req
    from radixserve.models.config import ModelConfig

__all__ = ["Draft", "DraftError", "Proposer", "SpeculativeContext", "TargetModel", "TargetStep", "validate"]


@dataclass(frozen=True)
class TargetModel:
    """What a proposer sees of the target model: where it runs, its sizes, its token
    embedding, and the KV pool and slot table a draft model shares (a draft's K/V live at
    the target's slots)."""

    device: torch.device
    dtype: torch.dtype  # activations
    context_len: int
    max_running_requests: int
    page_size: int
    embed_tokens: Any  # the target's token embedding module (EAGLE heads reuse it)
    kv_pool: Any  # the target's paged KV pool (.num_slots, .page_size, .dtype)
    req_to_token_pool: Any  # .req_to_token  # [R, W]: a request's token slots by its req_pool_idx
    # () -> the whole token embedding table [V, H]; with --tp-size > 1 ``embed_tokens`` holds this
    # rank's slice of the vocabulary only, and this gathers the others' (None on one rank)
    embedding_table: Any = None


@dataclass(frozen=True)
class SpeculativeContext:
    """What a speculative method's factory receives."""

    algorithm: str  # the name it was chosen by, lower case
    model_config: ModelConfig  # the target model's
    target: TargetModel
    tokenizer: Any  # the Hugging Face tokenizer (shared by target and draft)
    eos_token_ids: frozenset[int]
    vocab_size: int  # width of the target's logits
    num_draft_tokens: int  # most verify tokens per request, the root included (drafts <= this - 1)
    num_steps: int  # --speculative-num-steps: depth of a model proposer's draft
    eagle_topk: int  # --speculative-eagle-topk: branching of a model proposer's tree (1: a chain)
    draft_model_path: str | None = None  # --speculative-draft-model-path
    draft_model_quantization: str | None = None  # --speculative-draft-model-quantization (None: the default)
    options: Any = None  # the options the method declares (radixserve.options), as the flags set them
    # the core's own handles for radixserve.speculative.draft_model (the engine's arguments and
    # plugin registry, to load a draft checkpoint and build its attention backend); not for plugins
    core: Any = field(default=None, repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype


@dataclass
class TargetStep:
    """The target model has computed K/V for positions ``[start, start + num)`` of ``req``.

    Reported after every extend chunk and every decode or verify step, once the step's
    tokens are sampled: ``req.all_ids[start:start + num]`` are the tokens at those
    positions and ``req.all_ids[start + num]`` is the next one (the prompt's, or the token
    just sampled). After a verify step, the positions hold the root and the accepted draft
    tokens (their K/V moved to the accepted path); whatever the proposer computed for later
    positions is stale. ``hidden`` is ``[num, len(hidden_layers) * hidden_size]``: the
    target's hidden states after each layer in :attr:`Proposer.hidden_layers`,
    concatenated in that order (None when the proposer asked for none).
    ``num_accepted``: draft tokens accepted in this step (None for an extend).
    """

    req: Req
    start: int
    num: int
    hidden: torch.Tensor | None = None
    num_accepted: int | None = None


class Proposer(ABC):
    """Suggests draft tokens for running requests. Called only from the scheduler's thread.

    Requests (:class:`radixserve.engine.request.Req`) are the core's and read-only to a
    proposer: ``rid``, ``all_ids`` (prompt + output), ``seq_len``, ``params``,
    ``req_pool_idx`` (the row of ``ctx.target.req_to_token_pool.req_to_token``).
    An exception from a proposer costs the batch its drafts for that step (it then decodes
    one token per request) and is logged; it never fails a request.
    """

    #: decoder layers (0-based) whose output hidden states :meth:`observe` should receive
    hidden_layers: tuple[int, ...] = ()

    @abstractmethod
    def propose(self, reqs: Sequence[Req], max_tokens: Sequence[int]) -> list[Draft | None]:
        """One draft (or None) per request, with at most ``max_tokens[i]`` tokens.

        Every request's last token ``req.all_ids[-1]`` is the root of its draft; its K/V is
        not computed yet (the verify step computes it). The target's table row already maps
        positions ``[0, seq_len - 1 + max_tokens[i])`` to slots: computed K/V up to
        ``seq_len - 1``, room for the root and the draft after it (draft node ``j`` of the
        tree uses the slot of column ``seq_len + j``)."""

    def observe(self, steps: Sequence[TargetStep]) -> None:  # noqa: B027 - optional
        """The target computed (and, in a verify step, accepted) these positions."""

    def release(self, req: Req) -> None:  # noqa: B027 - optional
        """``req`` finished, was aborted or was retracted: drop any state kept for it (a
        retracted request comes back through :meth:`observe` when it is prefilled again)."""

    def stats(self) -> dict[str, Any]:
        """Method-specific numbers for ``get_stats()`` (prefixed ``spec_`` by the core)."""
        return {}

"""Reasoning models' think blocks (``--reasoning-parser deepseek-r1|qwen3``), as both the
engine and the server see them.

A reasoning model writes its chain of thought between ``<think>`` and ``</think>`` (one
token each in those vocabularies), then its answer. Where a request's output starts is
decided once, from its prompt tokens, the same way in the engine and the server:

* the prompt's last think marker, searched backwards and only within the final turn (the
  search stops at a special token such as ``<|im_start|>`` or an end of turn), is
  ``<think>``: the output starts **inside** the reasoning (DeepSeek-R1's template ends the
  prompt with ``<think>\\n``, so does a continued assistant message that opened one);
* that marker is ``</think>``: the reasoning is **past** (Qwen3 with ``enable_thinking:
  false`` pre-fills an empty ``<think>\\n\\n</think>\\n\\n``) and the whole output is the answer;
* no marker: the parser's default. ``deepseek-r1`` is inside (the model may repeat the
  opening ``<think>``); ``qwen3`` is **before** reasoning: an output that opens with
  ``<think>`` reasons until ``</think>``, any other output is all answer.

Structured output applies after the reasoning part: :class:`ReasoningMatcher` wraps a
constrained request's grammar matcher. Inside the reasoning nothing is masked and the
grammar sees no token; the token after ``</think>`` is the grammar's first. Before the
reasoning (``qwen3``, no marker) the first token may be the grammar's or ``<think>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve.config import REASONING_PARSERS, ConfigError
from radixserve.grammar import GrammarMatcher
from radixserve.sampling.bitmask import set_bit

THINK_START = "<think>"
THINK_END = "</think>"

# where an output starts, and where a request stands while it generates
BEFORE = "before"  # the output may open a think block with its first token (qwen3)
INSIDE = "inside"  # reasoning until the think-end token
PAST = "past"  # the answer: structured output applies

_DEFAULT_START = {"deepseek-r1": INSIDE, "qwen3": BEFORE}


@dataclass(frozen=True)
class ReasoningSpec:
    """One ``--reasoning-parser`` resolved against the model's tokenizer."""

    name: str
    start_id: int  # <think>
    end_id: int  # </think>
    boundary_ids: frozenset[int]  # special tokens: the search for a prompt's marker stops there
    start_text: str = THINK_START
    end_text: str = THINK_END

    @property
    def default_start(self) -> str:
        return _DEFAULT_START[self.name]

    def initial_state(self, prompt_ids: Sequence[int]) -> str:
        """Where the output of a request with these prompt tokens starts: BEFORE, INSIDE or PAST."""
        for tok in reversed(prompt_ids):
            if tok == self.end_id:
                return PAST
            if tok == self.start_id:
                return INSIDE
            if tok in self.boundary_ids:
                break
        return self.default_start


def _single_token(hf_tokenizer, text: str, name: str) -> int:
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1 or hf_tokenizer.convert_ids_to_tokens(ids[0]) != text:  # not an unknown-word token
        raise ConfigError(
            f"--reasoning-parser {name}: this model's tokenizer has no single {text!r} token (it encodes as "
            f"{f'{len(ids)} tokens' if len(ids) != 1 else 'an unknown word'}); the parser needs a reasoning "
            f"model whose vocabulary holds {THINK_START} and "
            f"{THINK_END} (Qwen3, DeepSeek-R1 and their distillations); drop --reasoning-parser for this model")
    return ids[0]


def build_reasoning_spec(name: str | None, hf_tokenizer) -> ReasoningSpec | None:
    """The spec of ``--reasoning-parser name`` for this tokenizer (None when the flag is
    unset); ConfigError naming the flag when the name is unknown or the tokenizer has no
    single-token think markers."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ConfigError(f"--reasoning-parser: invalid value {name!r}; choose from: {', '.join(REASONING_PARSERS)}")
    start = _single_token(hf_tokenizer, THINK_START, name)
    end = _single_token(hf_tokenizer, THINK_END, name)
    # turn boundaries: the special tokens (<|im_start|>, an end of turn, ...), not an unknown word
    special = set(getattr(hf_tokenizer, "all_special_ids", None) or ()) - {start, end, hf_tokenizer.unk_token_id}
    return ReasoningSpec(name, start, end, frozenset(special))


class ReasoningMatcher(GrammarMatcher):
    """A request's grammar matcher that starts after the reasoning part.

    INSIDE: every token is allowed and none reaches the grammar; the think-end token
    moves to PAST. BEFORE: the grammar's tokens and the think-start token are allowed;
    think-start moves INSIDE, a grammar token moves PAST. PAST: the grammar alone. Each
    accepted token's step is remembered, so :meth:`rollback` (speculative decoding)
    restores the state and rolls the grammar back by the tokens it had seen."""

    def __init__(self, inner: GrammarMatcher, spec: ReasoningSpec, state: str) -> None:
        self.inner = inner
        self.spec = spec
        self.state = state
        self._steps: list[tuple[str, bool]] = []  # per accepted token: (state before it, fed to the grammar)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.state == INSIDE:
            bitmask[row].fill_(-1)
            return
        self.inner.fill_bitmask(bitmask, row)
        if self.state == BEFORE:
            set_bit(bitmask, row, self.spec.start_id)

    def accept_token(self, token_id: int) -> bool:
        before = self.state
        if before == INSIDE:
            if token_id == self.spec.end_id:
                self.state = PAST
        elif before == BEFORE and token_id == self.spec.start_id:
            self.state = INSIDE
        else:
            if not self.inner.accept_token(token_id):
                return False
            self.state = PAST
            self._steps.append((before, True))
            return True
        self._steps.append((before, False))
        return True

    def rollback(self, num_tokens: int) -> None:
        fed = 0
        for _ in range(num_tokens):
            self.state, to_grammar = self._steps.pop()
            fed += to_grammar
        if fed:
            self.inner.rollback(fed)

    def is_terminated(self) -> bool:
        return self.state == PAST and self.inner.is_terminated()


__all__ = ["BEFORE", "INSIDE", "PAST", "THINK_END", "THINK_START", "ReasoningMatcher", "ReasoningSpec",
           "build_reasoning_spec"]

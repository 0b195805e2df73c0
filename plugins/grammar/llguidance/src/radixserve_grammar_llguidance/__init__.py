"""radixserve grammar backend ``llguidance``: constraints compiled by llguidance.

JSON schemas go through llguidance's JSON compiler and come out as compact one-line JSON
with ``", "`` and ``": "`` as separators (free whitespace lets small models pad with
newlines until they run out of tokens); regexes through its regex syntax and
EBNF (GBNF-style, ``root ::= ...``) through its GBNF-to-Lark conversion. Compiling builds
and validates one prototype matcher; each request gets a deep copy of it. Compiles run in
radixserve's worker processes, which send back the validated grammar text; the engine's
process builds the prototype from it again (llguidance's parser limits bound that work). The matcher ends
as soon as llguidance stops: the grammar is complete and nothing but end-of-sequence
could follow (the end-of-sequence token itself is not emitted then).
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any, NamedTuple

from radixserve.plugin_api import hookimpl
from radixserve.plugin_api.grammar import GrammarBackend, GrammarError, GrammarMatcher

_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher, fill) -> None:
        self._m = matcher
        self._fill = fill  # llguidance.torch.fill_next_token_bitmask

    def fill_bitmask(self, bitmask, row: int) -> None:
        self._fill(self._m, bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        # consume_token on a forbidden token leaves the matcher in a permanent error
        # state; the contract wants it unchanged instead.
        if self._m.validate_tokens([token_id]) != 1:
            return False
        return self._m.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._m.is_stopped()


class LLGuidanceGrammar(NamedTuple):
    """A compiled grammar: llguidance's grammar text, validated, and its prototype matcher."""

    grammar: str
    matcher: Any


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._args = (tokenizer, vocab_size, list(eos_token_ids))  # what a worker process rebuilds from
        self._llg = llguidance
        self._fill = llguidance.torch.fill_next_token_bitmask
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)

    # pickled to the compile worker processes: rebuilt from the Hugging Face tokenizer
    def __getstate__(self) -> dict:
        return {"args": self._args}

    def __setstate__(self, state: dict) -> None:
        self.__init__(*state["args"])

    def _grammar(self, kind: str, text: str) -> str:
        llg = self._llg
        if kind == "json_schema":
            try:
                json.loads(text)
            except ValueError as e:
                raise GrammarError(f"json_schema is not valid JSON: {e}") from e
            return llg.LLMatcher.grammar_from_json_schema(text, defaults=_COMPACT_JSON)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_COMPACT_JSON)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(text)
        if kind == "ebnf":
            return llg.grammar_from("ebnf", text)
        raise GrammarError(f"llguidance: unknown grammar kind {kind!r}")

    def compile(self, kind: str, text: str):
        try:
            grammar = self._grammar(kind, text)
        except ValueError as e:  # GrammarError included
            raise GrammarError(str(e)) from e
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tokenizer)
        if is_error:
            raise GrammarError(messages[0] if messages else "llguidance rejected the grammar")
        return self._prototype(grammar)

    def _prototype(self, grammar: str) -> LLGuidanceGrammar:
        matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return LLGuidanceGrammar(grammar, matcher)

    def serialize(self, compiled: LLGuidanceGrammar) -> bytes:
        return compiled.grammar.encode()

    def deserialize(self, data: bytes) -> LLGuidanceGrammar:
        return self._prototype(data.decode())

    def new_matcher(self, compiled: LLGuidanceGrammar) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.matcher.deep_copy(), self._fill)


def _probe() -> str | None:
    if importlib.util.find_spec("llguidance") is None:
        return "llguidance is not installed (pip install llguidance)"
    return None


@hookimpl
def register_grammar_backends(register):
    register("llguidance", LLGuidanceBackend, probe=_probe,
             description="JSON schema / regex / EBNF through llguidance")

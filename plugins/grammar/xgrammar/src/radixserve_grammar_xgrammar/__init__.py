"""radixserve grammar backend ``xgrammar`` (the default): constraints compiled by xgrammar.

JSON schemas compile with xgrammar's strict mode (objects take no properties beyond the
schema's unless it says so) into compact one-line JSON with ``", "`` and ``": "`` as
separators (free whitespace lets small models pad with newlines until they run out of
tokens); regexes and EBNF (GBNF-style, ``root ::= ...``) through its
own converters. The matcher ends once it accepts an end-of-sequence token: when the
grammar is complete its mask allows only those. Compiles run in radixserve's worker processes
and come back through xgrammar's JSON serialization of the compiled grammar.
"""

from __future__ import annotations

import importlib.util
import re

from radixserve.plugin_api import hookimpl
from radixserve.plugin_api.grammar import GrammarBackend, GrammarError, GrammarMatcher

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[13:43:36] /project/cpp/x.cc:94: "


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location and trailing blank lines."""
    text = _LOG_PREFIX.sub("", str(e).strip())
    return text.removeprefix("Check failed: (error.empty()) is false: ") or type(e).__name__


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self._m.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        import xgrammar

        self._setup(xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids)))

    def _setup(self, info) -> None:
        import xgrammar

        self._xgr = xgrammar
        self._info = info
        # radixserve caches compiled grammars itself (failures too), so xgrammar's own
        # cache would only hold a second copy.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    # pickled to the compile worker processes: the tokenizer info is all they need
    def __getstate__(self) -> dict:
        return {"info": self._info.serialize_json()}

    def __setstate__(self, state: dict) -> None:
        import xgrammar

        self._setup(xgrammar.TokenizerInfo.deserialize_json(state["info"]))

    def serialize(self, compiled) -> bytes:
        return compiled.serialize_json().encode()

    def deserialize(self, data: bytes):
        return self._xgr.CompiledGrammar.deserialize_json(data.decode(), self._info)

    def compile(self, kind: str, text: str):
        c = self._compiler
        try:
            if kind == "json_schema":
                return c.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', strict_mode=False,
                                             any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "ebnf":
                return c.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(_reason(e)) from e
        raise GrammarError(f"xgrammar: unknown grammar kind {kind!r}")

    def new_matcher(self, compiled) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))


def _probe() -> str | None:
    if importlib.util.find_spec("xgrammar") is None:
        return "xgrammar is not installed (pip install xgrammar)"
    return None


@hookimpl
def register_grammar_backends(register):
    register("xgrammar", XGrammarBackend, probe=_probe,
             description="JSON schema / regex / EBNF through xgrammar (default)")

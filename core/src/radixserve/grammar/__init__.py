"""Structured output: the grammar-backend contract and the request-side helpers.

A grammar backend (a plugin registered through ``register_grammar_backends``) is built
once at start-up by its factory::

    factory(tokenizer=hf_tokenizer, vocab_size=int, eos_token_ids=list[int]) -> GrammarBackend

``tokenizer`` is the model's Hugging Face tokenizer and ``vocab_size`` the model's logits
width, which may exceed the tokenizer's vocabulary (padding rows are never allowed).

The backend compiles ``(kind, text)`` into an opaque compiled grammar and makes one
:class:`GrammarMatcher` per request from it. A backend that overrides
:meth:`GrammarBackend.serialize` and :meth:`GrammarBackend.deserialize` (and pickles)
compiles in a worker process that is killed at ``--grammar-compile-timeout``
(:mod:`radixserve.grammar.workers`); any other compiles on a worker thread, which cannot be
stopped (see :mod:`radixserve.grammar.manager`). Kinds:

* ``json_schema``: ``text`` is a JSON schema as a JSON string;
* ``json_object``: any JSON object (``text`` is ignored);
* ``regex``: the whole output matches the regular expression;
* ``ebnf``: a GBNF-style grammar (``root ::= ...``) whose ``root`` rule the output matches.

Token masks are int32 bitmasks ``[B, ceil(V / 32)]``: bit ``t % 32`` of word ``t // 32``
set means token ``t`` is allowed. The core allocates them and applies them to the logits
(:func:`apply_token_bitmask_`); matchers only fill their own row.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from radixserve.sampling.params import InvalidSamplingParams

if TYPE_CHECKING:  # torch only in annotations: a grammar plugin's module imports this without torch
    import torch

    from radixserve.sampling.bitmask import (
        allocate_token_bitmask,
        apply_token_bitmask_,
        bitmask_width,
    )

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf")
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf")  # SamplingParams fields, one kind each
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what response_format json_object becomes


class GrammarError(ValueError):
    """A grammar that does not compile; the message is the compiler's reason."""


class GrammarMatcher(ABC):
    """One request's position in its grammar. Used only from the scheduler's thread."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 ``[B, W]``, on CPU).

        Once the grammar is complete, only the end-of-sequence tokens are allowed."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no state change) if the grammar forbids it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (for speculative decoding)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has ended: no token but end-of-sequence can follow, or
        end-of-sequence has been accepted. The request then finishes with ``stop``."""


class GrammarBackend(ABC):
    """A structured-output backend, built once per engine by its plugin's factory."""

    name: str = ""

    @abstractmethod
    def compile(self, kind: str, text: str) -> Any:
        """Compile a grammar of ``kind`` (one of :data:`GRAMMAR_KINDS`).

        Runs in a worker process (or on a worker thread) and may be slow. Raises
        :class:`GrammarError` with the compiler's reason when ``text`` is invalid. The result
        is shared by every request with the same ``(kind, text)`` and must stay usable from
        other threads."""

    def serialize(self, compiled: Any) -> bytes:
        """``compiled`` as bytes, in the worker process that compiled it.

        Override it together with :meth:`deserialize` to compile in killable worker
        processes; the backend object is then pickled to each worker (define
        ``__getstate__``/``__setstate__`` for state that does not pickle). The default
        raises NotImplementedError: compiles run on threads in the engine's process."""
        raise NotImplementedError

    def deserialize(self, data: bytes) -> Any:
        """The compiled grammar :meth:`serialize` gave, in the engine's process. Runs on a
        compile thread; keep it much cheaper than compiling (bounded by the grammar's size)."""
        raise NotImplementedError

    @property
    def compiles_in_processes(self) -> bool:
        """True when the backend overrides :meth:`serialize` and :meth:`deserialize`."""
        cls = type(self)
        return cls.serialize is not GrammarBackend.serialize and cls.deserialize is not GrammarBackend.deserialize

    @abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled`` (cheap; called per request)."""


# ------------------------------------------------------------- request side
def grammar_key(params) -> tuple[str, str] | None:
    """``(kind, text)`` of a verified :class:`SamplingParams`' constraint, or None.

    The schema ``{"type": "object"}`` alone becomes kind ``json_object`` (any object)."""
    if params.json_schema is not None:
        try:
            if json.loads(params.json_schema) == {"type": "object"}:
                return ("json_object", "")
        except ValueError:
            pass  # the backend reports the syntax error with its own words
        return ("json_schema", params.json_schema)
    if params.regex is not None:
        return ("regex", params.regex)
    if params.ebnf is not None:
        return ("ebnf", params.ebnf)
    return None


def check_constraint_size(params, limit: int) -> None:
    """Refuse a constraint (``json_schema``, ``regex`` or ``ebnf``) whose text is over
    ``limit`` UTF-8 bytes (``--grammar-max-spec-bytes``; 0: no limit) with
    :class:`InvalidSamplingParams` naming the field."""
    if not limit:
        return
    for field in CONSTRAINT_FIELDS:
        text = getattr(params, field)
        if text is None:
            continue
        size = len(text) if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise InvalidSamplingParams(field, f"{field} is {'over ' if len(text) > limit else ''}{size} bytes, "
                                               f"over the limit of {limit} (--grammar-max-spec-bytes)")


def constraint_from_response_format(response_format: Any) -> dict[str, str]:
    """Map an OpenAI ``response_format`` to sampling-parameter fields.

    ``{"type": "text"}`` gives ``{}``; ``{"type": "json_object"}`` gives a constraint to any
    JSON object; ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
    "strict": ...}}`` gives ``{"json_schema": <the schema as JSON text>}``. A bad shape
    raises :class:`InvalidSamplingParams` with ``param="response_format"``."""

    def bad(message: str) -> InvalidSamplingParams:
        return InvalidSamplingParams("response_format", f"response_format: {message}")

    if response_format is None:
        return {}
    if not isinstance(response_format, dict):
        raise bad(f"expected an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind != "json_schema":
        raise bad(f"type must be one of 'text', 'json_object', 'json_schema', got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("type 'json_schema' needs a 'json_schema' object with 'name' and 'schema'")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad(f"json_schema.name must be a string, got {name!r}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"json_schema.strict must be true or false, got {strict!r}")
    # OpenAI's SDKs send the schema as "schema"; some clients use "schema_".
    schema = spec.get("schema", spec.get("schema_"))
    if schema is None:
        return {"json_schema": JSON_OBJECT_SCHEMA}  # no schema: any JSON object
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise bad(f"json_schema.schema must be a JSON schema object, got {type(schema).__name__}")
    return {"json_schema": json.dumps(schema)}


__all__ = [
    "CONSTRAINT_FIELDS",
    "GRAMMAR_KINDS",
    "JSON_OBJECT_SCHEMA",
    "GrammarBackend",
    "GrammarError",
    "GrammarMatcher",
    "allocate_token_bitmask",
    "apply_token_bitmask_",
    "bitmask_width",
    "check_constraint_size",
    "constraint_from_response_format",
    "grammar_key",
]

_BITMASK_NAMES = frozenset({"allocate_token_bitmask", "apply_token_bitmask_", "bitmask_width"})


def __getattr__(name: str):
    # the bitmask helpers import torch: loaded on first use, re-exported here as before
    if name in _BITMASK_NAMES:
        from radixserve.sampling import bitmask

        return getattr(bitmask, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

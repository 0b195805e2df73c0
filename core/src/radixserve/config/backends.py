"""Engine flags: the attention and grammar backends, and how JSON constraints are bounded."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config.common import Checks, flag
from radixserve.flags import flag_of
from radixserve.grammar.bounds import DEFAULT_MAX_ITEMS, DEFAULT_MAX_STRING_LENGTH
from radixserve.grammar.manager import DEFAULT_MAX_COMPILES_PER_CLIENT

DEFAULT_ATTENTION_BACKEND = "torch_native"
DEFAULT_GRAMMAR_COMPILE_TIMEOUT = 30.0
DEFAULT_GRAMMAR_MAX_SPEC_BYTES = 1 << 20  # 1 MiB: far above hand-written schemas and tool lists


@dataclass
class BackendArgs(Checks):
    attention_backend: str | None = flag(None, "attention backend for both phases")
    prefill_attention_backend: str | None = flag(
        None,
        "attention backend for prefill/extend (overrides --attention-backend)",
    )
    decode_attention_backend: str | None = flag(
        None,
        "attention backend for decode (overrides --attention-backend)",
    )
    grammar_backend: str | None = flag(
        None,
        "structured-output backend: xgrammar, llguidance or none (default: xgrammar when installed, "
        "else none)",
    )
    grammar_compile_timeout: float = flag(
        DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
        "seconds a grammar may take to compile before its request fails with a 400; the compile is "
        "stopped then (its worker process is killed)",
    )
    grammar_max_spec_bytes: int = flag(
        DEFAULT_GRAMMAR_MAX_SPEC_BYTES,
        "largest structured-output constraint a request may give, in UTF-8 bytes (the json_schema, "
        "response_format schema, regex or ebnf text); larger ones are refused with a 400 naming the "
        "field; 0: no limit",
    )
    grammar_max_compiles_per_client: int = flag(
        DEFAULT_MAX_COMPILES_PER_CLIENT,
        "grammar compiles one client (the HTTP peer's address) may have queued or running at once; "
        "its further compiles wait for their turn (64 at most, then a 429), so one client never "
        "holds more compile workers than this (grammars already compiled or compiling do not count); "
        "0: no limit",
    )
    constrained_json_max_string_length: int = flag(
        DEFAULT_MAX_STRING_LENGTH,
        "JSON constraints (response_format, json_schema) generate free strings (no maxLength, "
        "pattern, enum or format of their own) of at most this many characters, so a model looping "
        "inside one still ends its reply; the schema's own maxLength wins; 0: unbounded",
    )
    constrained_json_max_items: int = flag(
        DEFAULT_MAX_ITEMS,
        "JSON constraints generate free arrays (no maxItems of their own), and json_object's objects,"
        " of at most this many items; 0: unbounded",
    )
    constrained_json_disable_any_whitespace: bool = flag(
        False,
        "accepted for SGLang compatibility: radixserve's JSON constraints always generate compact "
        "JSON (one line, ', ' and ': ' separators)",
    )

    def check_backends(self) -> None:
        self._check_seconds("grammar_compile_timeout")
        for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
                     "grammar_backend"):
            self._check_name(name, "a backend name")
        self._check_int("grammar_max_spec_bytes", minimum=0)
        self._check_int("grammar_max_compiles_per_client", minimum=0)
        self._check_int("constrained_json_max_string_length", minimum=0)
        self._check_int("constrained_json_max_items", minimum=0)

    @property
    def prefill_backend_name(self) -> str:
        return self.prefill_attention_backend or self.attention_backend or DEFAULT_ATTENTION_BACKEND

    @property
    def decode_backend_name(self) -> str:
        return self.decode_attention_backend or self.attention_backend or DEFAULT_ATTENTION_BACKEND

    def backend_flag(self, phase: str) -> str:
        """The flag that chose the attention backend of ``phase`` ("prefill" or "decode")."""
        specific = f"{phase}_attention_backend"
        return flag_of(specific) if getattr(self, specific) else "--attention-backend"

"""Per-request sampling parameters: one validated dataclass.

Field names and defaults follow SGLang's ``SamplingParams`` so request bodies written for
SGLang work unchanged. :meth:`SamplingParams.verify` checks every field and normalises a
few (``stop`` becomes a list, ``top_k=0`` becomes ``-1``); a bad value raises
:class:`InvalidSamplingParams`, whose ``param`` attribute and message name the field.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes at most 64 bits


class InvalidSamplingParams(ValueError):
    """A sampling parameter with a bad type or value.

    ``param`` is the offending field name (or the unknown key given to ``from_dict``);
    the message always starts with it, e.g. ``"top_p must be in (0, 1], got 1.5"``.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request.

    ``max_new_tokens=None`` means "up to the context length" (the engine resolves it).
    ``top_k`` of ``-1`` or ``0`` disables top-k; ``top_p=1`` and ``min_p=0`` disable their
    filters. ``repetition_penalty`` uses Hugging Face semantics over prompt and output
    tokens; ``frequency_penalty``/``presence_penalty`` use OpenAI semantics over output
    tokens only. ``top_logprobs_num`` only takes effect with ``return_logprob=True``.
    ``json_schema`` (a JSON schema as JSON text), ``regex`` and ``ebnf`` constrain the
    output to a grammar; at most one may be set. ``logit_bias`` maps token ids (ints, or
    strings of ints as JSON gives them) to a number in [-100, 100] added to that token's
    logit before anything else (OpenAI semantics: +100 forces the token, -100 bans it).
    ``logprob_start_len`` (with ``return_logprob``) asks for the logprobs of the prompt
    tokens from that position on (SGLang's field; -1: output tokens only); it must be
    below the prompt length, which the engine checks.

    Construct, then call :meth:`verify` (or use :meth:`from_dict`, which does both).
    After ``verify()``: ``stop`` and ``stop_token_ids`` are lists, ``top_k`` is ``-1`` or
    ``>= 1``, float fields given as ints are floats, and ``logit_bias`` is None or a
    non-empty ``{int token id: float}``.
    """

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    return_logprob: bool = False
    top_logprobs_num: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[int, float] | None = None
    logprob_start_len: int = -1
    # structured output: at most one of these (see radixserve.grammar)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, d: dict[str, Any], vocab_size: int | None = None) -> SamplingParams:
        """Build from a request body's ``sampling_params`` and verify it.

        Raises InvalidSamplingParams for an unknown key (listing the valid ones) or a bad value.
        """
        if not isinstance(d, dict):
            raise InvalidSamplingParams(
                "sampling_params", f"sampling_params must be a dict, got {type(d).__name__}"
            )
        valid = cls.field_names()
        for key in d:
            if key not in valid:
                raise InvalidSamplingParams(
                    str(key),
                    f"{key!r} is not a sampling parameter; valid keys: {', '.join(valid)}",
                )
        params = cls(**d)
        params.verify(vocab_size)
        return params

    @property
    def is_greedy(self) -> bool:
        """True when the choice is the argmax: ``temperature == 0`` or ``top_k == 1``."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when a repetition, frequency or presence penalty is set."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def verify(self, vocab_size: int | None = None) -> None:
        """Check every field's type and range; normalise ``stop``, ``stop_token_ids``, ``top_k``.

        ``vocab_size``, when given, bounds ``stop_token_ids`` and ``logit_bias``'s token ids.
        Raises InvalidSamplingParams.
        """
        _int(self, "max_new_tokens", minimum=0, optional=True)
        _int(self, "min_new_tokens", minimum=0)
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise InvalidSamplingParams(
                "min_new_tokens",
                f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens}",
            )
        _float(self, "temperature", lambda x: x >= 0, ">= 0")
        _float(self, "top_p", lambda x: 0 < x <= 1, "in (0, 1]")
        _int(self, "top_k", minimum=-1, bound="-1 or 0 (disabled) or >= 1")
        if self.top_k == 0:
            self.top_k = -1
        _float(self, "min_p", lambda x: 0 <= x <= 1, "in [0, 1]")
        _float(self, "repetition_penalty", lambda x: x > 0, "> 0")
        _float(self, "frequency_penalty", lambda x: -2 <= x <= 2, "in [-2, 2]")
        _float(self, "presence_penalty", lambda x: -2 <= x <= 2, "in [-2, 2]")
        _int(self, "seed", minimum=0, maximum=MAX_SEED, optional=True)
        _int(self, "n", minimum=1)
        _int(self, "top_logprobs_num", minimum=0, maximum=MAX_TOP_LOGPROBS)
        _int(self, "logprob_start_len", minimum=-1, bound="-1 (output tokens only) or >= 0")
        for name in (
            "ignore_eos",
            "return_logprob",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "no_stop_trim",
        ):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParams(
                    name, f"{name} must be true or false, got {getattr(self, name)!r}"
                )
        self.stop = _stop_list(self.stop)
        self.stop_token_ids = _token_id_list(self.stop_token_ids, vocab_size)
        self.logit_bias = _logit_bias(self.logit_bias, vocab_size)
        _constraint(self)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True when the prompt tokens' logprobs are asked for (``return_logprob`` and
        ``logprob_start_len >= 0``)."""
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def has_constraint(self) -> bool:
        """True when one of ``json_schema``, ``regex``, ``ebnf`` is set."""
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None


def _int(
    p: SamplingParams,
    name: str,
    *,
    minimum: int,
    maximum: int | None = None,
    optional: bool = False,
    bound: str | None = None,
) -> None:
    value = getattr(p, name)
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an integer or null" if optional else "an integer"
        raise InvalidSamplingParams(name, f"{name} must be {kind}, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        if bound is None:
            bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise InvalidSamplingParams(name, f"{name} must be {bound}, got {value}")


def _float(p: SamplingParams, name: str, ok, bound: str) -> None:
    value = getattr(p, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidSamplingParams(name, f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or not ok(value):
        raise InvalidSamplingParams(name, f"{name} must be {bound}, got {value!r}")
    setattr(p, name, value)


def _stop_list(stop: Any) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise InvalidSamplingParams(
            "stop", f"stop must be a string or a list of strings, got {type(stop).__name__}"
        )
    for i, s in enumerate(items):
        if not isinstance(s, str) or not s:
            raise InvalidSamplingParams("stop", f"stop[{i}] must be a non-empty string, got {s!r}")
    return list(items)


def _token_id_list(ids: Any, vocab_size: int | None) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise InvalidSamplingParams(
            "stop_token_ids", f"stop_token_ids must be a list of integers, got {type(ids).__name__}"
        )
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidSamplingParams(
                "stop_token_ids", f"stop_token_ids[{i}] must be an integer, got {t!r}"
            )
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = ">= 0" if vocab_size is None else f"in [0, {vocab_size}) (the vocabulary)"
            raise InvalidSamplingParams(
                "stop_token_ids", f"stop_token_ids[{i}] must be {bound}, got {t}"
            )
    return list(ids)


MAX_LOGIT_BIAS = 100.0


def _logit_bias(bias: Any, vocab_size: int | None) -> dict[int, float] | None:
    """``{token id: bias}`` with int keys (JSON's string keys converted); None when empty."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise InvalidSamplingParams(
            "logit_bias", f"logit_bias must be an object mapping token ids to numbers, got {type(bias).__name__}"
        )
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key.strip()):
            tid = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            tid = key
        else:
            raise InvalidSamplingParams("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            bound = ">= 0" if vocab_size is None else f"in [0, {vocab_size}) (the vocabulary)"
            raise InvalidSamplingParams("logit_bias", f"logit_bias key {key!r} must be a token id {bound}")
        if tid in out:
            raise InvalidSamplingParams("logit_bias", f"logit_bias gives token id {tid} twice")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidSamplingParams(
                "logit_bias", f"logit_bias[{key!r}] must be a number in [-100, 100], got {value!r}"
            )
        out[tid] = float(value)
    return out or None


def _constraint(p: SamplingParams) -> None:
    given = []
    for name in ("json_schema", "regex", "ebnf"):
        value = getattr(p, name)
        if value is None:
            continue
        if not isinstance(value, str):
            hint = " (pass the schema as JSON text, e.g. json.dumps(schema))" if name == "json_schema" else ""
            raise InvalidSamplingParams(name, f"{name} must be a string, got {type(value).__name__}{hint}")
        given.append(name)
    if len(given) > 1:
        raise InvalidSamplingParams(
            given[0],
            f"{' and '.join(given)} cannot be combined: give at most one of json_schema, regex, ebnf",
        )

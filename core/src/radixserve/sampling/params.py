"""Per-request sampling parameters: one validated dataclass.

Field names and defaults follow SGLang's ``SamplingParams`` so request bodies written for
SGLang work unchanged. :meth:`SamplingParams.verify` checks every field and normalises a
few (``stop`` becomes a list, ``top_k=0`` becomes ``-1``); a bad value raises
:class:`InvalidSamplingParams`, whose ``param`` attribute and message name the field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from typing import Any

MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes at most 64 bits
# SGLang's bounds on stop_regex: at most 32 patterns of at most 256 bytes each
MAX_STOP_REGEX_COUNT = 32
MAX_STOP_REGEX_BYTES = 256


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
    ``stop_regex`` (a pattern or a list) stops generation at the first match in the output
    text, exactly as a stop string does (the text ends before the match unless
    ``no_stop_trim``); a pattern that can match the empty string is refused.
    SGLang's other fields: ``sampling_seed`` is another name for ``seed``;
    ``custom_params`` (a JSON object) is carried with the request for custom logit
    processors and otherwise unused; ``stream_interval`` (tokens between streamed chunks)
    is applied by the HTTP server; ``beam_width`` may only be 1 (no beam search);
    ``structural_tag`` and ``watermark`` are refused when set (not implemented).

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
    stop_regex: str | list[str] | None = None
    # the final normed hidden state of the prompt and of each output token (True), or of the
    # last one only ("last"), as SGLang's return_hidden_states
    return_hidden_states: bool | str = False
    # SGLang's fields with nothing or little to do here (see the class docstring)
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    beam_width: int | None = None
    structural_tag: str | None = None
    watermark: Any = None
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
        _seed(self)
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
        if self.return_hidden_states not in (True, False, "last"):
            raise InvalidSamplingParams(
                "return_hidden_states",
                f'return_hidden_states must be true, false or "last", got {self.return_hidden_states!r}'
            )
        _int(self, "stream_interval", minimum=1, optional=True)
        _int(self, "beam_width", minimum=1, maximum=1, optional=True,
             bound="1 (beam search is not supported)")
        for name in ("structural_tag", "watermark"):
            if getattr(self, name) is not None:
                raise InvalidSamplingParams(name, f"{name} is not supported by this server; omit it or pass null")
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            raise InvalidSamplingParams(
                "custom_params", f"custom_params must be a JSON object, got {type(self.custom_params).__name__}"
            )
        self.stop = _stop_list(self.stop)
        self.stop_regex = _stop_regex_list(self.stop_regex)
        self.stop_token_ids = _token_id_list(self.stop_token_ids, vocab_size)
        self.logit_bias = _logit_bias(self.logit_bias, vocab_size)
        _constraint(self)

    # per-request structures the scheduler reads every step, built once (after verify())
    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set, for the per-token check."""
        return frozenset(self.stop_token_ids or ())

    @functools.cached_property
    def stop_token_tensor(self):
        """``stop_token_ids`` as a CPU int64 tensor (the ``min_new_tokens`` mask)."""
        import torch  # as logit_bias_tensors

        return torch.tensor(self.stop_token_ids or [], dtype=torch.int64)

    @functools.cached_property
    def logit_bias_tensors(self):
        """``logit_bias`` as two CPU tensors, (token ids int64, biases float32); None without one."""
        if not self.logit_bias:
            return None
        import torch  # only requests with a logit_bias pay for it; validating stays torch-free

        return (torch.tensor(list(self.logit_bias.keys()), dtype=torch.int64),
                torch.tensor(list(self.logit_bias.values()), dtype=torch.float32))

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


def _seed(p: SamplingParams) -> None:
    """``sampling_seed`` (SGLang's name) and ``seed`` are one field; both given must agree."""
    if p.sampling_seed is not None:
        if p.seed is not None and p.seed != p.sampling_seed:
            raise InvalidSamplingParams(
                "sampling_seed", f"sampling_seed ({p.sampling_seed!r}) and seed ({p.seed!r}) differ; give one"
            )
        _int(p, "sampling_seed", minimum=0, maximum=MAX_SEED)
        p.seed, p.sampling_seed = p.sampling_seed, None
    _int(p, "seed", minimum=0, maximum=MAX_SEED, optional=True)


def regex_width(pattern: str) -> tuple[int, int | None]:
    """The fewest and most characters ``pattern`` can match (None: no bound)."""
    try:
        import re._parser as sre_parse
    except ImportError:  # Python < 3.11
        import sre_parse
    lo, hi = sre_parse.parse(pattern).getwidth()
    return lo, (None if hi >= sre_parse.MAXREPEAT else hi)


def _stop_regex_list(patterns: Any) -> list[str]:
    if patterns is None:
        return []
    items = [patterns] if isinstance(patterns, str) else patterns
    if not isinstance(items, (list, tuple)):
        raise InvalidSamplingParams(
            "stop_regex", f"stop_regex must be a pattern or a list of patterns, got {type(patterns).__name__}"
        )
    if len(items) > MAX_STOP_REGEX_COUNT:
        raise InvalidSamplingParams(
            "stop_regex", f"stop_regex has {len(items)} patterns; at most {MAX_STOP_REGEX_COUNT} are allowed"
        )
    for i, pattern in enumerate(items):
        if not isinstance(pattern, str) or not pattern:
            raise InvalidSamplingParams("stop_regex", f"stop_regex[{i}] must be a non-empty string, got {pattern!r}")
        if len(pattern.encode("utf-8")) > MAX_STOP_REGEX_BYTES:
            raise InvalidSamplingParams(
                "stop_regex", f"stop_regex[{i}] is over {MAX_STOP_REGEX_BYTES} bytes"
            )
        try:
            re.compile(pattern)
            lo, _ = regex_width(pattern)
        except (re.error, OverflowError, RecursionError) as e:
            raise InvalidSamplingParams("stop_regex", f"stop_regex[{i}] is not a valid regex: {e}") from None
        if lo == 0:
            raise InvalidSamplingParams(
                "stop_regex", f"stop_regex[{i}] ({pattern!r}) can match the empty string, so it would stop at once"
            )
    return list(items)


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

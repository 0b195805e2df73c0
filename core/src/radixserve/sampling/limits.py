"""The per-request cost bounds (``radixserve.config.limits``) applied to a request.

Both the engine (``Engine.generate``) and the HTTP server (before anything reaches the
engine) check with these, so an over-limit request is refused the same way everywhere:
:class:`InvalidSamplingParams` naming the field and the flag that sets the bound.
"""

from __future__ import annotations

from typing import Any

from radixserve.flags import flag_of
from radixserve.sampling.params import InvalidSamplingParams, SamplingParams


def _over(param: str, what: str, limit_name: str, limit: int) -> InvalidSamplingParams:
    return InvalidSamplingParams(param, f"{what}, over this server's limit of {limit} ({flag_of(limit_name)})")


def check_fields(params: SamplingParams, limits: Any) -> None:
    """``stop``, ``stop_token_ids`` and ``logit_bias`` of verified ``params`` within ``limits``
    (an object with the :class:`~radixserve.config.limits.RequestLimitArgs` fields)."""
    stop = params.stop or []
    if len(stop) > limits.max_stop_strings:
        raise _over("stop", f"stop has {len(stop)} strings", "max_stop_strings", limits.max_stop_strings)
    chars = sum(len(s) for s in stop)
    if chars > limits.max_stop_chars:
        raise _over("stop", f"the stop strings have {chars} characters in all", "max_stop_chars",
                    limits.max_stop_chars)
    ids = params.stop_token_ids or []
    if len(ids) > limits.max_stop_token_ids:
        raise _over("stop_token_ids", f"stop_token_ids has {len(ids)} ids", "max_stop_token_ids",
                    limits.max_stop_token_ids)
    bias = params.logit_bias or {}
    if len(bias) > limits.max_logit_bias:
        raise _over("logit_bias", f"logit_bias has {len(bias)} entries", "max_logit_bias", limits.max_logit_bias)


def check_prompt_work(num_tokens: int, limits: Any, param: str = "n") -> None:
    """``num_tokens``, the prompt tokens one request submits counting each of its sequences
    (n x prompt length, summed over its prompts), within ``--max-request-prompt-tokens``."""
    limit = limits.max_request_prompt_tokens
    if num_tokens > limit:
        raise _over(param, f"the request's sequences (n x prompt) hold {num_tokens} prompt tokens",
                    "max_request_prompt_tokens", limit)

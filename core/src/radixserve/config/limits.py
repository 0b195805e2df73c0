"""Engine flags: what one request may ask for, so that no request slows the others, and what
it is told about the prefix cache.

Each bound is checked when a request is admitted (HTTP 400 naming the field); the
structures those fields need (the stop-id set, the logit-bias tensors, the stop matcher)
are built once per request, never per step. See docs/serving.md, "Running it for many users".
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config.common import Checks, flag

CACHE_REPORTS = ("on", "off")
MAX_CACHE_SALT = 1024  # characters of a request's cache_salt (or extra_key)


@dataclass
class RequestLimitArgs(Checks):
    max_stop_strings: int = flag(128, "most stop strings one request may give (`stop`)")
    max_stop_chars: int = flag(8192, "most characters all of one request's stop strings may have together")
    max_stop_token_ids: int = flag(4096, "most token ids one request may give in `stop_token_ids`")
    max_logit_bias: int = flag(4096, "most entries one request's `logit_bias` may have")
    max_request_prompt_tokens: int = flag(
        262144,
        "most prompt tokens one request may submit counting each of its n sequences (n x the prompt "
        "length, summed over a batch's prompts)",
    )

    cache_report: str = flag(
        "on",
        "off: every request's cached_tokens reads 0, so a client cannot tell whether a prefix was "
        "cached (the engine's own stats still count hits); give each tenant a cache_salt to keep "
        "prefixes apart",
        choices=CACHE_REPORTS,
    )

    def check_limits(self) -> None:
        for name in ("max_stop_strings", "max_stop_chars", "max_stop_token_ids", "max_logit_bias",
                     "max_request_prompt_tokens"):
            self._check_int(name, minimum=1)

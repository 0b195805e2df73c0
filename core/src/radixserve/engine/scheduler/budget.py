"""Stall-free step budget: how many prompt tokens a step that also decodes may compute.

With mixed steps (the default) decoding requests ride along in every prefill step, so a
step's length is an inter-token latency of every running request. Unless
``--chunked-prefill-size`` is given, the planner asks :class:`StepBudget` for each step's
prefill tokens (the idea of Sarathi-Serve's stall-free scheduling, written here from the
scheduler's own measurements):

- ``decode(b)``: the measured length of a plain decode step of ``b`` requests (a moving
  average per batch size, from the steps the engine ran; an unmeasured size takes the
  nearest measured ones, interpolated);
- ``per_token``: the measured cost of one prefill token, from extend and mixed steps: what
  the step took beyond ``decode(riders)``, over its prefill tokens (token-weighted moving
  average);
- the target: ``--mixed-chunk-target-itl-ms`` when given, else ``DECODE_MULTIPLE`` times
  ``decode(b)``;
- the budget: ``(target - decode(b)) / per_token`` tokens, at least ``MIN_PREFILL_TOKENS``
  (so a prompt always progresses) and at most the full chunk.

A step with no decoding request is not budgeted (it may take the full chunk). Until both
costs have been measured, a step with decoding requests takes ``COLD_START_TOKENS``.
"""

from __future__ import annotations

import bisect

AUTO_CHUNK = 2048  # the chunk of a step with no decoding request when --chunked-prefill-size is not given
DECODE_MULTIPLE = 2.0  # default target: a step holding decoding requests lasts this many plain decode steps
MIN_PREFILL_TOKENS = 64  # floor of a budgeted step's prefill tokens
COLD_START_TOKENS = 128  # budget before the costs are measured (issue 19's measured chunk on CPU)
DECODE_ALPHA = 0.2  # weight of the newest decode-step sample
TOKEN_DECAY = 0.9  # weight the prefill-cost sums keep per observed step


class StepBudget:
    """Measured step costs and the prefill tokens a step holding decoding requests may carry."""

    def __init__(self, full_chunk: int, target_seconds: float | None = None,
                 multiple: float = DECODE_MULTIPLE, min_tokens: int = MIN_PREFILL_TOKENS) -> None:
        self.full_chunk = full_chunk
        self.target = target_seconds
        self.multiple = multiple
        self.min_tokens = min(min_tokens, full_chunk)
        self._decode: dict[int, float] = {}  # batch size -> seconds of a plain decode step
        self._sizes: list[int] = []  # sorted keys of _decode
        self._token_seconds = 0.0  # decayed sums: prefill seconds and tokens
        self._tokens = 0.0
        self.last_tokens: int | None = None  # the latest budget given (for stats)

    # ------------------------------------------------------------ measurements
    def observe_decode(self, num_reqs: int, seconds: float) -> None:
        """A plain decode step of ``num_reqs`` requests took ``seconds``."""
        if num_reqs <= 0 or seconds <= 0:
            return
        old = self._decode.get(num_reqs)
        if old is None:
            bisect.insort(self._sizes, num_reqs)
            self._decode[num_reqs] = seconds
        else:
            self._decode[num_reqs] = old + DECODE_ALPHA * (seconds - old)

    def observe_step(self, num_prefill_tokens: int, num_decode: int, seconds: float) -> None:
        """An extend step of ``num_prefill_tokens`` prompt tokens and ``num_decode`` riding
        decode rows took ``seconds``."""
        if num_prefill_tokens <= 0 or seconds <= 0:
            return
        base = self.decode_seconds(max(num_decode, 1)) or 0.0  # a step's fixed cost, decoding rows included
        self._token_seconds = TOKEN_DECAY * self._token_seconds + max(seconds - base, 0.0)
        self._tokens = TOKEN_DECAY * self._tokens + num_prefill_tokens

    # ------------------------------------------------------------ estimates
    def decode_seconds(self, num_reqs: int) -> float | None:
        """Estimated plain decode step of ``num_reqs`` requests; None before any was measured."""
        sizes = self._sizes
        if not sizes:
            return None
        if num_reqs in self._decode:
            return self._decode[num_reqs]
        i = bisect.bisect_left(sizes, num_reqs)
        if i == 0:
            return self._decode[sizes[0]]
        if i == len(sizes):
            return self._decode[sizes[-1]]
        lo, hi = sizes[i - 1], sizes[i]
        f = (num_reqs - lo) / (hi - lo)
        return self._decode[lo] + f * (self._decode[hi] - self._decode[lo])

    @property
    def seconds_per_token(self) -> float | None:
        """Estimated cost of one prefill token; None before any was measured."""
        if self._tokens <= 0:
            return None
        return max(self._token_seconds / self._tokens, 1e-9)

    def target_seconds(self, num_decoding: int) -> float | None:
        """The length a step holding ``num_decoding`` decoding requests aims at."""
        if self.target is not None:
            return self.target
        decode = self.decode_seconds(num_decoding)
        return None if decode is None else self.multiple * decode

    # ------------------------------------------------------------ the rule
    def prefill_tokens(self, num_decoding: int) -> int:
        """Prompt tokens a step with ``num_decoding`` decoding requests may compute."""
        if num_decoding <= 0:
            return self.full_chunk
        decode, per_token = self.decode_seconds(num_decoding), self.seconds_per_token
        if decode is None or per_token is None:
            n = COLD_START_TOKENS
        else:
            n = int((self.target_seconds(num_decoding) - decode) / per_token)
        n = min(max(n, self.min_tokens), self.full_chunk)
        self.last_tokens = n
        return n

    def stats(self) -> dict:
        per_token = self.seconds_per_token
        return {
            "step_budget_tokens": self.last_tokens,
            "prefill_ms_per_token": None if per_token is None else per_token * 1e3,
        }

"""Stall-free step budget: how many prompt tokens a step that also decodes may compute.

With mixed steps (the default) decoding requests ride along in every prefill step, so a
step's length is an inter-token latency of every running request. Unless
``--chunked-prefill-size`` is given, the planner asks :class:`StepBudget` for each step's
prefill tokens (the idea of Sarathi-Serve's stall-free scheduling, written here from the
scheduler's own measurements):

- a step's length is modelled as ``decode(b) + per_token * n`` with ``decode(b) = a + slope * b``
  for ``b`` decoding rows and ``n`` prefill tokens; ``a``, ``slope`` and ``per_token`` are a
  least-squares fit over every step the engine ran (plain decode, extend and mixed ones),
  the older steps weighing less (``DECAY`` per step). One fit over all steps matters: under
  a steady stream of prompts almost every step is mixed, so a plain decode step at the
  running batch size is rarely seen, and its cost must come out of the mixed ones;
- the target: ``--mixed-chunk-target-itl-ms`` when given, else ``DECODE_MULTIPLE`` times
  ``decode(b)``;
- the budget: ``(target - decode(b)) / per_token`` tokens, at least ``MIN_PREFILL_TOKENS``
  (so a prompt always progresses) and at most the full chunk.

A step with no decoding request is not budgeted (it may take the full chunk). Until both
costs have been measured, a step with decoding requests takes ``COLD_START_TOKENS``.
"""

from __future__ import annotations

AUTO_CHUNK = 2048  # the chunk of a step with no decoding request when --chunked-prefill-size is not given
DECODE_MULTIPLE = 2.0  # default target: a step holding decoding requests lasts this many plain decode steps
B_SCALE = 16.0  # feature scales of the fit (decode rows, prefill tokens): keeps its equations balanced
N_SCALE = 256.0
MIN_PREFILL_TOKENS = 64  # floor of a budgeted step's prefill tokens
COLD_START_TOKENS = 128  # budget before the costs are measured (issue 19's measured chunk on CPU)
DECAY = 0.97  # weight a step's measurement keeps per later step (a memory of ~30 steps)
RIDGE = 1e-6  # relative ridge term: an under-determined fit (few kinds of step seen) stays finite


class StepBudget:
    """Measured step costs and the prefill tokens a step holding decoding requests may carry."""

    def __init__(self, full_chunk: int, target_seconds: float | None = None,
                 multiple: float = DECODE_MULTIPLE, min_tokens: int = MIN_PREFILL_TOKENS) -> None:
        self.full_chunk = full_chunk
        self.target = target_seconds
        self.multiple = multiple
        self.min_tokens = min(min_tokens, full_chunk)
        # decayed normal equations of the fit over features (1, b / B_SCALE, n / N_SCALE)
        self._ata = [[0.0] * 3 for _ in range(3)]
        self._aty = [0.0] * 3
        self._fit: tuple[float, float, float] | None = None  # (a, slope, per_token), in seconds
        self._kinds: set[str] = set()  # which kinds of step were seen (decode, extend)
        self.last_tokens: int | None = None  # the latest budget given, and the decode step it assumed (stats)
        self.last_decode: float | None = None

    # ------------------------------------------------------------ measurements
    def observe_decode(self, num_reqs: int, seconds: float) -> None:
        """A plain decode step of ``num_reqs`` requests took ``seconds``."""
        if num_reqs > 0:
            self._observe(num_reqs, 0, seconds)

    def observe_step(self, num_prefill_tokens: int, num_decode: int, seconds: float) -> None:
        """An extend step of ``num_prefill_tokens`` prompt tokens and ``num_decode`` riding
        decode rows took ``seconds``."""
        if num_prefill_tokens > 0:
            self._observe(num_decode, num_prefill_tokens, seconds)

    def _observe(self, b: int, n: int, seconds: float) -> None:
        if not seconds > 0:
            return
        x = (1.0, b / B_SCALE, n / N_SCALE)
        for i in range(3):
            self._aty[i] = DECAY * self._aty[i] + x[i] * seconds
            for j in range(3):
                self._ata[i][j] = DECAY * self._ata[i][j] + x[i] * x[j]
        self._kinds.add("extend" if n else "decode")
        self._fit = None

    def _solve(self) -> tuple[float, float, float] | None:
        """(a, slope, per_token) of the current fit; None before a decode and an extend step
        were seen, or when the fit is not physical (a negative cost)."""
        if self._fit is None and len(self._kinds) == 2:
            lam = RIDGE * (self._ata[0][0] + self._ata[1][1] + self._ata[2][2])
            m = [[self._ata[i][j] + (lam if i == j else 0.0) for j in range(3)] + [self._aty[i]] for i in range(3)]
            for c in range(3):  # Gaussian elimination, partial pivoting
                p = max(range(c, 3), key=lambda r: abs(m[r][c]))
                if abs(m[p][c]) < 1e-300:
                    return None
                m[c], m[p] = m[p], m[c]
                for r in range(c + 1, 3):
                    f = m[r][c] / m[c][c]
                    m[r] = [m[r][k] - f * m[c][k] for k in range(4)]
            w = [0.0] * 3
            for r in (2, 1, 0):
                w[r] = (m[r][3] - sum(m[r][k] * w[k] for k in range(r + 1, 3))) / m[r][r]
            a, slope, per_token = w[0], w[1] / B_SCALE, w[2] / N_SCALE
            if per_token <= 0:
                return None
            self._fit = (a, slope, per_token)
        return self._fit

    # ------------------------------------------------------------ estimates
    def decode_seconds(self, num_reqs: int) -> float | None:
        """Estimated plain decode step of ``num_reqs`` requests; None before it can be fitted."""
        fit = self._solve()
        if fit is None:
            return None
        value = fit[0] + fit[1] * num_reqs
        return value if value > 0 else None

    @property
    def seconds_per_token(self) -> float | None:
        """Estimated cost of one prefill token; None before it can be fitted."""
        fit = self._solve()
        return None if fit is None else fit[2]

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
        self.last_decode = decode
        target = self.target_seconds(num_decoding)
        if per_token is None or target is None:
            n = COLD_START_TOKENS
        else:  # (a fitted decode cost below zero, with a fixed target, counts as none)
            n = int((target - (decode or 0.0)) / per_token)
        n = min(max(n, self.min_tokens), self.full_chunk)
        self.last_tokens = n
        return n

    def stats(self) -> dict:
        per_token = self.seconds_per_token
        return {
            "step_budget_tokens": self.last_tokens,
            "step_budget_decode_ms": None if self.last_decode is None else self.last_decode * 1e3,
            "prefill_ms_per_token": None if per_token is None else per_token * 1e3,
        }

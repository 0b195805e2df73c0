"""Fault isolation of forward passes.

A forward pass that raises is retried with each request alone to find the culprits: they
fail with status 500, and the rest of the batch runs again without them. When no single
request is to blame, the whole batch fails with 500 and the engine goes on; only
``--max-consecutive-failed-steps`` such steps in a row raise :class:`EngineFailure` out of
the scheduler's step. A request whose logits hold NaN fails before its K/V (NaN too) can
enter the prefix cache.
"""

from __future__ import annotations

import logging

import torch

from radixserve.engine.request import Req
from radixserve.layers.attention import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)


class EngineFailure(RuntimeError):
    """Forward passes keep failing with no single request to blame: the engine must stop."""


class IsolatedForward:
    def __init__(self, runner, cache, outputs, stats, max_consecutive_failed_steps: int) -> None:
        self.runner = runner
        self.cache = cache
        self.outputs = outputs
        self.stats = stats
        self.max_failed = max_consecutive_failed_steps
        self.consecutive_failed_steps = 0
        self.last_error = ""

    def succeeded(self) -> None:
        self.consecutive_failed_steps = 0

    def check(self) -> None:
        """Raise EngineFailure after too many failed steps in a row."""
        if self.consecutive_failed_steps >= self.max_failed:
            raise EngineFailure(f"{self.consecutive_failed_steps} forward steps in a row failed "
                                f"(--max-consecutive-failed-steps); last error: {self.last_error}")

    def __call__(self, reqs: list[Req], mode: ForwardMode, lens: list | None, failed: list[Req],
                 build=None) -> tuple[list[Req], list | None, torch.Tensor | None, ForwardBatch | None]:
        """One forward pass over ``reqs``, isolating failures.

        If the batch raises, each request is run alone (K/V writes go to the same slots
        and are simply redone): requests that fail alone end with status 500 and the
        others run again as one batch. If none fails alone, or the retry fails too, the
        whole batch ends with 500. ``lens`` holds one item per request for ``build(reqs,
        lens)`` (default: the runner's batch of ``mode`` with these extend lengths).
        Returns the requests that ran, their ``lens``, their logits and the batch; failed
        requests are finished and appended to ``failed``."""
        if build is None:
            def build(rs, ls):
                return self.runner.build_batch(rs, mode, ls)

        def run(rs, ls):
            batch = build(rs, ls)
            batch.extra["reqs"] = rs
            return self.outputs.call(self.runner.forward, batch), batch

        self.cache.ready_for_forward()  # HiCache: pages loaded back from the host are in place
        try:
            logits, batch = run(reqs, lens)
        except Exception as e:  # noqa: BLE001 - one batch's failure must not stop the engine
            error: BaseException = e
            logger.exception("forward pass over %d requests failed", len(reqs))
        else:
            self.consecutive_failed_steps = 0
            return self._drop_nan_rows(reqs, lens, logits, batch, failed)
        if len(reqs) > 1:
            culprits: dict[int, BaseException] = {}
            for i, req in enumerate(reqs):
                try:
                    run([req], [lens[i]] if lens else None)
                except Exception as e:  # noqa: BLE001
                    culprits[i] = e
            if culprits and len(culprits) < len(reqs):
                for i, e in culprits.items():
                    logger.error("request %s: its forward pass fails alone: %r", reqs[i].rid, e)
                    self.outputs.fail(reqs[i], f"the forward pass failed for this request: "
                                               f"{type(e).__name__}: {e}", failed)
                keep = [i for i in range(len(reqs)) if i not in culprits]
                reqs = [reqs[i] for i in keep]
                lens = [lens[i] for i in keep] if lens else None
                try:
                    logits, batch = run(reqs, lens)
                except Exception as e:  # noqa: BLE001
                    error = e
                    logger.exception("forward pass failed again without the failing requests")
                else:
                    self.consecutive_failed_steps = 0
                    return self._drop_nan_rows(reqs, lens, logits, batch, failed)
        self.consecutive_failed_steps += 1
        self.stats.num_failed_steps += 1
        self.last_error = f"{type(error).__name__}: {error}"
        for req in reqs:
            self.outputs.fail(req, f"the forward pass of this request's batch failed: {self.last_error}", failed)
        return [], [] if lens is not None else None, None, None

    def _drop_nan_rows(self, reqs: list[Req], lens: list | None, logits: torch.Tensor, batch: ForwardBatch,
                       failed: list[Req]) -> tuple[list[Req], list | None, torch.Tensor, ForwardBatch]:
        """Fail the requests whose logits hold NaN; the rest go on. A verify batch has one
        row per tree node: its ``logits`` and aux hidden states are then kept whole (the
        caller slices them by the requests' row spans)."""
        # a row's max is NaN iff the row holds NaN: one reduction, ~20x faster than isnan().any()
        bad_rows = torch.isnan(logits.amax(dim=-1))  # [rows]
        if not bool(bad_rows.any()):
            return reqs, lens, logits, batch
        per_req = logits.shape[0] != len(reqs)
        if per_req:
            spans = torch.tensor(batch.extend_lens_cpu)
            owner = torch.repeat_interleave(torch.arange(len(reqs)), spans)
            bad = torch.zeros(len(reqs), dtype=torch.bool).index_put_((owner,), bad_rows.cpu(), accumulate=True)
            rows = bad.tolist()
        else:
            rows = bad_rows.tolist()
        for req, is_bad in zip(reqs, rows):
            if is_bad:
                logger.error("request %s: the model produced NaN logits", req.rid)
                self.outputs.fail(req, "the model produced NaN logits for this request", failed)
        keep = [i for i, is_bad in enumerate(rows) if not is_bad]
        kept_lens = [lens[i] for i in keep] if lens else None
        if per_req:  # the caller maps the kept requests back to their rows
            batch.extra["kept_requests"] = keep
            return [reqs[i] for i in keep], kept_lens, logits, batch
        return [reqs[i] for i in keep], kept_lens, logits[keep], batch

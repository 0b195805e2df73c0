"""Output processing: sample each row, append the token, advance the grammar, check
whether the request finished, tell its owner.

Failure is per request: an exception while serving one request (its grammar matcher, its
row of the sampler, its stop-string check, its output callback) ends that request only,
with finish reason ``{"type": "abort", "status_code": 500, ...}``; its pages and slot are
freed and its neighbours go on untouched.

Structured output: in each sampling step the constrained rows' matchers fill a token
bitmask that masks their logits, and a matcher that terminates finishes its request with
``stop``.
"""

from __future__ import annotations

import logging

import torch

from radixserve.detokenizer import StopStringMatcher
from radixserve.engine.request import Req
from radixserve.layers.attention import ForwardBatch
from radixserve.sampling import Sampler, SamplingBatchInfo
from radixserve.sampling.bitmask import allocate_token_bitmask

logger = logging.getLogger(__name__)


def run_here(fn, *args):
    return fn(*args)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], vocab_size: int, max_running: int,
                 context_len: int, kv, queues, stats) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_running = max_running
        self.context_len = context_len
        self.kv = kv
        self.queues = queues
        self.stats = stats
        self.sampler = Sampler()
        self.call = run_here  # where sampling runs (the overlap's forward worker when it is on)
        # prefill-decode disaggregation (prefill side): keeps a finished request's pages until
        # its KV is sent (returns True), radixserve.disaggregation.prefill
        self.hold = None
        self._bitmask: torch.Tensor | None = None  # [max_running, ceil(V / 32)] int32, reused

    # ------------------------------------------------------------ ending requests
    def finish(self, req: Req, reason: dict, notify: bool = True) -> None:
        req.finish_reason = reason
        req.grammar = None
        if self.hold is None or not self.hold(req, reason):
            self.kv.release(req)
        self.kv.cache.on_request_done(req)
        if reason["type"] == "abort":
            self.stats.num_aborted += 1
        else:
            self.stats.num_finished += 1
        if notify:
            self.notify(req, 0, True)

    def fail(self, req: Req, message: str, failed: list[Req] | None = None) -> None:
        """End ``req`` with an internal error (status 500); its pages and slot are freed.
        Listed in ``failed`` (notified once out of every queue), or notified at once."""
        self.stats.num_failed += 1
        if req in self.queues.running:
            self.queues.running.remove(req)
        try:
            self.finish(req, {"type": "abort", "status_code": 500, "message": message}, notify=failed is None)
        except Exception:  # noqa: BLE001 - e.g. the caller's callback raised
            logger.exception("request %s: could not report its failure", req.rid)
        if failed is not None:
            failed.append(req)

    @staticmethod
    def notify(req: Req, num_new: int, finished: bool) -> bool:
        """Tell the request's owner; False (logged) if its callback raised."""
        if req.on_output is None:
            return True
        try:
            req.on_output(req, num_new, finished)
        except Exception:  # noqa: BLE001 - a caller's bug must not stop the scheduler
            logger.exception("request %s: its output callback raised", req.rid)
            return False
        return True

    @staticmethod
    def take_prompt_logprobs(batch: ForwardBatch | None) -> None:
        """Append the prompt logprobs an extend step computed to their requests."""
        if batch is None:
            return
        for req, lps, tops in batch.extra.get("prompt_logprobs", ()):
            if req.finished:  # failed in this step
                continue
            req.input_token_logprobs.extend(lps)
            if req.params.top_logprobs_num:
                req.input_top_logprobs.extend(tops)

    # ------------------------------------------------------------ one token per row
    def sample_and_update(self, batch: list[Req], logits: torch.Tensor) -> list[Req]:
        """Sample one token per row and advance each request; returns those that finished
        (or failed: an error in one request's row ends that request only)."""
        errors: dict[int, str] = {}
        constrained = [i for i, r in enumerate(batch) if r.grammar is not None]
        mask = self.fill_bitmask(batch, constrained, errors) if constrained else None
        next_ids, logprobs, tops = self._sample(batch, logits, mask, errors)
        return self.take_tokens(batch, next_ids, logprobs, tops, errors)

    def take_tokens(self, batch: list[Req], next_ids: list[int], logprobs: list | None = None,
                    tops: list | None = None, errors: dict[int, str] | None = None) -> list[Req]:
        """Append each request's sampled token (and logprobs), advance its grammar, check
        whether it finished and hand the token to its owner; returns the requests that
        finished or failed (an error in one request ends that request only)."""
        finished: list[Req] = []
        for i, req in enumerate(batch):
            if errors and i in errors:
                self.fail(req, errors[i], finished)
                continue
            try:
                tok = next_ids[i]
                req.output_ids.append(tok)
                if req.params.return_logprob:
                    req.output_token_logprobs.append(logprobs[i])
                    if req.params.top_logprobs_num:
                        req.output_top_logprobs.append(tops[i])
                reason = self.finish_reason(req, tok)
            except Exception as e:  # noqa: BLE001 - ends this request only
                logger.exception("request %s failed while taking its next token", req.rid)
                self.fail(req, f"{type(e).__name__}: {e}", finished)
                continue
            if reason is not None:
                self.finish(req, reason, notify=False)
                finished.append(req)
            elif not self.notify(req, 1, False):
                self.fail(req, "its output callback raised", finished)
        return finished

    def _sample(self, batch: list[Req], logits: torch.Tensor, mask: torch.Tensor | None,
                errors: dict[int, str]) -> tuple[list, list | None, list | None]:
        """Next token ids (and logprobs) of every row. If the batched sampler raises, rows
        are sampled one by one and a row that raises alone is recorded in ``errors``."""
        try:
            return self._sample_rows(batch, logits, mask)
        except Exception:  # noqa: BLE001
            logger.exception("sampling a batch of %d failed; sampling its rows one by one", len(batch))
        next_ids: list = [None] * len(batch)
        logprobs: list = [None] * len(batch)
        tops: list = [None] * len(batch)
        for i, req in enumerate(batch):
            if i in errors:
                continue
            try:
                ids, lps, top = self._sample_rows([req], logits[i:i + 1], None if mask is None else mask[i:i + 1])
            except Exception as e:  # noqa: BLE001
                logger.exception("request %s: sampling failed", req.rid)
                errors[i] = f"sampling failed: {type(e).__name__}: {e}"
                continue
            next_ids[i] = ids[0]
            logprobs[i] = lps[0] if lps is not None else None
            tops[i] = top[0] if top is not None else None
        return next_ids, logprobs, tops

    def _sample_rows(self, batch: list[Req], logits: torch.Tensor, mask: torch.Tensor | None):
        info = self.sampling_info(batch, logits.device)
        info.vocab_mask = mask
        out = self.call(self.sampler.sample, logits, info)
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        return out.next_token_ids.tolist(), logprobs, out.top_logprobs

    def sampling_info(self, batch: list[Req], device, ahead: int = 0, histories=None, counts=None,
                      penalties: bool = True) -> SamplingBatchInfo:
        """The sampling tensors of ``batch`` (``ahead``: tokens sampled but not yet
        appended; ``histories``/``counts``: per-row token histories, for tree nodes)."""
        if histories is None:
            histories = [(r.input_ids, r.output_ids) for r in batch]
        if counts is None:
            counts = [len(r.output_ids) + ahead for r in batch]
        states = [r.penalty_state_for(self.vocab_size) for r in batch] if penalties else None
        return SamplingBatchInfo.build([r.params for r in batch], [r.generator for r in batch], histories,
                                       counts, self.eos_token_ids, self.vocab_size, device,
                                       penalty_states=states)

    def fill_bitmask(self, batch: list[Req], rows: list[int], errors: dict[int, str]) -> torch.Tensor:
        """The allowed-token bitmask of this step: matchers fill their rows, others allow all.
        A matcher that raises fails its request (its row stays all-allowed)."""
        if self._bitmask is None or self._bitmask.shape[0] < len(batch):
            self._bitmask = allocate_token_bitmask(max(len(batch), self.max_running), self.vocab_size)
        mask = self._bitmask[:len(batch)]  # [B, W]
        mask.fill_(-1)
        for i in rows:
            try:
                batch[i].grammar.fill_bitmask(mask, i)
            except Exception as e:  # noqa: BLE001 - a matcher bug ends its request only
                logger.exception("request %s: the grammar matcher failed to fill its mask", batch[i].rid)
                errors[i] = f"the grammar backend failed: {type(e).__name__}: {e}"
                mask[i].fill_(-1)
        return mask

    # ------------------------------------------------------------ finish checks
    def finish_reason(self, req: Req, tok: int) -> dict | None:
        """Advance ``req``'s grammar with its new token ``tok`` and check every stop rule:
        the finish reason when it ends here, else None."""
        reason = self._advance_grammar(req, tok) if req.grammar is not None else None
        return reason if reason is not None else self._check_finished(req, tok)

    @staticmethod
    def _advance_grammar(req: Req, tok: int) -> dict | None:
        if not req.grammar.accept_token(tok):
            logger.error("request %s: the grammar rejected token %d that its mask allowed", req.rid, tok)
            return {"type": "abort", "status_code": 500,
                    "message": f"the grammar backend rejected token {tok} that its own mask allowed"}
        if req.grammar.is_terminated():
            return {"type": "stop", "matched": tok}
        return None

    def _check_finished(self, req: Req, tok: int) -> dict | None:
        p = req.params
        checking = len(req.output_ids) >= p.min_new_tokens
        if p.stop or p.stop_regex:  # every token goes through the matcher; only the new text is searched
            if req.stop_matcher is None:
                req.stop_matcher = StopStringMatcher(self.tokenizer, p.stop, p.skip_special_tokens, p.stop_regex)
            hit = req.stop_matcher.add(tok, check=checking)
            if hit is not None:
                pos, matched = hit
                text = req.stop_matcher.text
                req.stop_text = text if p.no_stop_trim else text[:pos]
                return {"type": "stop", "matched": matched}
        if checking:
            if tok in p.stop_token_set or (not p.ignore_eos and tok in self.eos_token_ids):
                if not p.no_stop_trim:  # the matched token's text is not part of the output
                    req.stop_text = self.tokenizer.decode(req.output_ids[:-1],
                                                          skip_special_tokens=p.skip_special_tokens)
                return {"type": "stop", "matched": tok}
        if len(req.output_ids) >= req.max_new_tokens or req.seq_len >= self.context_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None

"""Batched next-token sampling over a ``[B, V]`` logits tensor.

The engine builds one :class:`SamplingBatchInfo` per step (from each row's
:class:`SamplingParams`, generator and token history) and calls :meth:`Sampler.sample`
once for the whole batch. The info precomputes only what the batch needs: an all-greedy
batch without penalties or logprobs is a single argmax; penalty tensors exist only when
some row sets a penalty.

Sampling order per step:

1. ``logit_bias`` (added first, so everything after sees the biased logits), then
   penalties (repetition, frequency, presence), the ``min_new_tokens`` mask and the
   grammar bitmask of constrained rows (structured output), applied to a copy of the
   logits (the caller's tensor is never modified);
2. greedy rows take the argmax;
3. other rows: divide by temperature, then top-k, top-p and min-p filtering (in that order,
   each over the distribution left by the previous one, as Hugging Face and vLLM do),
   softmax, and an inverse-CDF draw: one uniform ``u`` per row, and the first token whose
   cumulative probability exceeds ``u`` times the row's total (one value per row instead of
   one per vocabulary entry: a batch of 16 over a 49k vocabulary draws in ~0.3 ms on CPU
   where an exponential race took ~13 ms). A row with a generator draws its ``u`` from it,
   so the same seed gives the same tokens whatever batch the row is in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.kernels import cpu as cpu_kernels
from radixserve.sampling.batch_info import SamplingBatchInfo
from radixserve.sampling.bitmask import apply_token_bitmask_


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request, on the device the logits live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SampleOutput:
    """What one sampling step produced for each row."""

    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32, logprob of the chosen token
    # per row: (top ids, their logprobs), highest first, k = that row's top_logprobs_num;
    # ([], []) for rows that asked for none. None when no row has return_logprob.
    top_logprobs: list[tuple[list[int], list[float]]] | None = None


class Sampler:
    """Picks one token per row from ``[B, V]`` float32 logits; stateless."""

    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        """Sample the next token of every row.

        ``logits`` is ``[B, V]`` float32 on ``info.device`` and is not modified. Logprobs
        (when some row has ``return_logprob``) are ``log_softmax`` of the logits after
        ``logit_bias``, penalties and the ``min_new_tokens`` mask but before temperature
        and top-k/top-p/min-p filtering (as SGLang's, which include the bias): they
        describe the model's biased and penalised distribution, not the truncated one
        sampled from, so they stay finite and comparable across settings.
        ``logprobs`` holds a value for every row, also those that did not ask.
        """
        if (
            logits.dim() != 2
            or logits.shape[0] != info.batch_size
            or logits.shape[1] != info.vocab_size
        ):
            raise ValueError(
                f"logits must be [{info.batch_size}, {info.vocab_size}] (batch, vocab), "
                f"got {list(logits.shape)}"
            )
        logits = self.process(logits, info)
        if info.is_all_greedy:
            next_ids = greedy_argmax(logits)  # [B]
        else:
            next_ids = self._draw(logits, info)  # [B]
            if info.greedy_mask is not None:
                next_ids = torch.where(info.greedy_mask, greedy_argmax(logits), next_ids)

        if not info.return_logprob:
            return SampleOutput(next_token_ids=next_ids)
        logprobs_all = torch.log_softmax(logits, dim=-1)  # [B, V]
        chosen = logprobs_all.gather(1, next_ids.view(-1, 1)).view(-1)  # [B]
        return SampleOutput(
            next_token_ids=next_ids,
            logprobs=chosen,
            top_logprobs=self._top_logprobs(logprobs_all, info.top_logprobs_nums),
        )

    def process(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """``logits`` after ``logit_bias``, penalties, the ``min_new_tokens`` mask and the
        grammar bitmask (a copy when anything applies; the caller's tensor is never
        modified). Greedy rows take the argmax of this; logprobs are its ``log_softmax``."""
        given = logits
        if info.bias_rows is not None:
            logits = logits.clone().index_put_(
                (info.bias_rows, info.bias_ids), info.bias_values, accumulate=True)  # [B, V]
        biased = logits
        if info.has_penalties:
            logits = self._apply_penalties(logits.clone(), info)
        if info.vocab_mask is not None:
            logits = apply_token_bitmask_(
                logits.clone() if logits is given else logits, info.vocab_mask)
            if info.banned_rows is not None:
                # min_new_tokens may ban the only tokens a grammar allows (its end): the
                # grammar wins there, over the unpenalised (biased) logits.
                dead = torch.isneginf(logits).all(dim=-1)  # [B]
                if bool(dead.any()):
                    logits[dead] = apply_token_bitmask_(
                        biased[dead], info.vocab_mask[dead.to(info.vocab_mask.device)])
        return logits

    @staticmethod
    def probs(processed: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """The distribution sampled rows draw from: ``processed`` (see :meth:`process`)
        divided by the temperature, then top-k, top-p and min-p filtered, then softmax.
        ``[B, V]`` float32; rows of greedy requests are meaningless."""
        if info.temperatures is None:
            raise ValueError("probs() needs a batch with sampled rows (every row is greedy)")
        scaled = processed / info.temperatures  # [B, V]
        if info.top_ks is not None or info.top_ps is not None or info.min_ps is not None:
            scaled = _filter(scaled, info)
        return torch.softmax(scaled, dim=-1)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Penalise ``logits`` [B, V] in place (the caller passes a copy)."""
        if info.repetition_mask is not None:
            p = info.repetition_penalties  # [B, 1]
            penalised = torch.where(logits > 0, logits / p, logits * p)  # [B, V]
            logits = torch.where(info.repetition_mask, penalised, logits)
        if info.output_counts is not None:
            counts = info.output_counts  # [B, V]
            logits -= info.frequency_penalties * counts
            logits -= info.presence_penalties * (counts > 0).to(logits.dtype)
        if info.banned_rows is not None:
            logits[info.banned_rows, info.banned_ids] = float("-inf")
        return logits

    @staticmethod
    def _draw(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Temperature, filters, softmax and an inverse-CDF draw (one uniform per row, the
        first token whose cumulative mass exceeds it: ~40x cheaper on CPU than drawing a
        noise value per vocabulary entry); returns [B] int64."""
        probs = Sampler.probs(logits, info)  # [B, V]
        cdf = probs.cumsum(dim=-1)  # [B, V]
        u = torch.empty(probs.shape[0], 1, dtype=cdf.dtype, device=cdf.device)  # [B, 1]
        if len(info.seeded_rows) < info.batch_size:
            u.uniform_(generator=info.shared_generator)
        for i in info.seeded_rows:  # per-row generators: the one unavoidable Python loop
            u[i].uniform_(generator=info.generators[i])
        # the first token whose cumulative mass exceeds u * total has a positive probability
        ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)  # [B]
        over = ids >= probs.shape[1]  # u * total rounded up to the total: the last token with mass
        if bool(over.any()):
            last = probs.shape[1] - 1 - (probs[over].flip(-1) > 0).to(torch.int8).argmax(dim=-1)
            ids[over] = last
        return ids

    @staticmethod
    def skip_draw(params, generator: torch.Generator | None) -> None:
        """Advance a request's own generator as one sampling step of that request does (its
        token was sampled elsewhere: the decode side of a disaggregated request), so the next
        draws equal one server's."""
        if generator is not None and not params.is_greedy:
            torch.empty(1, 1, dtype=torch.float32, device=generator.device).uniform_(generator=generator)

    @staticmethod
    def _top_logprobs(
        logprobs_all: torch.Tensor, nums: list[int]
    ) -> list[tuple[list[int], list[float]]]:
        k = max(nums)
        if k == 0:
            return [([], []) for _ in nums]
        values, ids = logprobs_all.topk(k, dim=-1)  # [B, k]
        values, ids = values.tolist(), ids.tolist()
        return [(ids[i][:n], values[i][:n]) for i, n in enumerate(nums)]


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``[B, V]`` logits: on CPU float32 through radixserve's
    kernel (one vectorised pass per row, ~6x faster than torch's argmax over a 49k vocabulary;
    the same indices: first maximum, first NaN), else torch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and logits.stride(-1) == 1:
        kernels = cpu_kernels.load()
        if kernels is not None:
            return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _filter(scaled: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """Top-k, then top-p, then min-p; filtered tokens get -inf. ``scaled`` is [B, V]."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V]
    if info.top_ks is not None:
        ranks = torch.arange(scaled.shape[1], device=scaled.device).view(1, -1)  # [1, V]
        sorted_logits = sorted_logits.masked_fill(ranks >= info.top_ks, float("-inf"))
    if info.top_ps is not None:
        probs = torch.softmax(sorted_logits, dim=-1)  # [B, V]
        mass_before = probs.cumsum(dim=-1) - probs  # [B, V]
        # keep the smallest prefix whose mass reaches top_p; rows with top_p == 1 keep all
        drop = (mass_before >= info.top_ps) & (info.top_ps < 1.0)  # [B, V]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if info.min_ps is not None:
        probs = torch.softmax(sorted_logits, dim=-1)  # [B, V]
        drop = probs < info.min_ps * probs[:, :1]  # [B, V]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits)  # [B, V]

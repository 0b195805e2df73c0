"""One step's sampling tensors: :class:`SamplingBatchInfo` (built from each row's parameters,
generator and token history, holding only what the batch needs) and :class:`PenaltyState`
(a request's running token counts for the penalties)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from radixserve.sampling.params import SamplingParams

_MIN_TEMPERATURE = 1e-6  # keeps logits / temperature finite for tiny positive temperatures

class PenaltyState:
    """One request's token statistics for its penalties, kept from step to step.

    ``seen`` ([V] bool: prompt and output tokens, for the repetition penalty) and ``counts``
    ([V] float32: occurrences in the output, for frequency and presence penalties) cover the
    first ``num_output`` output tokens. :meth:`advance` adds the tokens a request gained since
    the last call (one per decode step, a few after a speculative step), so building a
    step's penalty tensors costs a row copy, not a walk over the whole history. The
    statistics live on the CPU; the batch tensors built from them move to the device.
    """

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int):
        self.vocab_size = vocab_size
        self.num_output = 0
        self.seen = self.counts = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)
            self.seen[self._ids(prompt_ids)] = True
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            self.counts = torch.zeros(vocab_size)

    def _ids(self, ids) -> torch.Tensor:
        t = torch.tensor(list(ids), dtype=torch.int64)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.vocab_size):
            raise ValueError(f"token id {int(t.min())}..{int(t.max())} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return t

    def advance(self, output_ids: list[int]) -> None:
        """Count ``output_ids[num_output:]``: the request's output only ever grows."""
        if len(output_ids) < self.num_output:
            raise ValueError(f"the output shrank from {self.num_output} to {len(output_ids)} tokens")
        new = self._ids(output_ids[self.num_output:])
        if new.numel():
            if self.seen is not None:
                self.seen[new] = True
            if self.counts is not None:
                self.counts.index_put_((new,), torch.ones(len(new)), accumulate=True)
        self.num_output = len(output_ids)

    def unseen(self, output_ids: list[int]) -> list[int]:
        """The tokens of ``output_ids`` past the counted prefix (drafts along a speculative
        path, or tokens not yet advanced over)."""
        if len(output_ids) < self.num_output:
            raise ValueError(f"history of {len(output_ids)} output tokens is shorter than the "
                             f"{self.num_output} this penalty state counted")
        return output_ids[self.num_output:]


@dataclass
class SamplingBatchInfo:
    """Per-step tensors for :meth:`Sampler.sample`; build it with :meth:`build`.

    Optional fields are ``None`` when no row in the batch needs them. Index tensors are
    built on the CPU from Python lists and then moved to ``device``.
    """

    batch_size: int
    vocab_size: int
    device: torch.device
    is_all_greedy: bool
    greedy_mask: torch.Tensor | None = None  # [B] bool; None when all or no rows are greedy
    temperatures: torch.Tensor | None = None  # [B, 1] float32; 1.0 on greedy rows
    top_ks: torch.Tensor | None = None  # [B, 1] int64; V where disabled
    top_ps: torch.Tensor | None = None  # [B, 1] float32; rows with 1.0 are not filtered
    min_ps: torch.Tensor | None = None  # [B, 1] float32
    # repetition penalty (HF): prompt + output tokens of rows whose penalty is not 1
    repetition_penalties: torch.Tensor | None = None  # [B, 1] float32
    repetition_mask: torch.Tensor | None = None  # [B, V] bool, token seen
    # frequency / presence penalties (OpenAI): output tokens only
    frequency_penalties: torch.Tensor | None = None  # [B, 1] float32
    presence_penalties: torch.Tensor | None = None  # [B, 1] float32
    output_counts: torch.Tensor | None = None  # [B, V] float32, occurrences in the output
    # min_new_tokens: (rows, token ids) that get -inf this step
    banned_rows: torch.Tensor | None = None  # [N] int64
    banned_ids: torch.Tensor | None = None  # [N] int64
    # noise sources for sampled rows
    generators: list[torch.Generator | None] | None = None  # per row; None = shared
    seeded_rows: list[int] | None = None  # sampled (non-greedy) rows with their own generator
    shared_generator: torch.Generator | None = None
    # logprobs
    return_logprob: bool = False
    top_logprobs_nums: list[int] | None = None  # per row; 0 where not asked
    # logit_bias: (row, token id, bias) triples added to the logits before anything else
    bias_rows: torch.Tensor | None = None  # [N] int64
    bias_ids: torch.Tensor | None = None  # [N] int64
    bias_values: torch.Tensor | None = None  # [N] float32
    # structured output: [B, ceil(V / 32)] int32 bitmask of allowed tokens (all bits set on
    # unconstrained rows), filled by the rows' grammar matchers; None when no row has one
    vocab_mask: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        token_histories: list[tuple[list[int], list[int]]],
        num_output_tokens: list[int],
        eos_token_ids: set[int],
        vocab_size: int,
        device: torch.device | str,
        shared_generator: torch.Generator | None = None,
        penalty_states: list[PenaltyState | None] | None = None,
    ) -> SamplingBatchInfo:
        """Precompute one step's sampling tensors.

        ``params`` must already be verified. Row ``i`` has ``generators[i]`` (required when
        ``params[i].seed`` is set; see :func:`make_generator`), ``token_histories[i] =
        (prompt_ids, output_ids)`` and ``num_output_tokens[i]`` tokens generated so far.
        Unseeded rows without a generator draw from ``shared_generator`` (torch's default
        generator when it is None). Raises ValueError naming the bad argument.

        ``penalty_states[i]``, when given for a row with penalties, holds that row's token
        statistics over a prefix of its output (see :class:`PenaltyState`); only the output
        tokens past that prefix are read from ``token_histories[i]``, so a long history is
        not walked again every step.
        """
        batch_size = len(params)
        for name, value in (
            ("generators", generators),
            ("token_histories", token_histories),
            ("num_output_tokens", num_output_tokens),
        ):
            if len(value) != batch_size:
                raise ValueError(
                    f"{name} has {len(value)} rows, expected {batch_size} (one per params)"
                )
        if batch_size == 0:
            raise ValueError("params is empty: build a SamplingBatchInfo for at least one row")
        device = torch.device(device)
        greedy = [p.is_greedy for p in params]
        info = cls(
            batch_size=batch_size,
            vocab_size=vocab_size,
            device=device,
            is_all_greedy=all(greedy),
            return_logprob=any(p.return_logprob for p in params),
        )
        if not info.is_all_greedy:
            info._build_sampling(params, greedy, generators, shared_generator)
        info._build_logit_bias(params)
        info._build_penalties(params, token_histories, penalty_states)
        info._build_min_tokens(params, num_output_tokens, eos_token_ids)
        if info.return_logprob:
            info.top_logprobs_nums = [p.top_logprobs_num if p.return_logprob else 0 for p in params]
        return info

    def _column(self, values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).view(-1, 1).to(self.device, non_blocking=True)

    def _build_sampling(self, params, greedy, generators, shared_generator) -> None:
        if any(greedy):
            self.greedy_mask = torch.tensor(greedy, dtype=torch.bool).to(self.device)
        self.temperatures = self._column(
            [
                1.0 if g else max(p.temperature, _MIN_TEMPERATURE)
                for p, g in zip(params, greedy, strict=True)
            ]
        )
        sampled = [p for p, g in zip(params, greedy, strict=True) if not g]
        vocab = self.vocab_size
        if any(p.top_k > 1 and p.top_k < vocab for p in sampled):
            self.top_ks = self._column(
                [p.top_k if 1 <= p.top_k < vocab else vocab for p in params], torch.int64
            )
        if any(p.top_p < 1.0 for p in sampled):
            self.top_ps = self._column([p.top_p for p in params])
        if any(p.min_p > 0.0 for p in sampled):
            self.min_ps = self._column([p.min_p for p in params])
        for i, (p, g) in enumerate(zip(params, generators, strict=True)):
            if p.seed is not None and g is None:
                raise ValueError(
                    f"generators[{i}] is None but params[{i}].seed={p.seed}; "
                    "create one with make_generator(seed, device)"
                )
        self.generators = list(generators)
        self.seeded_rows = [
            i
            for i, (g, is_greedy) in enumerate(zip(generators, greedy, strict=True))
            if g is not None and not is_greedy
        ]
        self.shared_generator = shared_generator

    def _build_logit_bias(self, params) -> None:
        rows = [i for i, p in enumerate(params) if p.logit_bias]
        if not rows:
            return
        pairs = [params[i].logit_bias_tensors for i in rows]  # built once per request
        flat_rows, flat_ids = self._pairs(rows, [ids for ids, _ in pairs], "logit_bias")
        values = torch.cat([v for _, v in pairs])
        self.bias_rows, self.bias_ids, self.bias_values = (
            t.to(self.device, non_blocking=True) for t in (flat_rows, flat_ids, values))

    def _build_penalties(self, params, token_histories, penalty_states=None) -> None:
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        freq_rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
        if not rep_rows and not freq_rows:
            return
        states = penalty_states or [None] * self.batch_size
        if len(states) != self.batch_size:
            raise ValueError(f"penalty_states has {len(states)} rows, expected {self.batch_size} (one per params)")
        if rep_rows:
            self.repetition_penalties = self._column([p.repetition_penalty for p in params])
            mask, rows, ids = self._start_rows(rep_rows, states, "seen", torch.bool, token_histories, True)
            mask[rows, ids] = True
            self.repetition_mask = mask.to(self.device, non_blocking=True)
        if freq_rows:
            self.frequency_penalties = self._column([p.frequency_penalty for p in params])
            self.presence_penalties = self._column([p.presence_penalty for p in params])
            counts, rows, ids = self._start_rows(freq_rows, states, "counts", torch.float32, token_histories, False)
            counts.index_put_((rows, ids), torch.ones(len(ids)), accumulate=True)
            self.output_counts = counts.to(self.device, non_blocking=True)

    def _start_rows(self, rows, states, attr, dtype, token_histories, with_prompt):
        """A ``[B, V]`` tensor holding each row's statistics ``attr`` from its PenaltyState (zeros
        elsewhere), and the (row, token) pairs still to add: the tokens past the state's counted
        output, or the whole history (prompt too when ``with_prompt``) of a row without one."""
        out = torch.zeros(self.batch_size, self.vocab_size, dtype=dtype)  # [B, V]
        fresh = []
        for i in rows:
            state = states[i]
            kept = None if state is None else getattr(state, attr)
            if kept is not None:
                out[i] = kept
                fresh.append(state.unseen(token_histories[i][1]))
            else:
                fresh.append(itertools.chain(*token_histories[i]) if with_prompt else token_histories[i][1])
        flat_rows, flat_ids = self._flatten(rows, fresh, "token_histories")
        return out, flat_rows, flat_ids

    def _build_min_tokens(self, params, num_output_tokens, eos_token_ids) -> None:
        rows = [i for i, p in enumerate(params) if num_output_tokens[i] < p.min_new_tokens]
        if not rows:
            return
        eos = torch.tensor(sorted(eos_token_ids), dtype=torch.int64)
        banned = [torch.cat((eos, params[i].stop_token_tensor)) for i in rows]  # a repeat is harmless
        if any(len(b) for b in banned):
            self.banned_rows, self.banned_ids = (
                t.to(self.device) for t in self._pairs(rows, banned, "eos_token_ids/stop_token_ids"))

    def _flatten(self, rows: list[int], id_lists, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index, token id) pairs as two CPU int64 tensors; ids are range-checked."""
        flat_rows, flat_ids = [], []
        for row, ids in zip(rows, id_lists, strict=True):
            ids = list(ids)
            flat_ids.extend(ids)
            flat_rows.extend([row] * len(ids))
        ids_t = torch.tensor(flat_ids, dtype=torch.int64)  # [N]
        self._check_ids(ids_t, what)
        return torch.tensor(flat_rows, dtype=torch.int64), ids_t

    def _pairs(self, rows: list[int], ids: list[torch.Tensor], what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index, token id) pairs of per-row id tensors, as :meth:`_flatten` without a
        Python loop over the ids."""
        counts = torch.tensor([len(t) for t in ids], dtype=torch.int64)
        flat_ids = torch.cat(ids)
        self._check_ids(flat_ids, what)
        return torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), counts), flat_ids

    def _check_ids(self, ids: torch.Tensor, what: str) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(
                f"{what} holds token id {int(ids.min())}..{int(ids.max())}, "
                f"outside the vocabulary [0, {self.vocab_size})"
            )

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_mask is not None
            or self.output_counts is not None
            or self.banned_rows is not None
        )

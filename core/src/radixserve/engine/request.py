"""A request's token state from admission to finish."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.sampling import PenaltyState, SamplingParams

SALT_TOKENS = 8  # leading tokens a cache salt moves: a shared prefix needs all their offsets equal


@functools.lru_cache(maxsize=4096)
def salt_offsets(salt: str) -> tuple[int, ...]:
    """Per-position offsets of a salted request's first :data:`SALT_TOKENS` cache ids: 31
    bits of a SHA-256 of the salt each, shifted above any vocabulary (ids stay below 2^63,
    as HiCache's page keys pack them)."""
    digest = hashlib.sha256(b"radixserve-cache-salt\0" + salt.encode("utf-8", "surrogatepass")).digest()
    return tuple(((int.from_bytes(digest[4 * i:4 * i + 4], "little") & 0x7FFFFFFF) | 1) << 32
                 for i in range(SALT_TOKENS))


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # resolved (never None)
    on_output: Callable[[Req, int, bool], None] | None = None  # (req, num_new_tokens, finished)
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    # penalties: running token statistics, made on first use
    penalty_state: PenaltyState | None = None
    finish_reason: dict[str, Any] | None = None
    # memory: pages[:num_tree_pages] belong to the prefix cache (locked through
    # prefix_node); the rest belong to this request
    req_pool_idx: int | None = None
    pages: list[int] = field(default_factory=list)
    num_tree_pages: int = 0
    prefix_node: Any = None
    kv_len: int = 0  # tokens whose K/V are in the pool
    arrival: int = 0  # admission order, for fcfs
    priority: int = 0  # --enable-priority-scheduling: lower values are served first
    num_retractions: int = 0
    num_preemptions: int = 0  # retractions for another request (priority, or HiCache's first-token rule)
    # logprobs (when params.return_logprob)
    output_token_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    # prompt logprobs (params.wants_prompt_logprobs): of prompt tokens max(1, logprob_start_len)
    # on, in order, filled chunk by chunk as the prefill computes them (token 0 has none)
    input_token_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    # n > 1 with prompt logprobs: the sibling that computes them for the whole group (this
    # request's own params ask for none, so its prompt can come from the prefix cache)
    prompt_logprobs_from: Req | None = None
    # stop strings: the matcher decodes the output incrementally (created on first use)
    stop_matcher: Any = None  # radixserve.detokenizer.StopStringMatcher
    stop_text: str | None = None  # output text with the matched stop trimmed, once finished
    cached_tokens: int = 0
    # cache_salt / extra_key: the prefix-cache namespace (see cache_ids); None: the shared one
    cache_salt: str | None = None
    # LoRA (--enable-lora): the adapter's name, and its key (name and content hash) that joins the
    # prefix-cache namespace; None: the base model
    lora_name: str | None = None
    lora_key: str | None = None
    # structured output: the compile this request waits for, then its matcher
    grammar_job: Any = None  # radixserve.grammar.manager.CompileJob
    grammar: Any = None  # radixserve.grammar.GrammarMatcher
    # who sent it (the HTTP server gives the peer's address; None: the engine's own caller),
    # for --grammar-max-compiles-per-client
    client: str | None = None
    # speculative decoding: decode steps that verified this request, draft tokens accepted
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    # SGLang's bootstrap_host/port/room/pair_key and decode_tp_size, as its router sends them
    # (prefill-decode disaggregation); carried with the request
    bootstrap: dict[str, Any] | None = None
    # params.return_hidden_states: the final normed hidden state of each computed position
    # whose answer is wanted: the prompt's rows (one [T, H] entry), then one row per decode
    # step; the engine process hands them out as they come (hidden_sent: rows already sent)
    hidden_states: list = field(default_factory=list)
    hidden_sent: int = 0
    # --enable-dp-attention: the attention group whose ranks hold this request's KV, and the one
    # the client asked for (SGLang's routed_dp_rank; None: the scheduler chooses)
    dp_group: int = 0
    dp_rank: int | None = None

    def penalty_state_for(self, vocab_size: int):
        """This request's :class:`~radixserve.sampling.PenaltyState`, advanced over its output
        so far; None when it sets no penalty."""
        if not self.params.has_penalties:
            return None
        if self.penalty_state is None:
            self.penalty_state = PenaltyState(self.params, self.input_ids, vocab_size)
        self.penalty_state.advance(self.output_ids)
        return self.penalty_state

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def spec_accept_length(self) -> float:
        """Mean tokens per verify step (accepted drafts plus the step's own token)."""
        return (self.spec_verify_ct + self.spec_accepted_tokens) / self.spec_verify_ct if self.spec_verify_ct else 0.0

    @property
    def in_prefill(self) -> bool:
        """Admitted and still computing its tokens' K/V in chunks: its prompt, or (resumed
        after a retraction) its prompt and output; a decoding request lacks only its last
        token's."""
        return self.kv_len < self.seq_len - (1 if self.output_ids else 0)

    @property
    def prompt_logprob_next(self) -> int:
        """The first prompt token whose logprob is still to compute; ``len(input_ids)`` when
        none is (all done, or none asked). Its logprob comes from the logits at the
        position before it, so that position must be computed, not taken from the cache."""
        p = self.params
        if not p.wants_prompt_logprobs:
            return len(self.input_ids)
        return max(1, p.logprob_start_len) + len(self.input_token_logprobs)

    def prompt_logprob_span(self, start: int, end: int) -> tuple[int, int]:
        """Positions ``[a, b)`` among the computed positions ``[start, end)`` whose logits
        give still-missing prompt logprobs (position ``p`` predicts prompt token ``p + 1``);
        ``a == b`` when there are none."""
        first = self.prompt_logprob_next - 1
        if start > first and first < len(self.input_ids) - 1:
            raise RuntimeError(f"request {self.rid}: computing from position {start} would skip the prompt "
                               f"logprob at position {first} (its prefix match should have been capped)")
        a = max(start, first)
        return a, max(a, min(end, len(self.input_ids) - 1))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def cache_ids(self) -> list[int]:
        """The ids the prefix cache (every tier) keys this request's tokens by: ``all_ids``, with
        the first :data:`SALT_TOKENS` moved out of the vocabulary into ``cache_salt``'s own
        range, so requests of different salts (or none) never share a cached prefix. A LoRA
        adapter joins the salt: KV computed under an adapter is reused by that adapter only."""
        ids = self.all_ids
        if self.cache_salt is None and self.lora_key is None:
            return ids
        salt = self.cache_salt if self.lora_key is None else f"{self.cache_salt or ''}\0lora\0{self.lora_key}"
        offsets = salt_offsets(salt)
        return [t + o for t, o in zip(ids, offsets, strict=False)] + ids[len(offsets):]


def trailing_decode_rows(reqs: list[Req]) -> int:
    """How many requests at the end of a mixed batch are decoding (only their last token's
    K/V is missing)."""
    n = 0
    for r in reversed(reqs):
        if not r.output_ids or r.kv_len != r.seq_len - 1:
            break
        n += 1
    return n

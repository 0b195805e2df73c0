"""Turning validated requests into engine sequences and their text, outside the engine.

A *sequence* is one engine request (a choice of an OpenAI response; a prompt given
``n > 1`` is ``n`` sequences). :meth:`Generator.run` submits sequences, detokenises their
token ids incrementally, records metrics and yields :class:`Delta` objects tagged with the
sequence's index. Leaving the iterator early (a client that went away) aborts whatever is
still running, so its KV pages go back to the pool.

Every request registers the ids a client may abort it by (its ``rid``, and the ids of its
``n`` children and prompts) for as long as it runs: ``/abort_request`` aborts by exact id,
never by prefix, and a client-chosen ``rid`` already in flight is refused with a 400.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from radixserve.config.limits import RequestLimitArgs
from radixserve.grammar import check_constraint_size
from radixserve.sampling import InvalidSamplingParams, SamplingParams
from radixserve.sampling.limits import check_fields, check_prompt_work

from radixserve_server.detokenizer import IncrementalDetokenizer
from radixserve_server.engine_client import EngineClient, EngineError
from radixserve_server.errors import APIError, from_finish_reason
from radixserve_server.metrics import Metrics
from radixserve_server.protocol import from_sampling_error
from radixserve_server.siblings import share_prompt_logprobs

# SGLang name -> OpenAI name, for errors raised while checking OpenAI requests
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                "top_logprobs_num": "top_logprobs", "return_logprob": "logprobs"}


@dataclass
class SeqSpec:
    rid: str
    input_ids: list[int]
    params: dict[str, Any]  # SGLang sampling parameters (n == 1)
    priority: int | None = None  # None: the engine's --default-priority-value
    arrival: float = field(default_factory=time.perf_counter)  # when its HTTP request arrived
    bootstrap: dict[str, Any] | None = None  # SGLang's bootstrap_* fields (disaggregation), to the engine
    cache_salt: str | None = None  # cache_salt / extra_key: the prefix-cache namespace
    lora_path: str | None = None  # the LoRA adapter it runs under (None: the base model)
    dp_rank: int | None = None  # --dp-size: the replica it must run on (routed_dp_rank)
    count_metrics: bool = True  # false: not counted in /metrics (log_metrics: false)
    answer: dict[str, Any] = field(default_factory=dict)  # how to render its answer (not for the engine)
    # n > 1 with prompt logprobs: the sibling that computes them; this one reports its answer
    prompt_logprobs_from: SeqSpec | None = None


@dataclass
class Delta:
    index: int
    text: str  # new text since the previous delta
    ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    finished: bool = False
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    spec_verify_ct: int | None = None  # running totals; None when speculation is off
    spec_accepted_tokens: int = 0
    # prompt logprobs, on the first delta after the prefill only (see engine_proc.Update)
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[tuple[list[int], list[float]] | None] | None = None
    hidden_states: list | None = None  # return_hidden_states: new rows (see engine_proc.Update)


@dataclass
class SeqResult:
    """Everything one sequence produced, gathered from its deltas."""

    rid: str
    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    ended: float = 0.0
    spec_verify_ct: int | None = None  # verify steps (None when speculation is off)
    spec_accepted_tokens: int = 0  # draft tokens those steps accepted
    input_token_logprobs: list[tuple[float | None, int]] | None = None  # prompt logprobs, when asked
    input_top_logprobs: list[tuple[list[int], list[float]] | None] | None = None
    first_token: float = 0.0  # when its first token arrived
    hidden_states: list | None = None  # return_hidden_states, in SGLang's layout

    @property
    def spec_accept_length(self) -> float:
        """Mean tokens per verify step (accepted drafts plus the step's own token), as the
        engine's ``Req.spec_accept_length``; 0.0 before the first verify step."""
        ct = self.spec_verify_ct or 0
        return (ct + self.spec_accepted_tokens) / ct if ct else 0.0

    def add(self, d: Delta) -> None:
        if d.ids and not self.first_token:
            self.first_token = time.perf_counter()
        self.text += d.text
        self.ids += d.ids
        if d.prompt_tokens:  # known from the first update on (cached_tokens once it is admitted)
            self.prompt_tokens = d.prompt_tokens
            self.cached_tokens = d.cached_tokens
        if d.hidden_states is not None:
            self.hidden_states = (self.hidden_states or []) + d.hidden_states
        self.logprobs += d.logprobs
        self.top_logprobs += d.top_logprobs
        if d.input_token_logprobs is not None:
            self.input_token_logprobs = d.input_token_logprobs
            self.input_top_logprobs = d.input_top_logprobs
        if d.spec_verify_ct is not None:
            self.spec_verify_ct = d.spec_verify_ct
            self.spec_accepted_tokens = d.spec_accepted_tokens
        if d.finished:
            self.finish_reason = d.finish_reason
            self.ended = time.perf_counter()


def as_list(value: Any) -> list | None:
    """A field given as one item or a list of them, as a list (None when absent)."""
    if not value:
        return None
    return list(value) if isinstance(value, (list, tuple)) else [value]


def finish_reason_str(reason: dict[str, Any] | None) -> str | None:
    """OpenAI's finish_reason: stop, length or abort."""
    return None if reason is None else reason.get("type")


def max_chars_per_token(tokenizer) -> float | None:
    """An upper bound on the characters of prompt text one token can cover, so a prompt
    that can never fit the context is refused without tokenising it; None when unknown.

    Without a normalizer (byte-level BPE: Llama 3, Qwen, SmolLM, ...) a token covers at
    most as many characters as its vocabulary entry is long. A normalizer may shorten the
    text (Unicode composition), so its bound gets a 4x margin."""
    hf = getattr(tokenizer, "hf", None)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        longest = max(len(piece) for piece in hf.get_vocab())
    except (AttributeError, TypeError, ValueError):
        return None
    return float(longest * (1 if backend.normalizer is None else 4))


class Generator:
    def __init__(self, client: EngineClient, tokenizer, metrics: Metrics, info: dict[str, Any]) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.context_length: int = info["context_length"]
        self.vocab_size: int = info["vocab_size"]
        self.max_spec_bytes: int = info.get("grammar_max_spec_bytes", 0)  # --grammar-max-spec-bytes
        self.chars_per_token = max_chars_per_token(tokenizer)
        # the engine's per-request bounds (--max-stop-strings, ...), checked here first
        self.limits = RequestLimitArgs(**info.get("request_limits", {}))
        # every id a client may abort a running request by -> the rids of its sequences
        self.names: dict[str, list[str]] = {}
        self.aborting: set[str] = set()  # sequences sent an abort, until their request ends

    # ------------------------------------------------------------ checking
    def check_text_length(self, text: str, param: str) -> None:
        """Refuse, before tokenising, a text too long for the context whatever its tokens."""
        if self.chars_per_token is None:
            return
        at_least = math.ceil(len(text) / self.chars_per_token)
        if at_least >= self.context_length:
            raise APIError(400, f"the prompt is {len(text)} characters, at least {at_least} tokens; this "
                           f"model's context length is {self.context_length} tokens, so nothing is left "
                           "to generate", param=param, code="context_length_exceeded")

    def check_ids(self, ids: Any, param: str) -> list[int]:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, f"{param} must be a list of token ids", param=param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                           param=param)
        if not ids:
            raise APIError(400, f"{param}: the prompt is empty", param=param)
        return ids

    def resolve_max_tokens(self, num_prompt: int, max_tokens: int | None, prompt_param: str,
                           max_param: str = "max_tokens") -> int:
        """``max_tokens`` checked against the context, or what is left of it when not given."""
        ctx = self.context_length
        if num_prompt >= ctx:
            raise APIError(400, f"the prompt is {num_prompt} tokens; this model's context length is {ctx} "
                           "tokens, so nothing is left to generate", param=prompt_param,
                           code="context_length_exceeded")
        if max_tokens is None:
            return ctx - num_prompt
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and num_prompt + max_tokens > ctx:
            raise APIError(400, f"the prompt ({num_prompt} tokens) plus {max_param} ({max_tokens}) is "
                           f"{num_prompt + max_tokens} tokens, over this model's context length of {ctx}",
                           param=max_param, code="context_length_exceeded")
        return max_tokens

    def check_params(self, params: dict[str, Any], names: dict[str, str] | None = None) -> None:
        try:
            verified = SamplingParams.from_dict(dict(params), self.vocab_size)
            check_fields(verified, self.limits)
            check_constraint_size(verified, self.max_spec_bytes)
        except InvalidSamplingParams as e:
            raise from_sampling_error(e, names) from None

    def check_work(self, specs: list[SeqSpec]) -> None:
        """The prompt tokens of all of a request's sequences within --max-request-prompt-tokens."""
        try:
            check_prompt_work(sum(len(s.input_ids) for s in specs), self.limits,
                              "n" if len(specs) > 1 else "prompt")
        except InvalidSamplingParams as e:
            raise from_sampling_error(e) from None

    @staticmethod
    def expand(rid: str, ids: list[int], params: dict[str, Any], n: int,
               priority: int | None = None, cache_salt: str | None = None) -> list[SeqSpec]:
        """``n`` sequences of one prompt; seeded requests use seed, seed+1, ...

        Prompt logprobs are computed by the first sequence only; the others ask for none (so
        their prompt comes from the prefix cache) and report the first one's (see :meth:`run`)."""
        if n == 1:
            return [SeqSpec(rid, ids, params, priority=priority, cache_salt=cache_salt)]
        start = params.get("logprob_start_len")
        shared = bool(params.get("return_logprob")) and isinstance(start, int) and start >= 0
        out = []
        for i in range(n):
            p = dict(params)
            if p.get("seed") is not None:
                p["seed"] = p["seed"] + i
            if i and shared:
                p["logprob_start_len"] = -1
            out.append(SeqSpec(f"{rid}-{i}", ids, p, priority=priority, cache_salt=cache_salt,
                               prompt_logprobs_from=out[0] if i and shared else None))
        return out

    # ------------------------------------------------------------ ids
    def _register(self, names: dict[str, list[str]], specs: list[SeqSpec]) -> None:
        """Claim every id of one request; a 400 naming ``rid`` when one is already in flight
        (checked before any sequence is submitted)."""
        seqs = [s.rid for s in specs]
        taken = [n for n in names if n in self.names]
        if len(set(seqs)) != len(seqs):
            raise APIError(400, "rid: the request ids of this request repeat (give each prompt its own rid)",
                           param="rid", code="duplicate_rid")
        if taken:
            raise APIError(400, f"rid: a request with id {taken[0]!r} is already in flight; request ids "
                           "must be unique among running requests", param="rid", code="duplicate_rid")
        for name, rids in names.items():
            self.names[name] = rids

    def _release(self, names: dict[str, list[str]]) -> None:
        for name, rids in names.items():
            if self.names.get(name) is rids:
                del self.names[name]
                self.aborting.discard(name)

    def _abort(self, rids) -> list[str]:
        running = set(self.client.in_flight())
        aborted = sorted({r for r in rids if r in running and r not in self.aborting})
        for r in aborted:
            self.aborting.add(r)
            self.client.abort(r)
        return aborted

    def abort(self, rid: str) -> list[str]:
        """Abort the running request whose id is exactly ``rid`` (a request's rid aborts all
        its sequences); returns the rids of the sequences newly aborted."""
        return self._abort(self.names.get(rid, ()))

    def abort_all(self) -> list[str]:
        """Abort every client request now running (health probes are left alone)."""
        return self._abort(r for rids in self.names.values() for r in rids)

    # ------------------------------------------------------------- running
    async def _sequence(self, index: int, spec: SeqSpec, metrics: Metrics | None) -> AsyncIterator[Delta]:
        params = spec.params
        if not spec.count_metrics:
            metrics = None
        try:
            if spec.dp_rank is not None:  # checked against --dp-size by the route
                self.client.pin(spec.rid, spec.dp_rank)
            handle = self.client.submit(spec.rid, spec.input_ids, params, spec.priority, spec.bootstrap,
                                        spec.cache_salt, spec.lora_path)
        except ValueError as e:  # the id is in use by a request this process did not register
            raise APIError(400, f"rid: {e}", param="rid", code="duplicate_rid") from None
        detok = IncrementalDetokenizer(self.tokenizer, params.get("skip_special_tokens", True),
                                       as_list(params.get("stop")), as_list(params.get("stop_regex")))
        start = time.perf_counter()
        last: float | None = None
        try:
            async for u in handle.updates():
                now = time.perf_counter()
                reason = u.finish_reason or {}
                if u.finished and reason.get("status_code"):
                    # 400 rejected, 429 queue full, 500 failed in the engine, 503 engine stopping
                    raise from_finish_reason(reason)
                if u.new_ids and metrics is not None:
                    if last is None:
                        metrics.observe_first_token(now - start)
                    metrics.observe_tokens(len(u.new_ids), None if last is None else now - last)
                    last = now
                detok.add(u.new_ids)
                text = detok.finish(u.stop_text) if u.finished else detok.delta()
                if u.finished and metrics is not None:
                    metrics.observe_finished(u.prompt_tokens, u.cached_tokens,
                                             reason.get("type", "unknown"), now - start)
                yield Delta(index, text, u.new_ids, u.logprobs, u.top_logprobs, u.finished,
                            u.finish_reason, u.prompt_tokens, u.cached_tokens, u.spec_verify_ct,
                            u.spec_accepted_tokens, u.input_token_logprobs, u.input_top_logprobs,
                            u.hidden_states)
        finally:
            if not handle.finished:
                self.client.abort(spec.rid)

    async def run(self, specs: list[SeqSpec], names: dict[str, list[str]] | None = None,
                  probe: bool = False) -> AsyncIterator[Delta]:
        """Deltas of all sequences as they arrive. The first APIError of any sequence is
        raised (the others are aborted); so is EngineError when the engine died.

        ``names``: the ids a client may abort this request by, each with its sequences'
        rids (default: each sequence's own rid), held while it runs. A ``probe`` (the
        health check) is neither registered nor counted in the metrics."""
        if self.client.error is not None:
            raise APIError(503, f"the engine is not running: {self.client.error}")
        metrics = None if probe else self.metrics
        if probe:
            names = {}
        elif names is None:
            names = {s.rid: [s.rid] for s in specs}
        if not probe:
            self.check_work(specs)
        self._register(names, specs)
        try:
            async for d in share_prompt_logprobs(self._run(specs, metrics), specs):
                yield d
        finally:
            self._release(names)

    async def _run(self, specs: list[SeqSpec], metrics: Metrics | None) -> AsyncIterator[Delta]:
        if len(specs) == 1:
            try:
                async for d in self._sequence(0, specs[0], metrics):
                    yield d
            except EngineError as e:
                raise APIError(503, f"the engine stopped: {e}") from None
            return
        queue: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(i: int, spec: SeqSpec) -> None:
            try:
                async for d in self._sequence(i, spec, metrics):
                    await queue.put(d)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put(e)
                if isinstance(e, asyncio.CancelledError):
                    raise
            finally:
                await queue.put(end)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(specs)]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is end:
                    remaining -= 1
                elif isinstance(item, EngineError):
                    raise APIError(503, f"the engine stopped: {item}")
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, specs: list[SeqSpec], names: dict[str, list[str]] | None = None,
                      probe: bool = False) -> list[SeqResult]:
        results = [SeqResult(s.rid, started=s.arrival) for s in specs]
        async for d in self.run(specs, names, probe):
            results[d.index].add(d)
        return results


def request_names(groups: list[tuple[str, list[SeqSpec]]], rid: str | None = None) -> dict[str, list[str]]:
    """The ids a client may abort one request by: ``rid`` (all its sequences), each
    ``(prompt id, sequences)`` group's id, and each sequence's own id (``rid-i``,
    ``rid-p{k}-{i}``)."""
    names: dict[str, list[str]] = {}
    if rid is not None:
        names[rid] = [s.rid for _, g in groups for s in g]
    for prompt_rid, g in groups:
        if prompt_rid in names and prompt_rid != rid:
            raise APIError(400, f"rid: {prompt_rid!r} is given to more than one prompt", param="rid",
                           code="duplicate_rid")
        names.setdefault(prompt_rid, [s.rid for s in g])
    for _, g in groups:
        for s in g:
            names.setdefault(s.rid, [s.rid])
    return names

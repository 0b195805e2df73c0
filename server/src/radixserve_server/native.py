"""SGLang's native ``POST /generate`` (its ``GenerateReqInput``) and the ``meta_info`` of
its answers.

Every field of SGLang's request is taken (:class:`~.protocol.GenerateRequest` and
:mod:`.sglang_fields`). Per prompt, the logprob fields and ``return_hidden_states`` take one
value or a list. ``meta_info`` carries, in every streamed chunk as in the final answer:
``id``, ``finish_reason`` (null until the end), ``prompt_tokens``, ``cached_tokens``,
``completion_tokens``, ``e2e_latency`` (seconds since the request arrived),
``request_received_ts``, and once known ``first_token_latency``,
``request_finished_ts`` and ``decode_throughput``. With ``return_logprob``:
``output_token_logprobs`` (``[]`` when nothing was generated) as ``[logprob, token id,
text]`` (text only with ``return_text_in_logprobs``, else null), ``output_top_logprobs``
with ``top_logprobs_num``, and the prompt's (``input_token_logprobs``, ``input_top_logprobs``)
from ``logprob_start_len``, which defaults to 0 for a request that generates nothing
(``max_new_tokens: 0``: scoring, as SGLang's frontend does for ``select``). With
``return_hidden_states``: ``hidden_states``, the model's final (normed) hidden state as
SGLang lays it out: first the prompt's rows, then one per output token after the first
(``"last"``: only the last of them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from radixserve.engine.hidden_states import hidden_states_answer

from radixserve_server.generation import SeqResult, SeqSpec, request_names
from radixserve_server.http_io import (
    check_n,
    new_id,
    read_request,
    sse,
    start_stream,
    tokenize,
    until_done_or_gone,
)
from radixserve_server.protocol import APIError, GenerateRequest
from radixserve_server.sessions import Sessions

logger = logging.getLogger("radixserve.requests")

# per-sequence answer options (not sampling parameters): kept on the SeqSpec
ANSWER_FIELDS = ("return_text_in_logprobs", "return_hidden_states")


def entries(pairs, text: Callable[[int], str] | None) -> list[list]:
    """SGLang's logprob entries ``[logprob, token id, text or None]``."""
    return [[lp, t, text(t) if text else None] for lp, t in pairs]


def meta_info(r: SeqResult, spec: SeqSpec, token_text: Callable[[int], str], speculative: bool) -> dict[str, Any]:
    now = time.perf_counter()
    ended = r.ended or None
    meta: dict[str, Any] = {
        "id": r.rid, "finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens,
        "completion_tokens": len(r.ids), "cached_tokens": r.cached_tokens,
        "e2e_latency": (ended or now) - r.started,
        "request_received_ts": time.time() - (now - r.started),
    }
    if r.first_token:
        meta["first_token_latency"] = r.first_token - r.started
    if ended:
        meta["request_finished_ts"] = time.time() - (now - ended)
        if r.first_token and len(r.ids) > 1 and ended > r.first_token:
            meta["decode_throughput"] = (len(r.ids) - 1) / (ended - r.first_token)
    if speculative:
        meta["spec_verify_ct"] = r.spec_verify_ct or 0
        meta["spec_accept_length"] = r.spec_accept_length
    p = spec.params
    text = token_text if spec.answer.get("return_text_in_logprobs") else None
    if p.get("return_logprob"):
        meta["output_token_logprobs"] = entries(zip(r.logprobs, r.ids), text)
        if p.get("top_logprobs_num"):
            meta["output_top_logprobs"] = [entries(zip(tlps, tids), text) for tids, tlps in r.top_logprobs]
    if r.input_token_logprobs is not None:  # logprob_start_len >= 0: SGLang's prompt logprobs
        meta["input_token_logprobs"] = entries(r.input_token_logprobs, text)
        if r.input_top_logprobs is not None:
            meta["input_top_logprobs"] = [None if e is None else entries(zip(e[1], e[0]), text)
                                          for e in r.input_top_logprobs]
    if spec.answer.get("return_hidden_states"):
        meta["hidden_states"] = hidden_states_answer(r.hidden_states or [], spec.answer["return_hidden_states"])
    return meta


def _resolve_params(body: GenerateRequest, p: dict[str, Any], k: int, count: int) -> dict[str, Any]:
    """Prompt ``k``'s sampling parameters with the body's per-prompt logprob fields."""
    p = dict(p)
    for name in ("return_logprob", "top_logprobs_num", "logprob_start_len"):
        value = body.per_prompt(name, k, count)
        if value is not None:
            p[name] = value
    hidden = body.per_prompt("return_hidden_states", k, count)
    if hidden:
        p["return_hidden_states"] = hidden
    if p.get("return_logprob") and p.get("max_new_tokens") == 0 and p.get("logprob_start_len", -1) == -1:
        p["logprob_start_len"] = 0  # scoring a prompt: its logprobs, as SGLang answers it
    return p


def add_native_routes(app: FastAPI, state, token_text: Callable[[int], str]) -> None:
    """``POST /generate``; ``token_text`` is a token's text in logprob entries."""
    sessions: Sessions = state.sessions

    @app.post("/generate")
    async def generate(request: Request):
        arrival = time.perf_counter()
        body = await read_request(request, state, GenerateRequest)
        gen = await state.accepting()
        body.check()
        if (body.text is None) == (body.input_ids is None):
            raise APIError(400, "give exactly one of text or input_ids", param="text")
        limit = state.http.max_batch_prompts
        field_name = "text" if body.text is not None else "input_ids"
        if body.text is not None:
            single = isinstance(body.text, str)
            texts = [body.text] if single else body.text
            count = len(texts)
        else:
            single = not body.input_ids or isinstance(body.input_ids[0], int)
            raw = [body.input_ids] if single else body.input_ids
            count = len(raw)
        if count > limit:
            raise APIError(400, f"{field_name} has {count} prompts, over this server's limit of {limit} "
                           "(--max-batch-prompts)", param=field_name)
        sp = body.sampling_params if body.sampling_params is not None else {}
        plist = sp if isinstance(sp, list) else [sp] * count
        if len(plist) != count:
            raise APIError(400, f"{len(plist)} sampling_params for {count} prompts", param="sampling_params")
        if isinstance(body.rid, str) and not single:
            raise APIError(400, "rid must be a list with one id per prompt for a batch", param="rid")
        rids = body.rid if isinstance(body.rid, list) else [body.rid] * count
        if len(rids) != count:
            raise APIError(400, f"{len(rids)} rids for {count} prompts", param="rid")
        ns = []
        for p in plist:
            n = p.get("n", 1) if isinstance(p, dict) else 1
            if isinstance(n, int) and not isinstance(n, bool):
                check_n(n, limit, "sampling_params.n")
                ns.append(n)
        if sum(ns) > limit:
            raise APIError(400, f"{count} prompts with n = {ns[0] if len(set(ns)) == 1 else ns} are "
                           f"{sum(ns)} sequences, over this server's limit of {limit} (--max-batch-prompts)",
                           param="sampling_params.n")
        session = (sessions.resolve(body.session_params, count, ns, gen.names)
                   if body.session_params is not None else None)
        if body.text is not None:
            prompts = await tokenize(state, gen, texts, ["text"] * count)
        else:
            prompts = [gen.check_ids(p, "input_ids") for p in raw]
        if session is not None:
            prompts = [session.prompt(prompts[0], state.tokenizer.hf.bos_token_id)]
        dp_rank = state.check_dp_rank(body.dp_rank())
        groups: list[tuple[str, list[SeqSpec]]] = []
        for k, (ids, p) in enumerate(zip(prompts, plist)):
            p = _resolve_params(body, p, k, count)
            n = p.pop("n", 1)
            # max_new_tokens 0 asks for no output at all: the prompt's info, empty text
            if p.get("max_new_tokens", 128) is None or "max_new_tokens" not in p:
                p["max_new_tokens"] = gen.resolve_max_tokens(len(ids), p.get("max_new_tokens", 128),
                                                             field_name, "max_new_tokens")
            else:
                gen.resolve_max_tokens(len(ids), p["max_new_tokens"], field_name, "max_new_tokens")
            gen.check_params(dict(p, n=n), {"max_new_tokens": "sampling_params.max_new_tokens",
                                            "n": "sampling_params.n"})
            rid = rids[k] or new_id("gen")
            group = gen.expand(rid, ids, p, n, body.priority, body.cache_namespace(k))
            lora = body.lora_of(k)
            for spec in group:
                spec.lora_path = lora
                spec.arrival = arrival
                spec.bootstrap = body.bootstrap_for(n, k)
                spec.dp_rank = dp_rank
                spec.count_metrics = body.log_metrics
                spec.answer = {"return_text_in_logprobs": body.return_text_in_logprobs,
                               "return_hidden_states": p.get("return_hidden_states", False)}
            groups.append((rid, group))
        specs = [s for _, g in groups for s in g]
        names = request_names(groups)
        if state.http.log_requests and not body.no_logs:
            state.log_request("/generate", specs, texts if body.text is not None else None)
        if session is not None:
            session.start(specs[0])
        if body.stream:
            if len(specs) != 1:
                raise APIError(400, "streaming /generate takes one prompt with n = 1", param="stream")
            try:
                return await start_stream(request, gen.run(specs, names), lambda ds: _chunks(ds, specs[0], session))
            except BaseException:
                if session is not None:
                    session.end()
                raise
        try:
            results = await until_done_or_gone(request, gen.collect(specs, names))
            if session is not None:
                session.finish(results[0])
        finally:
            if session is not None:
                session.end()
        outs = [output(r, s) for r, s in zip(results, specs)]
        return outs[0] if single and len(outs) == 1 else outs

    def output(r: SeqResult, spec: SeqSpec) -> dict[str, Any]:
        return {"text": r.text, "output_ids": r.ids, "meta_info": meta_info(r, spec, token_text, state.speculative)}

    async def _chunks(deltas, spec: SeqSpec, session) -> AsyncIterator[str]:
        r = SeqResult(spec.rid, started=spec.arrival)
        try:
            async for d in deltas:
                r.add(d)
                yield sse(output(r, spec))
        finally:
            if session is not None:
                if r.finish_reason is not None:
                    session.finish(r)
                session.end()

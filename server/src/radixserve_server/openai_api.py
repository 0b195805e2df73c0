"""The OpenAI routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, with
OpenAI's usage and logprobs shapes."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request

from radixserve_server.chat import chat_prompt_text, chat_size
from radixserve_server.detokenizer import IncrementalDetokenizer
from radixserve_server.generation import (
    OPENAI_NAMES,
    SeqResult,
    SeqSpec,
    finish_reason_str,
    request_names,
)
from radixserve_server.http_io import (
    check_n,
    encode_texts,
    new_id,
    read_request,
    sse,
    start_stream,
    tokenize,
    until_done_or_gone,
)
from radixserve_server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    constraint_names,
)
from radixserve_server.reasoning import StreamSplit, chat_reasoning
from radixserve_server.state import ServerState
from radixserve_server.tool_calling import ChoiceStreams, ToolCalling

logger = logging.getLogger(__name__)


def usage(results: list[SeqResult], n: int, spec: bool = False) -> dict[str, Any]:
    """OpenAI usage; with speculation on (``spec``) also ``spec_verify_ct``, the verify steps
    of all choices, and ``spec_accept_length``, their mean tokens per verify step."""
    firsts = results[::n]  # one sequence per prompt counts its prompt
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(len(r.ids) for r in results)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}
    if spec:
        verify = sum(r.spec_verify_ct or 0 for r in results)
        accepted = sum(r.spec_accepted_tokens for r in results)
        out["spec_verify_ct"] = verify
        out["spec_accept_length"] = (verify + accepted) / verify if verify else 0.0
    return out


class Logprobs:
    """OpenAI logprob objects from token ids and (top) logprobs."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    def text(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False)

    def chat(self, ids: list[int], lps: list[float], tops: list[tuple[list[int], list[float]]]) -> dict:
        content = []
        for k, (tid, lp) in enumerate(zip(ids, lps)):
            s = self.text(tid)
            entry = {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
            if k < len(tops):
                tids, tlps = tops[k]
                entry["top_logprobs"] = [{"token": (t := self.text(i)), "logprob": v, "bytes": list(t.encode("utf-8"))}
                                         for i, v in zip(tids, tlps)]
            content.append(entry)
        return {"content": content}

    def completion(self, ids: list[int], lps: list[float], tops: list[tuple[list[int], list[float]]],
                   offset: int) -> dict:
        tokens = [self.text(t) for t in ids]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        top = None
        if tops:
            top = [{self.text(i): v for i, v in zip(tids, tlps)} for tids, tlps in tops]
        return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}

    def echoed(self, prompt: list[tuple[float | None, int]], tops: list | None, generated: dict) -> dict:
        """``generated`` (a :meth:`completion` object) preceded by the echoed prompt's
        tokens: their logprobs (None for the first), tops (None for the first) and offsets
        into the echoed text (where each token's text starts in its decoding)."""
        ids = [t for _, t in prompt]
        detok = IncrementalDetokenizer(self.tok, skip_special_tokens=False)
        offsets = []
        for t in ids:
            offsets.append(len(detok.text))
            detok.add([t])
        top = generated["top_logprobs"]
        if tops is not None or top is not None:
            head = [None if e is None else {self.text(i): v for i, v in zip(*e)} for e in tops or [None] * len(ids)]
            top = head + (top or [None] * len(generated["tokens"]))
        return {"tokens": [self.text(t) for t in ids] + generated["tokens"],
                "token_logprobs": [lp for lp, _ in prompt] + generated["token_logprobs"],
                "top_logprobs": top, "text_offset": offsets + generated["text_offset"]}


# ------------------------------------------------------------------- app


def add_openai_routes(app: FastAPI, state: ServerState, logprobs: Logprobs) -> None:
    """Register the OpenAI routes on ``app``."""
    # -------------------------------------------------------- OpenAI: chat
    def check_batch(n: int, param: str = "n") -> None:
        check_n(n, state.http.max_batch_prompts, param)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_request(request, state, ChatCompletionRequest)
        gen = await state.accepting()
        lora = state.check_model(body.model) or body.lora_of()  # `model` may name a LoRA adapter
        body.check(reserved=set(getattr(state.tokenizer, "special_tokens_map", None) or {}))
        check_batch(body.n)
        tools = state.tool_calling(body)  # tools, tool_choice, --tool-call-parser
        text = await state.offload(chat_size(body), chat_prompt_text, state.tokenizer, body, tools)
        gen.check_text_length(text, "messages")
        ids = (await state.offload(len(text), encode_texts, state.tokenizer, [text], False))[0]
        max_req = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        params = body.sampling_params()
        tools.update_params(params)  # tool_choice required / named: a JSON-schema constraint
        params["max_new_tokens"] = gen.resolve_max_tokens(len(ids), max_req, "messages", max_name)
        if body.logprobs:
            params["return_logprob"] = True
            params["top_logprobs_num"] = body.top_logprobs or 0
        elif body.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        gen.check_params(params, dict(OPENAI_NAMES, max_new_tokens=max_name, **constraint_names(body)))
        rid = body.rid or new_id("chatcmpl")
        specs = gen.expand(rid, ids, params, body.n, body.priority, body.cache_namespace())
        for spec in specs:
            spec.bootstrap = body.bootstrap_for(body.n)  # prefill-decode disaggregation: SGLang's router adds it
            spec.lora_path = lora
        names = request_names([(rid, specs)])
        base = {"id": rid, "created": int(time.time()), "model": (lora and body.model) or state.model_name}
        # --reasoning-parser: <think>...</think> goes to reasoning_content, first; later stages see content only
        reasoning = chat_reasoning(state.reasoning, body, ids)

        def choice(i: int, r: SeqResult) -> dict[str, Any]:
            message = reasoning.message(r.text) if reasoning else {"role": "assistant", "content": r.text}
            message, finish = tools.message(message, finish_reason_str(r.finish_reason))  # after the reasoning split
            return {"index": i, "message": message,
                    "logprobs": logprobs.chat(r.ids, r.logprobs, r.top_logprobs) if body.logprobs else None,
                    "finish_reason": finish}

        return await _respond(request, gen, body, specs, names, base, "chat.completion", choice,
                              lambda ds, inc: _chat_chunks(ds, base, body, inc, logprobs, specs, reasoning, tools))

    async def _respond(request, gen, body, specs, names, base, obj: str, choice, chunks):
        """Stream ``chunks(deltas, include_usage)``, or collect and answer ``choice(i, result)``s."""
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await start_stream(request, gen.run(specs, names), lambda ds: chunks(ds, include_usage))
        results = await until_done_or_gone(request, gen.collect(specs, names))
        choices = [choice(i, r) for i, r in enumerate(results)]
        if body.return_hidden_states:  # SGLang: the last output token's final hidden state
            for c, r in zip(choices, results):
                c["hidden_states"] = r.hidden_states[-1] if r.hidden_states and len(r.hidden_states) > 1 else []
        return {**base, "object": obj, "choices": choices, "usage": usage(results, body.n, state.speculative)}

    async def _chat_chunks(deltas, base, body, include_usage, lp: Logprobs, specs,
                           reasoning=None, tools: ToolCalling | None = None) -> AsyncIterator[str]:
        chunk = {**base, "object": "chat.completion.chunk"}
        results = [SeqResult(s.rid) for s in specs]
        split = StreamSplit(reasoning, len(specs))
        calls = ChoiceStreams(tools, len(specs)) if tools else None  # tool calls, parsed from content
        for i in range(len(specs)):
            yield sse({**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        async for d in deltas:
            results[d.index].add(d)
            thought, text = split.parts(d.index, d.text, d.finished)  # the reasoning split runs first
            if d.text or d.ids or d.finished:
                delta = {"reasoning_content": thought} if thought else {}
                if text:
                    delta["content"] = text
                finish = finish_reason_str(d.finish_reason) if d.finished else None
                parts, finish = calls.deltas(d.index, delta, d.finished, finish) if calls else ([delta], finish)
                for k, part in enumerate(parts):  # logprobs with the first, the finish reason with the last
                    choice = {"index": d.index, "delta": part,
                              "logprobs": lp.chat(d.ids, d.logprobs, d.top_logprobs) if body.logprobs and k == 0
                              else None, "finish_reason": finish if k == len(parts) - 1 else None}
                    yield sse({**chunk, "choices": [choice]})
        if include_usage:
            yield sse({**chunk, "choices": [], "usage": usage(results, body.n, state.speculative)})

    # -------------------------------------------------- OpenAI: completions
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_request(request, state, CompletionRequest)
        gen = await state.accepting()
        lora = state.check_model(body.model)  # `model` may name a LoRA adapter
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of must equal n (or be omitted)", param="best_of")
        body.check_max_tokens()
        prompt = body.prompt
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        many = isinstance(prompt, list) and not isinstance(prompt[0], int)
        count = len(prompt) if many else 1
        limit = state.http.max_batch_prompts
        if count > limit:
            raise APIError(400, f"prompt has {count} prompts, over this server's limit of {limit} "
                           "(--max-batch-prompts)", param="prompt")
        check_batch(body.n)
        if count * body.n > limit:
            raise APIError(400, f"{count} prompts x n {body.n} is {count * body.n} completions, over this "
                           f"server's limit of {limit} (--max-batch-prompts)", param="n")
        if isinstance(prompt, str):
            prompts = await tokenize(state, gen, [prompt], ["prompt"])
        elif not many:
            prompts = [gen.check_ids(prompt, "prompt")]
        elif isinstance(prompt[0], list):
            prompts = [gen.check_ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        else:
            prompts = await tokenize(state, gen, prompt, [f"prompt[{i}]" for i in range(len(prompt))])
        base_params = body.sampling_params()
        if body.logprobs is not None:
            base_params["return_logprob"] = True
            base_params["top_logprobs_num"] = body.logprobs
            if body.echo:  # the echoed prompt's tokens get logprobs too
                base_params["logprob_start_len"] = 0
        rid = body.rid or new_id("cmpl")
        groups: list[tuple[str, list[SeqSpec]]] = []
        for k, ids in enumerate(prompts):
            params = dict(base_params, max_new_tokens=gen.resolve_max_tokens(len(ids), body.max_tokens, "prompt"))
            gen.check_params(params, dict(OPENAI_NAMES, top_logprobs_num="logprobs", **constraint_names(body)))
            prompt_rid = f"{rid}-p{k}" if len(prompts) > 1 else rid
            group = gen.expand(prompt_rid, ids, params, body.n, body.priority, body.cache_namespace(k))
            for spec in group:
                spec.bootstrap = body.bootstrap_for(body.n, k)
                spec.lora_path = lora or body.lora_of(k)
            groups.append((prompt_rid, group))
        specs = [s for _, g in groups for s in g]
        names = request_names(groups, rid)
        echo = [state.tokenizer.decode(ids, skip_special_tokens=False) if body.echo else "" for ids in prompts]
        base = {"id": rid, "created": int(time.time()), "model": (lora and body.model) or state.model_name}

        def choice(i: int, r: SeqResult) -> dict[str, Any]:
            prefix = echo[i // body.n]
            lp = None
            if body.logprobs is not None:
                lp = logprobs.completion(r.ids, r.logprobs, r.top_logprobs, len(prefix))
                if r.input_token_logprobs is not None:
                    lp = logprobs.echoed(r.input_token_logprobs, r.input_top_logprobs, lp)
            return {"index": i, "text": prefix + r.text, "logprobs": lp,
                    "finish_reason": finish_reason_str(r.finish_reason)}

        return await _respond(request, gen, body, specs, names, base, "text_completion", choice,
                              lambda ds, inc: _completion_chunks(ds, base, body, inc, echo, specs))

    async def _completion_chunks(deltas, base, body, include_usage, echo, specs) -> AsyncIterator[str]:
        chunk = {**base, "object": "text_completion"}
        results = [SeqResult(s.rid) for s in specs]
        sent_echo = set()
        async for d in deltas:
            r = results[d.index]
            prefix = ""
            if d.index not in sent_echo:
                sent_echo.add(d.index)
                prefix = echo[d.index // body.n]
            offset = len(prefix) + len(r.text)
            r.add(d)
            if d.text or d.ids or d.finished or prefix:
                lp = None
                if body.logprobs is not None:
                    lp = logprobs.completion(d.ids, d.logprobs, d.top_logprobs, offset)
                    if d.input_token_logprobs is not None:  # with the first chunk, as the echoed prompt
                        lp = logprobs.echoed(d.input_token_logprobs, d.input_top_logprobs, lp)
                yield sse({**chunk, "choices": [{
                    "index": d.index, "text": prefix + d.text, "logprobs": lp,
                    "finish_reason": finish_reason_str(d.finish_reason) if d.finished else None}]})
        if include_usage:
            yield sse({**chunk, "choices": [], "usage": usage(results, body.n, state.speculative)})

    @app.get("/v1/models")
    async def models():
        info = state.client.info or {}
        base = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "radixserve",
                "root": state.engine_args.get("model") or state.model_name, "max_model_len": info.get("context_length")}
        adapters = [{**base, "id": name, "root": path, "parent": state.model_name}  # LoRA adapters, by name
                    for name, path in state.lora_adapters.items()]
        return {"object": "list", "data": [base, *adapters]}

    # ------------------------------------------------------- operations

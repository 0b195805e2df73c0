"""The FastAPI application: OpenAI-compatible and SGLang-native endpoints.

Handlers never wait on a forward pass: they hand token ids to the engine process and
await its updates. A client that disconnects (before its first token or mid-stream)
aborts its sequences in the engine. Nor do they wait on big CPU work: parsing a large
body, chat-templating and tokenising run on a small pool of worker threads (started once,
so the process's thread count stays constant), and a text too long for the context is
refused before it is tokenised, so ``/health`` answers at once while a 30 MB body is
processed.

Limits: ``--max-payload-size`` (413), ``--max-batch-prompts`` (prompts, ``n`` and
prompts x ``n`` of one request; 400 naming the field) and the engine's
``--max-queued-requests`` (429 with ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve_server.chat import chat_prompt_text, chat_size
from radixserve_server.detokenizer import IncrementalDetokenizer
from radixserve_server.engine_client import EngineClient
from radixserve_server.generation import (
    OPENAI_NAMES,
    Generator,
    SeqResult,
    SeqSpec,
    finish_reason_str,
    request_names,
)
from radixserve_server.http_args import HTTPArgs
from radixserve_server.http_io import (
    ClientGone,
    JsonProcess,
    WorkPool,
    check_n,
    encode_texts,
    new_id,
    read_json,
    read_request,
    sse,
    start_stream,
    tokenize,
    until_done_or_gone,
)
from radixserve_server.metrics import Metrics
from radixserve_server.native import add_native_routes
from radixserve_server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
)
from radixserve_server.reasoning import StreamSplit, chat_reasoning
from radixserve_server.sessions import Sessions
from radixserve_server.tokenizer_api import add_tokenizer_routes
from radixserve_server.tool_calling import ChoiceStreams, ToolCalling
from radixserve_server.worker_api import add_worker_routes

logger = logging.getLogger(__name__)
request_log = logging.getLogger("radixserve.requests")

OPEN_PATHS = {"/health", "/health_generate", "/metrics"}  # no API key needed
HEALTH_TIMEOUT = 60.0
INLINE_LIMIT = 8192  # bodies (bytes) and texts (characters) this small are handled on the loop


class ServerState:
    """What every handler needs; ``status`` is starting, ready, draining or failed."""

    def __init__(self, client: EngineClient, tokenizer, http: HTTPArgs, model_name: str,
                 engine_args: dict[str, Any]) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.http = http
        self.model_name = model_name
        self.engine_args = engine_args
        self.metrics = Metrics(model_name)
        self.status = "starting"
        self.generator: Generator | None = None
        self.created = int(time.time())
        self.pool = WorkPool()
        self.json_process = JsonProcess()
        self.reasoning = None  # radixserve.reasoning.ReasoningSpec of --reasoning-parser (set by launch)
        self._backends: dict[str, Any] | None = None
        self.sessions = Sessions()
        self._ready = asyncio.Event()
        client.on_update = None

    def tool_calling(self, body: ChatCompletionRequest) -> ToolCalling:
        """A chat request's tool calling under this server's --tool-call-* flags."""
        return ToolCalling(body, self.http.tool_call_parser, self.http.tool_call_max_string_length)

    async def offload(self, size: int, fn, *args):
        """``fn(*args)`` on the work pool when ``size`` (bytes or characters) is big, else here."""
        if size <= INLINE_LIMIT:
            return fn(*args)
        return await self.pool.run(fn, *args)

    def mark_ready(self) -> None:
        self.generator = Generator(self.client, self.tokenizer, self.metrics, self.client.info)
        self.status = "ready"
        self._ready.set()

    def mark_failed(self) -> None:
        self.status = "failed"
        self._ready.set()

    async def accepting(self) -> Generator:
        """The generator, once the engine is up; 503 while draining or after a failure."""
        if self.status == "starting":
            await self._ready.wait()
        if self.status == "draining":
            raise APIError(503, "the server is shutting down")
        if self.status != "ready" or self.generator is None or not self.client.alive:
            raise APIError(503, f"the engine is not running: {self.client.error or self.status}")
        return self.generator

    def not_ready_reason(self) -> str:
        failure = self.client.failure  # also right after a death the reader has not reported yet
        if failure:
            return failure
        if self.status == "starting":
            return "the engine is loading the model"
        if self.status == "draining":
            return "the server is shutting down"
        return f"the engine is not running ({self.status})"

    @property
    def speculative(self) -> bool:
        """Whether the engine decodes speculatively (``--speculative-algorithm``)."""
        return bool((self.client.info or {}).get("speculative_algorithm"))

    def resolved_backends(self) -> dict[str, Any]:
        """The backends the engine runs with, where the flags left the choice to it: the
        attention backend of each phase, and the grammar backend (``"none"`` when structured
        output is off). Resolved the way the engine resolves them, from the same registry."""
        if self._backends is None:
            info = self.client.info or {}
            prefill, decode = info.get("prefill_attention_backend"), info.get("decode_attention_backend")
            self._backends = {
                "prefill_attention_backend": prefill, "decode_attention_backend": decode,
                "attention_backend": prefill if prefill == decode else self.engine_args.get("attention_backend"),
                "grammar_backend": info.get("grammar_backend")}
        return self._backends

    def check_dp_rank(self, rank: int | None) -> int | None:
        """SGLang's ``routed_dp_rank``: a replica of ``--dp-size`` (0 when there is one)."""
        if rank is None:
            return None
        size = self.engine_args.get("dp_size") or 1
        if not 0 <= rank < size:
            raise APIError(400, f"routed_dp_rank must be in [0, {size}) (--dp-size {size}), got {rank}",
                           param="routed_dp_rank")
        return rank

    def log_request(self, route: str, specs: list[SeqSpec], texts: list[str] | None = None) -> None:
        """``--log-requests``: one line per request; ``--log-requests-level`` 1 adds the sampling
        parameters, 2 the first 256 characters of the prompt, 3 all of it."""
        level = self.http.log_requests_level
        parts = [f"{route} rid={specs[0].rid} sequences={len(specs)} prompt_tokens={len(specs[0].input_ids)}"]
        if level >= 1:
            parts.append(f"sampling_params={specs[0].params}")
        if level >= 2 and texts:
            text = texts[0] if level >= 3 else texts[0][:256]
            parts.append(f"text={text!r}")
        request_log.info(" ".join(parts))

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.engine_args.get("model")):
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")


# ---------------------------------------------------------------- helpers

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
def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    logprobs = Logprobs(state.tokenizer)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        message = str(e.detail)
        if e.status_code == 404:  # no such route
            message = f"no route {request.method} {request.url.path} on this server"
        elif e.status_code == 405:
            message = f"{request.url.path} does not take {request.method}"
        return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone):
        logger.info("client disconnected before the response; its request is aborted")
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        logger.exception("internal error on %s", request.url.path)
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}").body(), status_code=500)

    # -------------------------------------------------------- OpenAI: chat
    def check_batch(n: int, param: str = "n") -> None:
        check_n(n, state.http.max_batch_prompts, param)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_request(request, state, ChatCompletionRequest)
        gen = await state.accepting()
        state.check_model(body.model)
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
        gen.check_params(params, dict(OPENAI_NAMES, max_new_tokens=max_name))
        rid = body.rid or new_id("chatcmpl")
        specs = gen.expand(rid, ids, params, body.n, body.priority)
        names = request_names([(rid, specs)])
        base = {"id": rid, "created": int(time.time()), "model": state.model_name}
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
        state.check_model(body.model)
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
            gen.check_params(params, dict(OPENAI_NAMES, top_logprobs_num="logprobs"))
            prompt_rid = f"{rid}-p{k}" if len(prompts) > 1 else rid
            groups.append((prompt_rid, gen.expand(prompt_rid, ids, params, body.n, body.priority)))
        specs = [s for _, g in groups for s in g]
        names = request_names(groups, rid)
        echo = [state.tokenizer.decode(ids, skip_special_tokens=False) if body.echo else "" for ids in prompts]
        base = {"id": rid, "created": int(time.time()), "model": state.model_name}

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
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "radixserve",
            "root": state.engine_args.get("model") or state.model_name,
            "max_model_len": info.get("context_length")}]}

    # ------------------------------------------------------- operations
    @app.get("/health")
    async def health():
        if state.status != "ready" or not state.client.alive:
            return JSONResponse({"status": "failed" if state.client.failure else state.status,
                                 "reason": state.not_ready_reason()}, status_code=503)
        return {"status": "ok"}

    @app.get("/health_generate")
    async def health_generate():
        if state.status != "ready" or not state.client.alive:
            return JSONResponse({"status": "failed" if state.client.failure else state.status,
                                 "reason": state.not_ready_reason()}, status_code=503)
        gen = state.generator
        token = state.tokenizer.hf.bos_token_id
        specs = [SeqSpec(new_id("health"), [token if token is not None else 0],
                         {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True})
                 for _ in range(state.engine_args.get("dp_size") or 1)]
        if len(specs) > 1:  # --dp-size: one probe per replica
            for i, spec in enumerate(specs):
                state.client.pin(spec.rid, i)
        try:  # a probe: not counted as traffic in /metrics, not aborted by abort_all
            results = await asyncio.wait_for(gen.collect(specs, probe=True), HEALTH_TIMEOUT)
        except (APIError, asyncio.TimeoutError) as e:
            return JSONResponse({"status": "unhealthy", "reason": str(e) or type(e).__name__}, status_code=503)
        if any(len(r.ids) != 1 for r in results):
            return JSONResponse({"status": "unhealthy", "reason": "no token generated"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        if state.status == "ready" and state.client.alive:
            try:
                stats = await state.client.call("get_stats", timeout=5.0)
                if isinstance(stats, dict) and "error" not in stats:
                    state.metrics.set_engine_stats(stats)
            except (asyncio.TimeoutError, RuntimeError):
                pass
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/flush_cache")
    @app.get("/flush_cache")
    async def flush_cache():
        await state.accepting()
        ok = await state.client.call("flush_cache", timeout=30.0)
        if not ok:
            raise APIError(400, "cannot flush the cache while requests are running; retry when idle",
                           code="busy")
        return {"success": True, "message": "cache flushed"}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        """SGLang's abort: ``{"rid": ID}`` aborts the request whose id is exactly ID (with
        all its sequences: a rid given ``n`` or several prompts aborts every one);
        ``{"abort_all": true}`` aborts every running request."""
        data = await read_json(request, state)
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object with rid or abort_all")
        abort_all = data.get("abort_all", False)
        if not isinstance(abort_all, bool):
            raise APIError(400, "abort_all must be true or false", param="abort_all")
        rid = data.get("rid")
        gen = state.generator
        if abort_all:
            aborted = gen.abort_all() if gen is not None else []
            return {"success": True, "aborted": aborted}
        if not isinstance(rid, str) or not rid:
            raise APIError(400, "rid must be a request id string (or pass abort_all: true)", param="rid")
        aborted = gen.abort(rid) if gen is not None else []
        return {"success": bool(aborted), "aborted": aborted}

    async def expert_distribution(action: str) -> dict:
        await state.accepting()
        reply = await state.client.call(f"{action}_expert_distribution_record", timeout=60.0)
        if isinstance(reply, dict) and reply.get("bad_request"):
            raise APIError(400, reply["error"], code="no_moe_layers")
        if not isinstance(reply, dict) or "error" in reply:
            raise APIError(500, f"expert distribution {action} failed: {reply}")
        return reply

    @app.post("/start_expert_distribution_record")
    @app.get("/start_expert_distribution_record")
    async def start_expert_distribution_record():
        """MoE models: begin recording the expert load (see --expert-distribution-recorder-mode)."""
        await expert_distribution("start")
        return {"success": True, "message": "recording the expert distribution"}

    @app.post("/stop_expert_distribution_record")
    @app.get("/stop_expert_distribution_record")
    async def stop_expert_distribution_record():
        await expert_distribution("stop")
        return {"success": True, "message": "expert distribution recording stopped"}

    @app.post("/dump_expert_distribution_record")
    @app.get("/dump_expert_distribution_record")
    async def dump_expert_distribution_record():
        """Write the recording as JSON in --expert-distribution-recorder-dir; returns its path."""
        reply = await expert_distribution("dump")
        return {"success": True, "path": reply["path"]}

    @app.get("/debug/check_idle")
    async def check_idle():
        """The engine's leak invariant: null when every KV page is free or cached."""
        await state.accepting()
        return {"problem": await state.client.call("check_idle", timeout=30.0)}

    add_tokenizer_routes(app, state)  # /tokenize, /detokenize
    add_native_routes(app, state, logprobs.text)  # /generate
    add_worker_routes(app, state)  # /server_info, /model_info, /get_load, sessions, profiling
    return app


class Guard:
    """ASGI middleware: API key (constant-time compare) on everything but health and metrics."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.key is not None and scope["method"] != "OPTIONS" \
                and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            body = APIError(401, "invalid or missing API key (Authorization: Bearer KEY or x-api-key: KEY)",
                            code="invalid_api_key").body()
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization", b"")
        if given is None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        return given is not None and hmac.compare_digest(given, self.key)

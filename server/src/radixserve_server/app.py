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
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve_server.detokenizer import IncrementalDetokenizer
from radixserve_server.engine_client import EngineClient, post
from radixserve_server.generation import (
    OPENAI_NAMES,
    Delta,
    Generator,
    SeqResult,
    SeqSpec,
    finish_reason_str,
    request_names,
)
from radixserve_server.http_args import HTTPArgs
from radixserve_server.metrics import Metrics
from radixserve_server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    parse,
)
from radixserve_server.reasoning import StreamSplit, chat_reasoning
from radixserve_server.tokenizer_api import add_tokenizer_routes
from radixserve_server.tool_calling import ChoiceStreams, ToolCalling

logger = logging.getLogger(__name__)

OPEN_PATHS = {"/health", "/health_generate", "/metrics"}  # no API key needed
HEALTH_TIMEOUT = 60.0
INLINE_LIMIT = 8192  # bodies (bytes) and texts (characters) this small are handled on the loop
PREP_THREADS = 2  # worker threads for parsing, templating and tokenising big requests


class WorkPool:
    """A fixed set of daemon worker threads for CPU-heavy request preparation (JSON parsing,
    chat templates, tokenising), so the event loop keeps answering. All threads start at
    once: the process's thread count does not grow under load. Results reach the loop
    through :func:`post`, which tolerates a loop that has already closed."""

    def __init__(self, size: int = PREP_THREADS, name: str = "radixserve-prep") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(size)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, fut, fn, args = job
            try:
                value = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting handler
                post(loop, _settle, fut, None, e)
            else:
                post(loop, _settle, fut, value, None)

    async def run(self, fn, *args):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put((loop, fut, fn, args))
        return await fut

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


BIG_JSON_BYTES = 4 * 2**20  # bodies this big are parsed in a helper process


def _json_in_child(raw: bytes) -> tuple[bool, Any]:
    """(True, value) or (False, the parser's message): exceptions do not cross processes."""
    try:
        return True, json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return False, str(e)


class JsonProcess:
    """Parses very big JSON bodies in a helper process, started on first use.

    ``json.loads`` holds the interpreter lock for its whole run (tens of milliseconds for
    30 MB), which no thread can hide from the event loop; a process can. Sending the
    bytes and receiving the parsed value are single copies (a few milliseconds)."""

    def __init__(self) -> None:
        self._pool = None
        self._lock = threading.Lock()

    async def loads(self, raw: bytes) -> Any:
        with self._lock:
            if self._pool is None:
                import concurrent.futures
                import multiprocessing as mp

                self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
            pool = self._pool
        ok, value = await asyncio.wrap_future(pool.submit(_json_in_child, raw))
        if not ok:
            raise APIError(400, f"the request body is not valid JSON: {value}", code="invalid_json")
        return value

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _settle(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


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

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.engine_args.get("model")):
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")


# ---------------------------------------------------------------- helpers
async def read_body(request: Request, limit: int) -> bytes:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise APIError(413, f"the request body is {size} bytes, over the limit of {limit} "
                       "(--max-payload-size)", code="payload_too_large")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise APIError(413, f"the request body is over the limit of {limit} bytes (--max-payload-size)",
                           code="payload_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def decode_body(model: type, raw: bytes) -> Any:
    return parse(model, decode_json(raw))


async def read_json(request: Request, state: ServerState) -> Any:
    raw = await read_body(request, state.http.max_payload_size)
    if len(raw) > BIG_JSON_BYTES:
        return await state.json_process.loads(raw)
    return await state.offload(len(raw), decode_json, raw)


async def read_request(request: Request, state: ServerState, model: type) -> Any:
    """The body parsed and validated as ``model`` (on the work pool when it is big, the
    parsing in a helper process when it is very big)."""
    raw = await read_body(request, state.http.max_payload_size)
    if len(raw) > BIG_JSON_BYTES:
        data = await state.json_process.loads(raw)
        return await state.offload(len(raw), parse, model, data)
    return await state.offload(len(raw), decode_body, model, raw)


def encode_texts(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]


async def tokenize(state: ServerState, gen: Generator, texts: list[str], params: list[str]) -> list[list[int]]:
    """Token ids of ``texts``; a text too long for the context is refused before any is
    tokenised, and big ones are tokenised on the work pool."""
    for t, p in zip(texts, params):
        gen.check_text_length(t, p)
    ids = await state.offload(sum(len(t) for t in texts), encode_texts, state.tokenizer, texts)
    return [gen.check_ids(x, p) for x, p in zip(ids, params)]


def chat_size(body: ChatCompletionRequest) -> int:
    """The characters of a chat request's messages (whether to render it on the work pool)."""
    return sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content)
               for m in body.messages if m.content is not None)


def chat_prompt_text(tokenizer, body: ChatCompletionRequest, tools: ToolCalling) -> str:
    """The prompt text of a chat request, as /v1/chat/completions and /tokenize render it:
    flat messages, the tool round trip made renderable, then the chat template."""
    messages = tools.prepare_messages([m.flat(i) for i, m in enumerate(body.messages)],
                                      getattr(tokenizer, "chat_template", None))
    try:
        return render_chat(tokenizer, body, messages, dict(body.chat_template_kwargs or {}))
    except APIError:
        raise
    except ValueError as e:  # TemplateError: a template that raised or is missing
        raise APIError(400, str(e), param="messages") from None


CONTINUE_MARK = "\x00radixserve:continue\x00"


def render_chat(tokenizer, body: ChatCompletionRequest, messages: list[dict[str, Any]],
                kwargs: dict[str, Any]) -> str:
    """The prompt text. With ``continue_final_message`` the template renders without a
    generation prompt and the text is cut right after the final assistant message's
    content, so no end-of-turn token follows and the model continues that message."""
    final = messages[-1]["content"] if body.continue_final_message else None
    if final is not None and not final.strip():
        messages = messages[:-1] + [dict(messages[-1], content=CONTINUE_MARK)]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.generation_prompt,
                                         tools=body.tools, **kwargs)
    if final is None:
        return text
    if not final.strip():
        if CONTINUE_MARK not in text:
            raise APIError(400, "continue_final_message: the chat template does not render the final "
                           "message", param="continue_final_message")
        return text[:text.rindex(CONTINUE_MARK)] + final
    for piece in (final, final.strip()):
        if piece in text:
            return text[:text.rindex(piece) + len(piece)]
    raise APIError(400, "continue_final_message: the chat template does not render the final message's "
                   "content verbatim, so it cannot be continued", param="continue_final_message")


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    pass


async def until_done_or_gone(request: Request, awaitable: Awaitable) -> Any:
    """Await ``awaitable``, cancelling it (which aborts its sequences) if the client leaves."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()  # a no-op if it finished meanwhile: the callback retrieves its outcome
        task.add_done_callback(_consume)
        raise
    finally:
        watcher.cancel()
        watcher.add_done_callback(_consume)
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()


async def guarded(request: Request, agen: AsyncIterator) -> AsyncIterator:
    """Iterate ``agen`` until it ends or the client disconnects, then stop it, which aborts
    its sequences in the engine (at its next step). The disconnect is seen either by the
    watcher here or by the server cancelling this generator while ``agen`` runs inside
    ``nxt``; then ``nxt`` is cancelled (the cancellation ends ``agen`` from inside) instead
    of closing ``agen`` under it, which would fail ("aclose(): asynchronous generator is
    already running") and leave the request decoding."""
    watcher = asyncio.create_task(_wait_disconnect(request))
    nxt: asyncio.Future | None = None
    gone = False
    try:
        while True:
            nxt = asyncio.ensure_future(agen.__anext__())
            done, _ = await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                gone = True
                return
            step, nxt = nxt, None
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    except (asyncio.CancelledError, GeneratorExit):
        gone = True
        raise
    finally:
        watcher.cancel()
        watcher.add_done_callback(_consume)
        if gone:
            logger.info("client disconnected mid-stream; its request is aborted")
        if nxt is not None and not nxt.done():
            nxt.cancel()
            nxt.add_done_callback(_consume)
        else:
            # a step that finished while this generator was being cancelled (its end,
            # StopAsyncIteration, or an error) is retrieved here, or asyncio logs it as
            # "Task exception was never retrieved"
            if nxt is not None:
                _consume(nxt)
            await agen.aclose()


def _consume(task: asyncio.Future) -> None:
    """Retrieve a finished background task's outcome (no "exception never retrieved")."""
    if task.done() and not task.cancelled():
        task.exception()


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def sse_error(e: APIError) -> str:
    return sse(e.body())


async def start_stream(request: Request, deltas: AsyncIterator[Delta], render) -> Response:
    """Wait for the first delta (so a rejected request still gets a plain 4xx), then stream
    ``render(first_delta_stream)`` as server-sent events ending in ``[DONE]``."""
    try:
        first = await until_done_or_gone(request, deltas.__anext__())
    except StopAsyncIteration:
        first = None

    async def chained() -> AsyncIterator[Delta]:
        if first is not None:
            yield first
            async for d in deltas:
                yield d

    async def events() -> AsyncIterator[str]:
        inner = chained()
        rendered = render(inner)
        try:
            async for chunk in rendered:
                yield chunk
        except APIError as e:
            yield sse_error(e)
        finally:
            # close the chain now (not when collected), so the request's sequences are
            # aborted and its ids released as soon as the client goes
            for agen in (rendered, inner, deltas):
                await agen.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(guarded(request, events()), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


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
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
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
    def check_n(n: int, param: str = "n") -> None:
        limit = state.http.max_batch_prompts
        if n > limit:
            raise APIError(400, f"{param} is {n}, over this server's limit of {limit} (--max-batch-prompts)",
                           param=param)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_request(request, state, ChatCompletionRequest)
        gen = await state.accepting()
        state.check_model(body.model)
        body.check(reserved=set(getattr(state.tokenizer, "special_tokens_map", None) or {}))
        check_n(body.n)
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
        return {**base, "object": obj, "choices": [choice(i, r) for i, r in enumerate(results)],
                "usage": usage(results, body.n, state.speculative)}

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
        check_n(body.n)
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

    # ---------------------------------------------------- SGLang: /generate
    @app.post("/generate")
    async def generate(request: Request):
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
                check_n(n, "sampling_params.n")
                ns.append(n)
        if sum(ns) > limit:
            raise APIError(400, f"{count} prompts with n = {ns[0] if len(set(ns)) == 1 else ns} are "
                           f"{sum(ns)} sequences, over this server's limit of {limit} (--max-batch-prompts)",
                           param="sampling_params.n")
        if body.text is not None:
            prompts = await tokenize(state, gen, texts, ["text"] * count)
        else:
            prompts = [gen.check_ids(p, "input_ids") for p in raw]
        groups: list[tuple[str, list[SeqSpec]]] = []
        for k, (ids, p) in enumerate(zip(prompts, plist)):
            p = dict(p)
            if body.return_logprob is not None:
                p["return_logprob"] = body.return_logprob
            if body.top_logprobs_num is not None:
                p["top_logprobs_num"] = body.top_logprobs_num
            if body.logprob_start_len is not None:
                p["logprob_start_len"] = body.logprob_start_len
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
            groups.append((rid, gen.expand(rid, ids, p, n, body.priority)))
        specs = [s for _, g in groups for s in g]
        names = request_names(groups)
        if body.stream:
            if len(specs) != 1:
                raise APIError(400, "streaming /generate takes one prompt with n = 1", param="stream")
            return await start_stream(request, gen.run(specs, names), lambda ds: _native_chunks(ds, specs[0]))
        results = await until_done_or_gone(request, gen.collect(specs, names))
        outs = [_native_output(r) for r in results]
        return outs[0] if single and len(outs) == 1 else outs

    def _native_output(r: SeqResult) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": r.rid, "finish_reason": r.finish_reason, "prompt_tokens": r.prompt_tokens,
            "completion_tokens": len(r.ids), "cached_tokens": r.cached_tokens,
            "e2e_latency": (r.ended or time.perf_counter()) - r.started,
        }
        if state.speculative:
            meta["spec_verify_ct"] = r.spec_verify_ct or 0
            meta["spec_accept_length"] = r.spec_accept_length
        if r.logprobs:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs, r.ids)]
            if r.top_logprobs:
                meta["output_top_logprobs"] = [[[v, i, None] for i, v in zip(tids, tlps)]
                                               for tids, tlps in r.top_logprobs]
        if r.input_token_logprobs is not None:  # logprob_start_len >= 0: SGLang's prompt logprobs
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in r.input_token_logprobs]
            if r.input_top_logprobs is not None:
                meta["input_top_logprobs"] = [None if e is None else [[v, i, None] for i, v in zip(*e)]
                                              for e in r.input_top_logprobs]
        return {"text": r.text, "output_ids": r.ids, "meta_info": meta}

    async def _native_chunks(deltas, spec: SeqSpec) -> AsyncIterator[str]:
        r = SeqResult(spec.rid)
        async for d in deltas:
            r.add(d)
            out = _native_output(r)
            if not d.finished:
                out["meta_info"]["finish_reason"] = None
            yield sse(out)

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

    @app.get("/get_server_info")
    async def get_server_info():
        stats = None
        if state.status == "ready" and state.client.alive:
            try:
                stats = await state.client.call("get_stats", timeout=5.0)
            except (asyncio.TimeoutError, RuntimeError):
                stats = None
        http = asdict(state.http)
        http["api_key"] = "***" if http["api_key"] else None
        backends = state.resolved_backends()
        return {"status": state.status, "model": state.model_name,
                "server_args": {**state.engine_args, **backends},
                "http_args": http, "engine": state.client.info, "stats": stats,
                "in_flight": state.client.num_in_flight()}

    @app.get("/debug/check_idle")
    async def check_idle():
        """The engine's leak invariant: null when every KV page is free or cached."""
        await state.accepting()
        return {"problem": await state.client.call("check_idle", timeout=30.0)}

    add_tokenizer_routes(app, state)  # /tokenize, /detokenize, /get_model_info
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

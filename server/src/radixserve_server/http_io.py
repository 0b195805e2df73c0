"""The HTTP plumbing every route shares: reading and parsing bodies (big ones off the event
loop), tokenising prompts, streaming server-sent events, and noticing a client that left.

A fixed pool of worker threads (:class:`WorkPool`) and, for very big bodies, a helper
process (:class:`JsonProcess`) keep CPU-heavy preparation off the loop. A client that
disconnects (before its first token or mid-stream) has its sequences aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from radixserve_server import json_body
from radixserve_server.engine_client import post
from radixserve_server.generation import Delta, Generator
from radixserve_server.protocol import APIError, parse

logger = logging.getLogger("radixserve_server.app")

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
    """(True, value) or (False, why it was refused): exceptions do not cross processes."""
    try:
        return True, json_body.loads(raw)
    except json_body.BadJSON as e:
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
            raise APIError(400, value, code="invalid_json")
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



async def read_body(request: Request, limit: int) -> bytes:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise APIError(413, f"the request body is {size} bytes, over the limit of {limit} "
                       "(--max-payload-size)", code="payload_too_large")
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise APIError(413, f"the request body is over the limit of {limit} bytes (--max-payload-size)",
                               code="payload_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # it left, or --http-body-timeout closed its connection
        raise ClientGone() from None
    return b"".join(chunks)


def decode_json(raw: bytes) -> Any:
    try:
        return json_body.loads(raw)
    except json_body.BadJSON as e:
        raise APIError(400, str(e), code="invalid_json") from None


def decode_body(model: type, raw: bytes) -> Any:
    return parse(model, decode_json(raw))


async def read_json(request: Request, state) -> Any:
    raw = await read_body(request, state.http.max_payload_size)
    if len(raw) > BIG_JSON_BYTES:
        return await state.json_process.loads(raw)
    return await state.offload(len(raw), decode_json, raw)


async def read_request(request: Request, state, model: type) -> Any:
    """The body parsed and validated as ``model`` (on the work pool when it is big, the
    parsing in a helper process when it is very big)."""
    raw = await read_body(request, state.http.max_payload_size)
    if len(raw) > BIG_JSON_BYTES:
        data = await state.json_process.loads(raw)
        return await state.offload(len(raw), parse, model, data)
    return await state.offload(len(raw), decode_body, model, raw)


def encode_texts(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]


async def tokenize(state, gen: Generator, texts: list[str], params: list[str]) -> list[list[int]]:
    """Token ids of ``texts``; a text too long for the context is refused before any is
    tokenised, and big ones are tokenised on the work pool."""
    for t, p in zip(texts, params):
        gen.check_text_length(t, p)
    ids = await state.offload(sum(len(t) for t in texts), encode_texts, state.tokenizer, texts)
    return [gen.check_ids(x, p) for x, p in zip(ids, params)]



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


def check_n(n: int, limit: int, param: str = "n") -> None:
    """``n`` (or prompts x ``n``) against ``--max-batch-prompts``."""
    if n > limit:
        raise APIError(400, f"{param} is {n}, over this server's limit of {limit} (--max-batch-prompts)",
                       param=param)

"""``radixserve router``: one HTTP front for several ``radixserve serve`` workers.

Each generation request (``/v1/chat/completions``, ``/v1/completions``, ``/generate``,
streaming or not) goes to one healthy worker chosen by the routing policy from the
request's text (chat message contents, the prompt, or ``input_ids`` mapped one per
character) and the workers' loads (requests the router has in flight there); the
worker's answer is passed back as it comes.

Worker health (SGLang's router flags and meaning):

- Every ``--health-check-interval-secs`` each worker's ``/health`` is asked. A healthy
  worker failing ``--health-failure-threshold`` checks in a row is removed; a removed one
  answering ``--health-success-threshold`` checks in a row comes back (with an empty
  prefix tree: its cache is not what it was).
- A worker that cannot be reached for a request, drops a request's connection or
  answers one with 503 (it is draining, or its engine died) is checked at once and
  removed if that check fails too.
- A request that could not reach its worker (nothing was sent) is tried on another one.
  A request in flight on a worker that dies fails with 503 and an OpenAI-style error
  body (a stream that has started gets that body as an SSE error event, then
  ``[DONE]``); requests on the other workers go on. A removed worker gets no new requests.
- With no healthy worker, requests get 503 and ``/health`` answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from radixserve_server.router.args import RouterArgs
from radixserve_server.router.policy import make_policy
from radixserve_server.router.tree import ids_key

logger = logging.getLogger("radixserve.router")

PREFIX = "radixserve_router:"
FORWARDED_HEADERS = ("authorization", "x-api-key", "content-type", "accept")
RETURNED_HEADERS = ("content-type", "retry-after", "cache-control")
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
               502: "server_error", 503: "service_unavailable"}


def error_body(status: int, message: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": None,
                      "code": code}}


def error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status)


def sse_error(status: int, message: str) -> bytes:
    return f"data: {json.dumps(error_body(status, message))}\n\ndata: [DONE]\n\n".encode()


def routing_key(path: str, body: Any) -> str:
    """The text the policy routes on: what the worker's prefix cache would hold first."""
    if not isinstance(body, dict):
        return ""
    if path == "/v1/chat/completions":
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        return "\n".join(parts)
    prompt = body.get("prompt") if path == "/v1/completions" else body.get("text")
    if prompt is None and path == "/generate":
        prompt = body.get("input_ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch goes to one worker: route on its first prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and 0 <= t < 0x110000 for t in prompt):
        return ids_key(prompt)
    return ""


class Worker:
    """One ``radixserve serve`` instance as the router sees it."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.healthy = False
        self.seen = False  # answered a health check at least once
        self.load = 0  # requests in flight there
        self.num_requests = 0
        self.num_errors = 0
        self.failures = 0  # health checks failed in a row
        self.successes = 0  # health checks passed in a row
        self.reason: str | None = "not checked yet"

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "load": self.load, "num_requests": self.num_requests,
                "num_errors": self.num_errors, "reason": None if self.healthy else self.reason}


class NoWorker(Exception):
    pass


class Router:
    """The workers, their health and the policy; the app's handlers call :meth:`forward`."""

    def __init__(self, args: RouterArgs, transport: httpx.AsyncBaseTransport | None = None) -> None:
        if not args.worker_urls:
            raise ValueError("the router needs at least one worker URL (--worker-urls)")
        self.args = args
        self.workers: dict[str, Worker] = {}
        for url in args.worker_urls:
            w = Worker(url)
            self.workers.setdefault(w.url, w)
        self.policy = make_policy(args.policy)
        timeout = httpx.Timeout(args.request_timeout_secs, connect=min(5.0, args.request_timeout_secs))
        self.http = httpx.AsyncClient(timeout=timeout, transport=transport,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.metrics = RouterMetrics()
        self._health_task: asyncio.Task | None = None

    # -------------------------------------------------------------- workers
    def healthy(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy]

    def pick(self, key: str, exclude: set[str] = frozenset()) -> Worker:
        workers = [w for w in self.healthy() if w.url not in exclude]
        if not workers:
            raise NoWorker()
        i = self.policy.select([w.url for w in workers], [w.load for w in workers], key)
        return workers[i]

    def add(self, w: Worker) -> None:
        if not w.healthy:
            logger.warning("worker %s is %s", w.url, "back" if w.seen else "up")
        w.healthy, w.seen, w.reason, w.failures = True, True, None, 0

    def remove(self, w: Worker, reason: str) -> None:
        if w.healthy:
            logger.error("worker %s removed: %s", w.url, reason)
        w.healthy, w.reason, w.successes = False, reason, 0
        self.policy.remove_worker(w.url)

    async def probe(self, w: Worker) -> str | None:
        """None when ``w`` answers ``/health`` with 200, else why not."""
        try:
            r = await self.http.get(w.url + "/health", timeout=self.args.health_check_timeout_secs)
        except httpx.HTTPError as e:
            return f"health check failed: {type(e).__name__}: {e}".rstrip(": ")
        if r.status_code != 200:
            return f"health check answered {r.status_code}: {r.text[:200]}"
        return None

    async def check(self, w: Worker, at_once: bool = False) -> None:
        """One health check of ``w``, applying the thresholds (``at_once``: a single
        failure removes it, after a request could not be served there)."""
        problem = await self.probe(w)
        if problem is None:
            w.failures = 0
            w.successes += 1
            if not w.healthy and (not w.seen or w.successes >= self.args.health_success_threshold):
                self.add(w)
            return
        w.successes = 0
        w.failures += 1
        if w.healthy and (at_once or w.failures >= self.args.health_failure_threshold):
            self.remove(w, problem)
        elif not w.healthy:
            w.reason = problem

    async def wait_for_workers(self) -> None:
        """At start-up: check every worker until all are healthy or the start-up timeout passes."""
        deadline = time.monotonic() + self.args.worker_startup_timeout_secs
        while True:
            pending = [w for w in self.workers.values() if not w.healthy]
            if not pending:
                return
            await asyncio.gather(*(self.check(w) for w in pending))
            if all(w.healthy for w in self.workers.values()):
                return
            if time.monotonic() > deadline:
                for w in self.workers.values():
                    if not w.healthy:
                        logger.error("worker %s is not healthy after %.0f s (%s); it is added when it answers",
                                     w.url, self.args.worker_startup_timeout_secs, w.reason)
                return
            await asyncio.sleep(0.5)

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.args.health_check_interval_secs)
            await asyncio.gather(*(self.check(w) for w in self.workers.values()))

    async def start(self) -> None:
        await self.wait_for_workers()
        self._health_task = asyncio.create_task(self.health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self.http.aclose()

    # ------------------------------------------------------------- requests
    async def forward(self, request: Request, path: str, raw: bytes, key: str) -> Response:
        """Send the request to a worker and relay its answer (see the module docstring)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        tried: set[str] = set()
        while True:
            try:
                w = self.pick(key, tried)
            except NoWorker:
                why = "no healthy worker" if not tried else "no healthy worker could be reached"
                return error_response(503, f"{why} to serve this request")
            tried.add(w.url)
            w.load += 1
            w.num_requests += 1
            self.metrics.requests.labels(w.url).inc()
            try:
                upstream = await self.http.send(
                    self.http.build_request(request.method, w.url + path, content=raw, headers=headers),
                    stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # nothing reached the worker: try another
                w.load -= 1
                self._failed(w, e)
                await self.check(w, at_once=True)
                continue
            except httpx.HTTPError as e:
                w.load -= 1
                return await self._lost(w, e)
            if upstream.status_code == 503:  # draining, or its engine died: check it now, not in 3 intervals
                asyncio.ensure_future(self.check(w, at_once=True))
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                return StreamingResponse(self._relay(w, upstream), status_code=upstream.status_code,
                                         headers=self._returned(upstream))
            return await self._collect(request, w, upstream)

    def _returned(self, upstream: httpx.Response) -> dict[str, str]:
        return {k: v for k, v in upstream.headers.items() if k.lower() in RETURNED_HEADERS}

    def _failed(self, w: Worker, e: Exception) -> None:
        w.num_errors += 1
        self.metrics.errors.labels(w.url).inc()
        logger.warning("worker %s: %s: %s", w.url, type(e).__name__, e)

    async def _lost(self, w: Worker, e: Exception) -> JSONResponse:
        self._failed(w, e)
        await self.check(w, at_once=True)
        return error_response(503, f"the worker serving this request failed ({type(e).__name__}); "
                                   "retry the request")

    async def _collect(self, request: Request, w: Worker, upstream: httpx.Response) -> Response:
        """A whole (non-streamed) answer; the worker's request is dropped if the client leaves."""
        read = asyncio.ensure_future(upstream.aread())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({read, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                read.cancel()
                await asyncio.gather(read, return_exceptions=True)
                return Response(status_code=499)
            try:
                content = read.result()
            except httpx.HTTPError as e:
                return await self._lost(w, e)
            return Response(content, status_code=upstream.status_code, headers=self._returned(upstream))
        finally:
            gone.cancel()
            await upstream.aclose()  # closing drops the worker's connection: it aborts the request
            w.load -= 1

    async def _relay(self, w: Worker, upstream: httpx.Response):
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            self._failed(w, e)
            yield sse_error(503, f"the worker serving this request failed ({type(e).__name__}); retry the request")
            asyncio.ensure_future(self.check(w, at_once=True))
        finally:
            await upstream.aclose()
            w.load -= 1

    async def broadcast(self, method: str, path: str) -> dict[str, Any]:
        async def one(w: Worker):
            try:
                r = await self.http.request(method, w.url + path, timeout=self.args.health_check_timeout_secs * 6)
                return w.url, {"status_code": r.status_code, "body": _json_or_text(r)}
            except httpx.HTTPError as e:
                return w.url, {"status_code": None, "body": f"{type(e).__name__}: {e}"}

        return dict(await asyncio.gather(*(one(w) for w in self.healthy())))


def _json_or_text(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "requests", "Requests sent to a worker", ["worker"], registry=r)
        self.errors = Counter(PREFIX + "worker_errors", "Requests a worker could not take or dropped",
                              ["worker"], registry=r)
        self.healthy = Gauge(PREFIX + "worker_healthy", "1 while the worker takes requests", ["worker"], registry=r)
        self.load = Gauge(PREFIX + "worker_load", "Requests in flight on the worker", ["worker"], registry=r)
        self.tree = Gauge(PREFIX + "tree_size", "Characters the cache-aware policy remembers for the worker",
                          ["worker"], registry=r)

    def render(self, router: Router) -> bytes:
        for w in router.workers.values():
            self.healthy.labels(w.url).set(1.0 if w.healthy else 0.0)
            self.load.labels(w.url).set(float(w.load))
            self.tree.labels(w.url).set(float(router.policy.worker_stats(w.url).get("tree_size", 0)))
        return generate_latest(self.registry)


def create_router_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="radixserve router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.router = router

    async def generation(request: Request, path: str, routed: bool = True) -> Response:
        """Relay a POST body; ``routed`` bodies choose their worker by their prompt, the
        others (tokenizer endpoints) go wherever the policy sends an empty key."""
        size = request.headers.get("content-length")
        limit = router.args.max_payload_size
        if size is not None and size.isdigit() and int(size) > limit:
            return error_response(413, f"the request body is {size} bytes, over the limit of {limit}",
                                  code="payload_too_large")
        raw = await request.body()
        if len(raw) > limit:
            return error_response(413, f"the request body is over the limit of {limit} bytes",
                                  code="payload_too_large")
        if not routed:
            return await router.forward(request, path, raw, "")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None  # the worker answers the 400
        return await router.forward(request, path, raw, routing_key(path, body))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generation(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generation(request, "/v1/completions")

    @app.post("/generate")
    async def generate(request: Request):
        return await generation(request, "/generate")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await generation(request, "/tokenize", routed=False)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await generation(request, "/detokenize", routed=False)

    @app.get("/v1/models")
    async def models(request: Request):
        return await router.forward(request, "/v1/models", b"", "")

    @app.get("/get_model_info")
    async def get_model_info(request: Request):
        return await router.forward(request, "/get_model_info", b"", "")

    @app.get("/health")
    async def health():
        n = len(router.healthy())
        body = {"status": "ok" if n else "failed", "healthy_workers": n, "workers": len(router.workers)}
        return JSONResponse(body, status_code=200 if n else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(router), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/list_workers")
    async def list_workers():
        return {"workers": [{**w.describe(), **router.policy.worker_stats(w.url)} for w in router.workers.values()]}

    @app.get("/get_server_info")
    async def get_server_info():
        a = router.args
        return {"role": "router", "policy": vars(a.policy),
                "health_check_interval_secs": a.health_check_interval_secs,
                "health_failure_threshold": a.health_failure_threshold,
                "health_success_threshold": a.health_success_threshold,
                "workers": [w.describe() for w in router.workers.values()]}

    @app.post("/flush_cache")
    @app.get("/flush_cache")
    async def flush_cache():
        results = await router.broadcast("POST", "/flush_cache")
        for url, r in results.items():
            if r["status_code"] == 200:
                router.policy.remove_worker(url)
        ok = all(r["status_code"] == 200 for r in results.values())
        return JSONResponse({"success": ok, "workers": results}, status_code=200 if ok else 400)

    @app.post("/add_worker")
    async def add_worker(url: str):
        w = router.workers.setdefault(url.rstrip("/"), Worker(url))
        await router.check(w)
        return {"success": w.healthy, "worker": w.describe()}

    @app.post("/remove_worker")
    async def remove_worker(url: str):
        w = router.workers.pop(url.rstrip("/"), None)
        if w is None:
            return error_response(404, f"no worker {url}")
        router.remove(w, "removed by request")
        return {"success": True}

    return app

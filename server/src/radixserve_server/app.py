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

import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve_server.admin_api import add_admin_routes
from radixserve_server.http_args import ADMIN_PATHS, HTTPArgs
from radixserve_server.http_io import ClientGone
from radixserve_server.native import add_native_routes
from radixserve_server.openai_api import Logprobs, add_openai_routes, usage
from radixserve_server.protocol import APIError
from radixserve_server.state import INLINE_LIMIT, ServerState
from radixserve_server.tokenizer_api import add_tokenizer_routes
from radixserve_server.worker_api import add_worker_routes

__all__ = ["INLINE_LIMIT", "Guard", "HTTPArgs", "ServerState", "create_app", "usage"]

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})  # no API key needed


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    logprobs = Logprobs(state.tokenizer)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        if e.status in (400, 413):  # a bad request: one line, no traceback
            logger.warning("%s %s: %d %s", request.method, request.url.path, e.status, e.message[:300])
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
        e.radixserve_logged = True  # Guard keeps the server from logging it a second time
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}").body(), status_code=500)

    add_openai_routes(app, state, logprobs)  # /v1/chat/completions, /v1/completions, /v1/models
    add_admin_routes(app, state)  # health, metrics, flush_cache, abort_request, expert distribution
    add_tokenizer_routes(app, state)  # /tokenize, /detokenize
    add_native_routes(app, state, logprobs.text)  # /generate
    add_worker_routes(app, state)  # /server_info, /model_info, /get_load, sessions, profiling
    return app


class Guard:
    """ASGI middleware: the API keys (constant-time compares). ``/health`` and ``/metrics`` are
    open; ``/health_generate`` takes ``--api-key`` unless ``--health-generate-public``; the admin
    routes (:data:`ADMIN_PATHS`) take ``--admin-api-key`` when it is set (and only it, as SGLang
    does), else ``--api-key``; every other route takes ``--api-key``.

    It also keeps an internal error to one traceback: the app's handler logs it and answers
    500, after which Starlette raises it again for the server to log; that second one stops here."""

    def __init__(self, app, http: HTTPArgs) -> None:
        self.app = app
        self.key = http.api_key.encode() if http.api_key else None
        self.admin_key = http.admin_api_key.encode() if http.admin_api_key else None
        self.open_paths = OPEN_PATHS | ({"/health_generate"} if http.health_generate_public else set())

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"] not in self.open_paths:
            admin = scope["path"] in ADMIN_PATHS and self.admin_key is not None
            key = self.admin_key if admin else self.key
            if key is not None and not self._authorized(scope, key):
                which = "admin API key (--admin-api-key)" if admin else "API key"
                body = APIError(401, f"invalid or missing {which} (Authorization: Bearer KEY or x-api-key: KEY)",
                                code="invalid_api_key").body()
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        try:
            await self.app(scope, receive, send)
        except Exception as e:
            if not getattr(e, "radixserve_logged", False):
                raise

    @staticmethod
    def _authorized(scope, key: bytes) -> bool:
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization", b"")
        if given is None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        return given is not None and hmac.compare_digest(given, key)

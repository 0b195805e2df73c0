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
from radixserve_server.http_args import HTTPArgs
from radixserve_server.http_io import ClientGone
from radixserve_server.native import add_native_routes
from radixserve_server.openai_api import Logprobs, add_openai_routes, usage
from radixserve_server.protocol import APIError
from radixserve_server.state import INLINE_LIMIT, ServerState
from radixserve_server.tokenizer_api import add_tokenizer_routes
from radixserve_server.worker_api import add_worker_routes

__all__ = ["INLINE_LIMIT", "Guard", "HTTPArgs", "ServerState", "create_app", "usage"]

logger = logging.getLogger(__name__)

OPEN_PATHS = {"/health", "/health_generate", "/metrics"}  # no API key needed


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

    add_openai_routes(app, state, logprobs)  # /v1/chat/completions, /v1/completions, /v1/models
    add_admin_routes(app, state)  # health, metrics, flush_cache, abort_request, expert distribution
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

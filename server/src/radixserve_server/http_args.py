"""The HTTP server's settings, apart from the app so that parsing ``serve`` flags imports no web
stack (``radixserve plugins`` or a bad flag answers without loading FastAPI).

Keys: ``--api-key`` guards every route but ``/health`` and ``/metrics`` (``/health_generate``
too unless ``--health-generate-public``); ``--admin-api-key`` guards the admin routes
(:data:`ADMIN_PATHS`) instead of it. Each key is taken from its flag, else from the file its
``-file`` flag names, else from its environment variable (``RADIXSERVE_API_KEY``,
``RADIXSERVE_ADMIN_API_KEY``), so it need not appear on a command line that ``ps`` shows."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from radixserve.config import ConfigError
from radixserve.secrets import read_key_file

API_KEY_ENV = "RADIXSERVE_API_KEY"
ADMIN_API_KEY_ENV = "RADIXSERVE_ADMIN_API_KEY"
# routes that change the server's state for everyone: --admin-api-key when it is set
ADMIN_PATHS = frozenset({
    "/flush_cache", "/abort_request", "/start_profile", "/stop_profile",
    "/start_expert_distribution_record", "/stop_expert_distribution_record", "/dump_expert_distribution_record",
    "/load_lora_adapter", "/unload_lora_adapter",
})


@dataclass
class HTTPArgs:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    admin_api_key: str | None = None  # --admin-api-key: the admin routes take this key (and only it)
    health_generate_public: bool = False  # --health-generate-public: /health_generate without a key
    cors_origins: list[str] = field(default_factory=list)
    max_payload_size: int = 32 * 2**20
    http_header_timeout: float = 20.0  # --http-header-timeout: seconds to receive a request's headers
    http_body_timeout: float = 60.0  # --http-body-timeout: seconds to receive a request's body
    timeout_keep_alive: float = 5.0  # --timeout-keep-alive: an idle kept-alive connection closes after it
    max_connections: int = 2048  # --max-connections: more open connections get 503
    shutdown_timeout: float = 30.0
    served_model_name: str | None = None
    max_batch_prompts: int = 128  # most prompts, n, and prompts x n in one request
    tool_call_parser: str | None = None  # --tool-call-parser: the format tool_choice auto parses
    tool_call_max_string_length: int = 512  # --tool-call-max-string-length (required / named)
    log_requests: bool = False  # --log-requests: one log line per generation request
    log_requests_level: int = 2  # --log-requests-level 0-3: how much of each request is logged


def add_hardening_arguments(http: argparse._ArgumentGroup) -> None:
    """The key files, the admin key and the connection limits (the ``http`` group's other flags
    are in :mod:`radixserve_server.launch`)."""
    http.add_argument("--api-key-file", default=None, metavar="PATH",
                      help=f"read --api-key from this file (its first line), so the key is not on the command "
                           f"line; without either, the environment variable {API_KEY_ENV} gives it")
    http.add_argument("--admin-api-key", default=None,
                      help="require this key (and not --api-key) on the admin routes: " + ", ".join(
                          sorted(ADMIN_PATHS)) + f"; also --admin-api-key-file or {ADMIN_API_KEY_ENV}")
    http.add_argument("--admin-api-key-file", default=None, metavar="PATH", help="read --admin-api-key from this file")
    http.add_argument("--health-generate-public", action="store_true",
                      help="answer /health_generate (it runs a one-token generation) without the API key")
    http.add_argument("--http-header-timeout", type=float, default=20.0,
                      help="close a connection whose request headers have not all arrived this many seconds "
                           "after it opened or after its previous response (0: no limit; default 20)")
    http.add_argument("--http-body-timeout", type=float, default=60.0,
                      help="close a connection whose request body has not all arrived this many seconds after "
                           "its headers (0: no limit; default 60)")
    http.add_argument("--timeout-keep-alive", type=float, default=5.0,
                      help="close a kept-alive connection idle this many seconds after a response (default 5)")
    http.add_argument("--max-connections", type=int, default=2048,
                      help="most open connections; a request arriving above it gets 503 (0: no limit; "
                           "default 2048)")


def resolve_key(value: str | None, path: str | None, env: str, flag: str) -> str | None:
    """A key from its flag, else from its ``-file`` flag's file, else from ``env`` (None: no key).
    Giving both the flag and the file is an error."""
    if value is not None and path is not None:
        raise ConfigError(f"give {flag} or {flag}-file, not both")
    if value is not None:
        if not value.strip():
            raise ConfigError(f"{flag} must not be empty")
        return value
    if path is not None:
        return read_key_file(path, f"{flag}-file")
    return os.environ.get(env) or None


def apply_hardening(ns: argparse.Namespace, args: HTTPArgs) -> HTTPArgs:
    """Fill ``args``'s keys and limits from the flags of :func:`add_hardening_arguments`."""
    args.api_key = resolve_key(ns.api_key, ns.api_key_file, API_KEY_ENV, "--api-key")
    args.admin_api_key = resolve_key(ns.admin_api_key, ns.admin_api_key_file, ADMIN_API_KEY_ENV, "--admin-api-key")
    args.health_generate_public = ns.health_generate_public
    for name in ("http_header_timeout", "http_body_timeout", "timeout_keep_alive", "max_connections"):
        value = getattr(ns, name)
        if value < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        setattr(args, name, value)
    return args

"""The HTTP server's settings, apart from the app so that parsing ``serve`` flags imports no web
stack (``radixserve plugins`` or a bad flag answers without loading FastAPI)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HTTPArgs:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)
    max_payload_size: int = 32 * 2**20
    shutdown_timeout: float = 30.0
    served_model_name: str | None = None
    max_batch_prompts: int = 128  # most prompts, n, and prompts x n in one request
    tool_call_parser: str | None = None  # --tool-call-parser: the format tool_choice auto parses
    tool_call_max_string_length: int = 512  # --tool-call-max-string-length (required / named)
    log_requests: bool = False  # --log-requests: one log line per generation request
    log_requests_level: int = 2  # --log-requests-level 0-3: how much of each request is logged

"""The server's one error type: answered with OpenAI's error body."""

from __future__ import annotations

from typing import Any

RETRY_AFTER_S = 1  # the Retry-After of a 429: the queue moves within a scheduler step or two


class APIError(Exception):
    """An error answered with an OpenAI-style body (and, for a 429, a ``Retry-After`` header).

    ``code`` is OpenAI's: a short string (``"context_length_exceeded"``,
    ``"rate_limit_exceeded"``, ...) or None, never the HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "requests", 500: "server_error", 503: "service_unavailable"}
    CODES = {429: "rate_limit_exceeded"}  # the code when none is given

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        code = code if code is not None else self.CODES.get(status)
        self.code = None if code is None else str(code)
        self.type = type or self.TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = dict(headers or {})
        if status == 429:
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_finish_reason(reason: dict[str, Any]) -> APIError:
    """The error of a request the engine ended with a ``status_code`` (400: rejected,
    429: the queue was full, 500: failed while serving, 503: the engine stopped)."""
    status = reason.get("status_code")
    status = status if isinstance(status, int) and 400 <= status <= 599 else 500
    default = "the request failed in the engine" if status >= 500 else "the request was rejected"
    return APIError(status, reason.get("message") or default, param=reason.get("param"))

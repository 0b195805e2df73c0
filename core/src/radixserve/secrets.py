"""Keeping credentials out of what the server shows and logs.

``redact_url`` hides the user and password of every ``scheme://user:pass@host`` in a string;
``redact_args`` does that to every string of an argument mapping and hides the whole value of
every argument whose name says it is a secret (``*api_key*``, ``*secret*``, ``*password*``,
``*credential*``, ``token`` and ``*_token``: not ``token_usage`` or ``max_new_tokens``)."""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"
# the user-info part of a URL: everything between "://" and the last "@" before the host
_USERINFO = re.compile(r"(://)[^/\s\"'@]*(?:@[^/\s\"'@]*)*@")
_SECRET_NAME = re.compile(r"api_key|secret|passw(or)?d|credential|(^|_)token$", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with the user and password of each ``scheme://user:pass@host`` in it replaced by
    ``***`` (``redis://***@host:6379/0``); a string without credentials comes back unchanged."""
    return _USERINFO.sub(r"\1" + REDACTED + "@", url)


def is_secret_name(name: str) -> bool:
    """Whether an argument named ``name`` (``api_key``, ``--admin-api-key``, ``hf_token``, ...) holds
    a secret."""
    return bool(_SECRET_NAME.search(name.lstrip("-").replace("-", "_")))


def _redact_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return redact_args(value)
    if isinstance(value, (list, tuple)):
        return [_redact_value(v) for v in value]
    return value


def redact_args(mapping) -> dict:
    """A copy of ``mapping`` fit to show: secret-named arguments that are set become ``***``,
    credentials in URLs (also inside longer strings such as JSON, and in nested lists and dicts)
    become ``***``."""
    return {k: (REDACTED if v and is_secret_name(str(k)) else _redact_value(v)) for k, v in mapping.items()}

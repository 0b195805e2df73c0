"""Keeping credentials out of what the engine and the server show: logs, server info, errors.

``redact_url`` hides the user and password of every ``scheme://user:pass@host`` in a string
and the value of ``password=``-like query parameters; ``redact_args`` does that to every
string of an argument mapping and hides the whole value of every argument whose name says it
is a secret (``*api_key*``, ``*secret*``, ``*password*``, ``*credential*``, ``token`` and
``*_token``: not ``token_usage`` or ``max_new_tokens``)."""

from __future__ import annotations

import re
from typing import Any

from radixserve.flags import ConfigError

REDACTED = "***"
# the user-info part of a URL: everything between "://" and the last "@" before the host
_USERINFO = re.compile(r"(://)[^/\s\"'@]*(?:@[^/\s\"'@]*)*@")
_QUERY_SECRET = re.compile(r"(?P<name>[?&](?:password|passwd|pass|token|secret|api_key)=)[^&#\s\"']*",
                           re.IGNORECASE)
_SECRET_NAME = re.compile(r"api_key|secret|passw(or)?d|credential|(^|_)token$", re.IGNORECASE)


def redact_url(url: str | None) -> str | None:
    """``url`` with the user and password of each ``scheme://user:pass@host`` in it replaced by
    ``***`` (``redis://***@host:6379/0``) and the value of a ``password=`` (``token=``, ...)
    query parameter too; a string without credentials (or None) comes back unchanged. Every
    URL in a longer text (an error message, JSON) is redacted."""
    if not url:
        return url
    url = _USERINFO.sub(r"\1" + REDACTED + "@", url)
    return _QUERY_SECRET.sub(lambda m: m["name"] + REDACTED, url)


def read_key_file(path: str, what: str) -> str:
    """The first line of the file ``path`` (a key or password kept off the command line);
    ConfigError naming ``what`` (the flag or option) when it cannot be read or is empty."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except (OSError, TypeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what}: cannot read {path}: {e}") from None
    if not key:
        raise ConfigError(f"{what}: {path} holds no key (its first line is empty)")
    return key


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

"""Keeping credentials out of what the engine shows: logs, server info, error messages."""

from __future__ import annotations

import re

_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/?#@\s]*)@")
_QUERY_SECRET = re.compile(r"(?P<name>[?&](?:password|passwd|pass|token|secret|api_key)=)[^&#\s]*", re.IGNORECASE)


def redact_url(url: str | None) -> str | None:
    """``url`` with the credentials of its ``user:password@`` part replaced by ``***``
    (``redis://***@host:6379/0``) and the value of a ``password=`` (``token=``, ...) query
    parameter too; a URL without them is returned unchanged. Every URL in a longer text
    (an error message) is redacted."""
    if not url:
        return url
    url = _USERINFO.sub(lambda m: f"{m['scheme']}***@", url)
    return _QUERY_SECRET.sub(lambda m: f"{m['name']}***", url)

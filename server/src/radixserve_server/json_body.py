"""Parsing a request body as JSON that the rest of the server can trust: every refusal is a
:class:`BadJSON` (a 400, one log line), never an exception deep inside a handler (a 500).

Refused, beyond what is not JSON at all:

- integers outside the 64-bit range, signed or unsigned (-2^63 .. 2^64 - 1: a ``seed`` may
  take all 64 bits; Python refuses to read ones past 4,300 digits, and shorter huge ones
  would overflow later in the engine) and floats that are not finite (``1e999``,
  and the ``NaN`` / ``Infinity`` that Python's parser otherwise accepts);
- nesting deeper than :data:`MAX_DEPTH` (Python's parser runs out of stack near 1,000 levels,
  and every walk over the value after it would too);
- strings (values or keys) with a lone UTF-16 surrogate (``"\\ud800"``): no text can be
  encoded with one, so tokenising it fails.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 256  # arrays and objects inside each other; deep JSON schemas stay well under it
INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # int64 below, uint64 above (seeds)


class BadJSON(ValueError):
    """A body refused by :func:`loads`; its message says why."""


def _int(text: str) -> int:
    if len(text) > 20:  # no 64-bit integer has more characters ("-9223372036854775808", "18446744073709551615")
        raise BadJSON(f"the integer {text[:20]}... is out of range (most 64 bits)")
    value = int(text)
    if not INT_MIN <= value <= INT_MAX:
        raise BadJSON(f"the integer {text} is out of range (most 64 bits)")
    return value


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadJSON(f"the number {text[:40]} is out of range")
    return value


def _constant(name: str) -> float:
    raise BadJSON(f"{name} is not a JSON number")


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check(value: Any) -> None:
    """Raise :class:`BadJSON` if ``value`` (a parsed body) nests deeper than :data:`MAX_DEPTH`
    or holds a string with a lone surrogate. Walks with a stack, not recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _has_lone_surrogate(item):
                raise BadJSON("a string in the body holds a lone UTF-16 surrogate (e.g. \\ud800), which no text "
                              "encoding can hold")
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise BadJSON(f"the body nests arrays and objects more than {MAX_DEPTH} levels deep")
        if isinstance(item, dict):
            stack.extend((k, depth) for k in item)
            stack.extend((v, depth + 1) for v in item.values())
        else:
            stack.extend((v, depth + 1) for v in item)


def loads(raw: bytes | str) -> Any:
    """``raw`` parsed and checked (see the module docstring); :class:`BadJSON` when refused."""
    try:
        value = json.loads(raw, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except BadJSON:
        raise
    except RecursionError:
        raise BadJSON(f"the body nests arrays and objects more than {MAX_DEPTH} levels deep") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, Python's own limits
        raise BadJSON(f"the request body is not valid JSON: {e}") from None
    check(value)
    return value

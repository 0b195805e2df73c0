"""Runaway guards for JSON constraints: bounded free strings, arrays and objects.

A JSON schema admits outputs of any length wherever it leaves a string, an array or (in
``json_object`` mode) an object unbounded, and a small model that starts repeating
itself inside one keeps going until ``max_tokens``: the reply never parses. The engine
therefore compiles a *bounded* copy of each JSON constraint (never the schema a client
validates against):

* a free string (no ``pattern``, ``enum``, ``const``, ``format`` or ``maxLength``) gets
  ``maxLength`` ``--constrained-json-max-string-length``; a string of an unbounded
  format (email, uri, hostname, ...) gets a bounded pattern of that format instead;
* a free array (no ``maxItems``) gets ``maxItems`` ``--constrained-json-max-items``;
* an object that names its properties and says nothing of others generates only those
  (``additionalProperties: false``, as OpenAI's strict mode and the xgrammar backend
  read it), and one open to other properties gets ``maxProperties`` (the same bound, or
  as many as it names if that is more);
* ``json_object`` (any object) becomes a schema of any JSON value with those bounds on
  its strings, keys, arrays and objects, nested at most ``JSON_OBJECT_MAX_DEPTH`` deep.

The schema's own ``maxLength``/``maxItems`` always win, a ``minLength``/``minItems``
above the bound raises the bound to it, and 0 turns a bound off.
"""

from __future__ import annotations

import json
from typing import Any

# String formats whose grammar-backend regexes admit strings of any length: the bounded
# constraint gives them a pattern of the same shape, about 100 characters at most.
_URI = r"^https?://[A-Za-z0-9-]{1,32}(\.[A-Za-z0-9-]{1,24}){1,2}(/[A-Za-z0-9._~%+=?&-]{1,24}){0,3}$"
_EMAIL = r"^[A-Za-z0-9._%+-]{1,32}@[A-Za-z0-9-]{1,32}(\.[A-Za-z0-9-]{1,24}){1,2}$"
BOUNDED_FORMATS = {"email": _EMAIL, "idn-email": _EMAIL, "uri": _URI, "iri": _URI, "uri-reference": _URI,
                   "iri-reference": _URI, "hostname": r"^[A-Za-z0-9-]{1,32}(\.[A-Za-z0-9-]{1,24}){0,3}$"}
DEFAULT_MAX_STRING_LENGTH = 512  # --constrained-json-max-string-length
DEFAULT_MAX_ITEMS = 64  # --constrained-json-max-items
JSON_OBJECT_MAX_DEPTH = 6  # nesting levels of a bounded json_object (the outer object is 1)
KEY_MAX_LENGTH = 64  # characters of a json_object key (when strings are bounded)


def _types(node: dict) -> set[str]:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set()


def _at_least(bound: int, minimum: Any) -> int:
    return max(bound, minimum if isinstance(minimum, int) and not isinstance(minimum, bool) else 0)


def bound_schema(node: Any, max_string: int = DEFAULT_MAX_STRING_LENGTH,
                 max_items: int = DEFAULT_MAX_ITEMS) -> Any:
    """``node`` (a JSON schema, or any part of one) with its free strings and arrays
    bounded as the module docstring says; the input is not modified."""
    if isinstance(node, list):
        return [bound_schema(x, max_string, max_items) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: bound_schema(v, max_string, max_items) for k, v in node.items()}
    if {"enum", "const"} & node.keys():
        return out
    types = _types(node)
    if "string" in types and "pattern" not in node:
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt in BOUNDED_FORMATS:
            del out["format"]
            out["pattern"] = BOUNDED_FORMATS[fmt]
        elif fmt is None and "maxLength" not in node and max_string > 0:
            out["maxLength"] = _at_least(max_string, node.get("minLength"))
    if "array" in types and "maxItems" not in node and max_items > 0 and node.get("items") is not False:
        out["maxItems"] = _at_least(max_items, node.get("minItems"))
    if "object" in types and max_items > 0:
        named = node.get("properties")
        if isinstance(named, dict) and named and not {"additionalProperties", "patternProperties",
                                                      "unevaluatedProperties"} & node.keys():
            out["additionalProperties"] = False
        elif "maxProperties" not in node and node.get("additionalProperties", True) is not False:
            out["maxProperties"] = _at_least(max(max_items, len(named) if isinstance(named, dict) else 0),
                                             node.get("minProperties"))
    return out


def bounded_json_object(max_string: int = DEFAULT_MAX_STRING_LENGTH,
                        max_items: int = DEFAULT_MAX_ITEMS) -> dict[str, Any]:
    """A schema of any JSON object with bounded strings (keys too), arrays and objects
    (``max_items`` members), nested at most ``JSON_OBJECT_MAX_DEPTH`` levels: level ``k``'s
    containers hold values of level ``k + 1``, the last level only scalars."""
    string: dict[str, Any] = {"type": "string"}
    if max_string > 0:
        string["maxLength"] = max_string
    scalars = [string, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]

    def obj(value: dict[str, Any]) -> dict[str, Any]:
        o: dict[str, Any] = {"type": "object"}
        if max_string > 0:
            o["patternProperties"] = {f"^.{{0,{min(max_string, KEY_MAX_LENGTH)}}}$": value}
            o["additionalProperties"] = False
        else:
            o["additionalProperties"] = value
        if max_items > 0:
            o["maxProperties"] = max_items
        return o

    def arr(value: dict[str, Any]) -> dict[str, Any]:
        a: dict[str, Any] = {"type": "array", "items": value}
        if max_items > 0:
            a["maxItems"] = max_items
        return a

    defs: dict[str, Any] = {f"level{JSON_OBJECT_MAX_DEPTH}": {"anyOf": scalars}}
    for k in range(JSON_OBJECT_MAX_DEPTH - 1, 1, -1):
        inner = {"$ref": f"#/$defs/level{k + 1}"}
        defs[f"level{k}"] = {"anyOf": [*scalars, arr(inner), obj(inner)]}
    return {**obj({"$ref": "#/$defs/level2"}), "$defs": defs}


def bound_constraint(kind: str, text: str, max_string: int = DEFAULT_MAX_STRING_LENGTH,
                     max_items: int = DEFAULT_MAX_ITEMS) -> tuple[str, str]:
    """The ``(kind, text)`` a grammar backend compiles for a request's constraint: JSON
    ones bounded (``json_object`` becomes a ``json_schema``), others as they are. A schema
    that is not valid JSON is passed on unchanged for the backend to report."""
    if max_string <= 0 and max_items <= 0:
        return kind, text
    if kind == "json_object":
        return "json_schema", json.dumps(bounded_json_object(max_string, max_items))
    if kind != "json_schema":
        return kind, text
    try:
        schema = json.loads(text)
    except ValueError:
        return kind, text
    bounded = bound_schema(schema, max_string, max_items)
    return kind, text if bounded == schema else json.dumps(bounded)

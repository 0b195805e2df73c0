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


ANY_VALUE = "radixserve_any"  # $defs prefix of the bounded any-JSON values bound_schema adds


def bound_schema(node: Any, max_string: int = DEFAULT_MAX_STRING_LENGTH,
                 max_items: int = DEFAULT_MAX_ITEMS) -> Any:
    """``node`` (a JSON schema) with its free strings, arrays and objects bounded as the
    module docstring says; the input is not modified. The members of an object that
    constrains none of them, and the items of an array that does not constrain its
    items, become bounded JSON values (``$defs`` the copy gains)."""
    used: list[bool] = []
    out = _bound(node, max_string, max_items, used)
    if used and isinstance(out, dict):
        out["$defs"] = {**(out.get("$defs") or {}), **_any_value_defs(max_string, max_items, ANY_VALUE)}
    return out


def _bound(node: Any, max_string: int, max_items: int, used: list[bool]) -> Any:
    if isinstance(node, list):
        return [_bound(x, max_string, max_items, used) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _bound(v, max_string, max_items, used) for k, v in node.items()}
    if {"enum", "const"} & node.keys():
        return out
    any_value = {"$ref": f"#/$defs/{ANY_VALUE}2"}
    bounded = max_string > 0 or max_items > 0
    types = _types(node)
    if "string" in types and "pattern" not in node:
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt in BOUNDED_FORMATS:
            del out["format"]
            out["pattern"] = BOUNDED_FORMATS[fmt]
        elif fmt is None and "maxLength" not in node and max_string > 0:
            out["maxLength"] = _at_least(max_string, node.get("minLength"))
    if "array" in types and node.get("items") is not False:
        if "maxItems" not in node and max_items > 0:
            out["maxItems"] = _at_least(max_items, node.get("minItems"))
        if bounded and not {"items", "prefixItems", "additionalItems", "unevaluatedItems", "contains"} & node.keys():
            out["items"] = any_value
            used.append(True)
    if "object" in types:
        named = node.get("properties")
        named = named if isinstance(named, dict) else {}
        others = {"additionalProperties", "patternProperties", "unevaluatedProperties"} & node.keys()
        if named and not others and max_items > 0:
            out["additionalProperties"] = False
        else:
            if bounded and (not named and not others or node.get("additionalProperties") is True):
                out.update(_bounded_members(any_value, max_string))
                used.append(True)
            open_to_others = node.get("additionalProperties") is not False or "patternProperties" in node
            if open_to_others and "maxProperties" not in node and max_items > 0:
                out["maxProperties"] = _at_least(max(max_items, len(named)), node.get("minProperties"))
    return out


def _any_value_defs(max_string: int, max_items: int, prefix: str) -> dict[str, Any]:
    """``$defs`` ``<prefix>2`` .. ``<prefix>{JSON_OBJECT_MAX_DEPTH + 1}``: any JSON value
    with bounded strings (keys too), arrays and objects (``max_items`` members); a
    container at level ``k`` holds values of level ``k + 1``, the last level only scalars
    (level 1 is the container that refers to level 2)."""
    string: dict[str, Any] = {"type": "string"}
    if max_string > 0:
        string["maxLength"] = max_string
    scalars = [string, {"type": "number"}, {"type": "boolean"}, {"type": "null"}]
    defs: dict[str, Any] = {f"{prefix}{JSON_OBJECT_MAX_DEPTH + 1}": {"anyOf": scalars}}
    for k in range(JSON_OBJECT_MAX_DEPTH, 1, -1):
        inner = {"$ref": f"#/$defs/{prefix}{k + 1}"}
        defs[f"{prefix}{k}"] = {"anyOf": [*scalars, _bounded_array(inner, max_items),
                                          _bounded_object(inner, max_string, max_items)]}
    return defs


def _bounded_array(value: dict[str, Any], max_items: int) -> dict[str, Any]:
    a: dict[str, Any] = {"type": "array", "items": value}
    if max_items > 0:
        a["maxItems"] = max_items
    return a


def _bounded_members(value: dict[str, Any], max_string: int) -> dict[str, Any]:
    """Object keywords: any members whose values are ``value``, keys bounded when strings
    are (by a pattern: the grammar backends do not all read ``propertyNames``)."""
    if max_string <= 0:
        return {"additionalProperties": value}
    return {"patternProperties": {f"^.{{0,{min(max_string, KEY_MAX_LENGTH)}}}$": value},
            "additionalProperties": False}


def _bounded_object(value: dict[str, Any], max_string: int, max_items: int) -> dict[str, Any]:
    o: dict[str, Any] = {"type": "object", **_bounded_members(value, max_string)}
    if max_items > 0:
        o["maxProperties"] = max_items
    return o


def bounded_json_object(max_string: int = DEFAULT_MAX_STRING_LENGTH,
                        max_items: int = DEFAULT_MAX_ITEMS) -> dict[str, Any]:
    """A schema of any JSON object with bounded strings (keys too), arrays and objects
    (``max_items`` members), containers nested at most ``JSON_OBJECT_MAX_DEPTH`` deep."""
    return {**_bounded_object({"$ref": "#/$defs/level2"}, max_string, max_items),
            "$defs": _any_value_defs(max_string, max_items, "level")}


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

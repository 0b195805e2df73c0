"""The tool-call formats radixserve ships, each registered as ``--tool-call-parser NAME``
(hermes/qwen25, llama3, mistral, pythonic, and the forced-call parsers ``tool_choice`` uses);
the parser contract and the registry are in :mod:`.parsers`."""

from __future__ import annotations

import ast
import json
from typing import Any

from radixserve_server.tool_calling.parsers import (
    ToolParser,
    _Broken,
    register_tool_parser,
)


@register_tool_parser("hermes", "qwen25")
class HermesParser(ToolParser):
    """Hermes / Qwen 2.5 / Qwen 3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    one block per call."""

    name = "hermes"
    markers = ("<tool_call>",)

    def _region(self, marker):
        yield from self._json_call()
        yield from self._closer("</tool_call>")


@register_tool_parser("llama3", "llama3_json")
class Llama3Parser(ToolParser):
    """Llama 3.1-3.3 JSON calls: ``<|python_tag|>`` or the output's first ``{`` opens
    ``{"name": ..., "parameters": {...}}``, several separated by ``;``."""

    name = "llama3"
    markers = ("<|python_tag|>",)
    leading = "{"
    special_markers = True

    @classmethod
    def render_calls(cls, calls):
        return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                                            for n, a in calls)

    def _region(self, marker):
        while True:
            c = yield from self._skip_ws()
            if c != "{":
                raise _Broken
            yield from self._json_call()
            back = self._i
            c = yield from self._skip_ws()
            if c != ";":
                self._i = back
                return
            self._i += 1


@register_tool_parser("mistral")
class MistralParser(ToolParser):
    """Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, or the newer
    ``[TOOL_CALLS]name[ARGS]{...}`` per call."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    special_markers = True

    @classmethod
    def render_calls(cls, calls):
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    def _region(self, marker):
        c = yield from self._skip_ws()
        if c == "[":
            yield from self._json_array()
            return
        start = self._i
        while c is not None and (c.isalnum() or c in "_-."):
            self._i += 1
            c = yield from self._next_char()
        if self._i == start:
            raise _Broken
        name = self._buf[start:self._i]
        yield from self._expect("[ARGS]")
        self._commit(name)
        yield from self._json_args()


def _py_value(node: ast.AST) -> Any:
    """A Python literal (JSON's true/false/null spellings too) as a JSON value."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _py_value(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_py_value(x) for x in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_py_value(k) if k is not None else None for k in node.keys]
        if all(isinstance(k, str) for k in keys):
            return {k: _py_value(v) for k, v in zip(keys, node.values)}
    raise _Broken


@register_tool_parser("pythonic")
class PythonicParser(ToolParser):
    """Python call syntax (Llama 3.2/4 and others): an output starting with
    ``[get_weather(city="Paris"), ...]`` (or that list after ``<|python_start|>``);
    arguments are keyword arguments with literal values, sent as JSON once each call closes."""

    name = "pythonic"
    markers = ("<|python_start|>",)
    leading = "["
    special_markers = True

    @classmethod
    def render_calls(cls, calls):
        return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"

    def _region(self, marker):
        c = yield from self._skip_ws()
        if c != "[":
            raise _Broken
        self._i += 1
        while True:
            yield from self._skip_ws()
            yield from self._py_call()
            c = yield from self._skip_ws()
            if c == ",":
                self._i += 1
            elif c == "]":
                self._i += 1
                break
            else:
                raise _Broken
        if marker:
            yield from self._closer("<|python_end|>")

    def _py_call(self):
        start = self._i
        c = yield from self._next_char()
        while c is not None and (c.isalnum() or c in "_."):
            self._i += 1
            c = yield from self._next_char()
        name = self._buf[start:self._i]
        if not name or c != "(":
            raise _Broken
        self._commit(name)
        self._i += 1
        depth, quote, escaped = 1, None, False
        while depth:
            c = yield from self._next_char()
            if c is None:
                raise _Broken
            self._i += 1
            if quote:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == quote:
                    quote = None
            elif c in "'\"":
                quote = c
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
        try:
            call = ast.parse(self._buf[start:self._i].strip(), mode="eval").body
        except SyntaxError:
            raise _Broken from None
        if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
            raise _Broken
        args = {k.arg: _py_value(k.value) for k in call.keywords}
        self._send_args(json.dumps(args, ensure_ascii=False))
        self._call_done()


# ---------------------------------------------- forced calls (tool_choice)
class NamedCallParser(ToolParser):
    """``tool_choice`` naming a function: the whole output is that call's arguments object
    (the grammar guarantees it), started before the first character."""

    hold_calls = False

    def __init__(self, name: str) -> None:
        self.forced_name = name
        super().__init__([name], max_calls=None)

    def _body(self):
        self._commit(self.forced_name)
        yield from self._json_args()


class RequiredCallsParser(ToolParser):
    """``tool_choice: "required"``: the output is a JSON array of
    ``{"name": ..., "parameters": {...}}`` (the grammar guarantees it)."""

    hold_calls = False
    arg_keys = ("parameters", "arguments")

    def _body(self):
        self._raw_start = self._i
        self._region_calls = 0
        yield from self._json_array()
        if self._region_calls == 0:
            raise _Broken


# ----------------------------------------------------------- aggregation

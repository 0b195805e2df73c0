"""Tool calling on /v1/chat/completions: the request's tools, their prompt, and the reply.

- Validation (:func:`check_tools`): ``tools[i]`` is ``{"type": "function", "function":
  {"name", "description"?, "parameters"?, "strict"?}}``; ``tool_choice`` is ``none``,
  ``auto``, ``required`` or ``{"type": "function", "function": {"name": <a declared
  tool>}}``. Each error is a 400 naming its field.
- ``tool_choice`` ``required`` and named are enforced by the grammar backend: the request
  gets a JSON-schema constraint (:func:`required_schema`: an array of
  ``{"name", "parameters"}``, one ``anyOf`` branch per tool; named: the function's
  parameters, the output being its arguments object), so even a model that never saw
  tools returns valid calls. Strings of an unbounded format (email, uri, hostname) are
  generated under a bounded pattern of that format, other free strings under
  ``--tool-call-max-string-length``, and a ``required`` reply holds at most
  ``MAX_PARALLEL_CALLS`` calls, so a small model cannot loop until ``max_tokens``.
  ``auto`` is decided by ``--tool-call-parser``'s format;
  without the flag the reply is plain content.
- The prompt (:meth:`ToolCalling.prepare_messages`): assistant ``tool_calls`` get their
  ``arguments`` as a mapping (what HF templates expect). A template that does not render
  ``tool_calls`` gets the calls written into the message's content in the parser's format,
  and one that ignores ``tools`` gets them described in the system message.
- The reply (:meth:`ToolCalling.message`, :meth:`ToolCalling.stream`) works on the
  *content* (after any reasoning split): ``message.tool_calls`` and finish reason
  ``tool_calls``; streamed as ``delta.tool_calls`` with ``index``, ``id``, ``type`` and the
  name first, then argument fragments.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from radixserve.grammar.bounds import bound_schema

from radixserve_server.errors import APIError
from radixserve_server.sglang_fields import GRAMMAR_FIELDS
from radixserve_server.tool_calling.formats import NamedCallParser, RequiredCallsParser
from radixserve_server.tool_calling.parsers import (
    CallArgs,
    CallStart,
    Text,
    ToolParser,
    get_tool_parser,
    parse_tool_calls,
)

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_KEYS = {"type", "function"}
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
CHOICES = ("none", "auto", "required")


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def check_tools(body) -> None:
    """400s naming the field for ``tools``, ``tool_choice`` and ``parallel_tool_calls``."""
    tools = body.tools or []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        for key in tool:
            if key not in TOOL_KEYS:
                raise APIError(400, f"{where}.{key}: this field is not supported by this server",
                               param=f"{where}.{key}", code="unsupported_parameter")
        if tool.get("type") != "function":
            raise _bad(f"{where}.type", f"must be \"function\", got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function", "must be an object with the function's name and parameters")
        for key in fn:
            if key not in FUNCTION_KEYS:
                raise APIError(400, f"{where}.function.{key}: this field is not supported by this server",
                               param=f"{where}.function.{key}", code="unsupported_parameter")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise _bad(f"{where}.function.name", "must be 1 to 64 letters, digits, underscores or dashes, "
                       f"got {name!r}")
        if name in names:
            raise _bad(f"{where}.function.name", f"{name!r} is declared twice")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise _bad(f"{where}.function.description", "must be a string")
        if "strict" in fn and not isinstance(fn["strict"], bool):
            raise _bad(f"{where}.function.strict", "must be true or false")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise _bad(f"{where}.function.parameters", f"must be a JSON schema object, got {type(params).__name__}")
            if params.get("type", "object") != "object":
                raise _bad(f"{where}.function.parameters", f"must describe an object (type \"object\"), "
                           f"got type {params.get('type')!r}")
    choice = body.tool_choice
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise _bad("tool_choice", f"must be one of {', '.join(CHOICES)} or "
                       f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}')
    elif isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) - {"type", "function"}:
            raise _bad("tool_choice", 'a named tool choice is {"type": "function", "function": {"name": ...}}')
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(fn, dict) or set(fn) - {"name"} or not isinstance(name, str):
            raise _bad("tool_choice.function.name", "a named tool choice needs the function's name")
        if name not in names:
            raise _bad("tool_choice.function.name", f"{name!r} is not among the request's tools"
                       + (f" ({', '.join(sorted(names))})" if names else " (the request has none)"))
    if choice == "required" and not tools:
        raise _bad("tool_choice", '"required" needs tools')
    if choice == "required" or isinstance(choice, dict):
        given = [f for f in GRAMMAR_FIELDS if getattr(body, f) is not None]
        rf = body.response_format
        if rf is not None and rf.get("type") != "text":
            given.append("response_format")
        if given:
            raise _bad(given[0], "cannot be combined with tool_choice \"required\" or a named function, "
                       "which constrain the output themselves")


# ----------------------------------------------------------------- schemas
MAX_PARALLEL_CALLS = 16  # items of a "required" reply: a greedy model may repeat calls forever
MAX_STRING_LENGTH = 512  # --tool-call-max-string-length: free strings (a greedy loop inside one)


def bounded_for_generation(node: Any, max_string: int = MAX_STRING_LENGTH) -> Any:
    """A tool's schema as generated: strings bounded by :func:`radixserve.grammar.bounds.bound_schema`
    under ``--tool-call-max-string-length`` (arrays are left to the engine's
    ``--constrained-json-max-items``, which bounds every JSON constraint)."""
    return bound_schema(node, max_string, 0)


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema; a function without one takes an empty object."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _rewrite_refs(node: Any, prefix: str) -> Any:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                for base in ("#/$defs/", "#/definitions/"):
                    if v.startswith(base):
                        v = "#/$defs/" + prefix + v[len(base):]
                out[k] = v
            else:
                out[k] = _rewrite_refs(v, prefix)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(x, prefix) for x in node]
    return node


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The constraint of ``tool_choice: "required"``: a non-empty array (one item when
    ``parallel`` is false) of ``{"name": <a tool>, "parameters": <its schema>}``. Each
    tool's ``$defs``/``definitions`` move to the top, renamed per tool, with their refs."""
    branches, defs = [], {}
    for k, tool in enumerate(tools):
        params = dict(parameters_of(tool))
        local = {**params.pop("definitions", {}), **params.pop("$defs", {})}
        if local:
            prefix = f"tool{k}_"
            params = _rewrite_refs(params, prefix)
            defs.update({prefix + n: _rewrite_refs(d, prefix) for n, d in local.items()})
        branches.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                        "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
                              "items": branches[0] if len(branches) == 1 else {"anyOf": branches}}
    if defs:
        schema["$defs"] = defs
    return schema


# ------------------------------------------------------------------ request
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCalling:
    """One chat request's tool calling: ``mode`` is ``none`` (the reply is left alone),
    ``auto`` (the server's parser finds calls), ``required`` or ``named``."""

    def __init__(self, body, parser_name: str | None, max_string_length: int = MAX_STRING_LENGTH) -> None:
        self.max_string_length = max_string_length
        self.tools: list[dict[str, Any]] = body.tools or []
        self.names = [t["function"]["name"] for t in self.tools]
        self.parallel = body.parallel_tool_calls is not False
        self.parser_cls: type[ToolParser] | None = get_tool_parser(parser_name) if parser_name else None
        self.skip_special_tokens = body.skip_special_tokens
        choice = body.tool_choice if body.tool_choice is not None else "auto"
        self.named: str | None = None
        if not self.tools or choice == "none":
            self.mode = "none"
        elif isinstance(choice, dict):
            self.mode, self.named = "named", choice["function"]["name"]
        elif choice == "required":
            self.mode = "required"
        else:
            self.mode = "auto" if self.parser_cls is not None else "none"
        self.choice = "none" if not self.tools else choice if isinstance(choice, str) else "named"

    # -------------------------------------------------------------- prompt
    def prepare_messages(self, messages: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
        """``messages`` (as the template receives them) with the tool round trip made
        renderable: see the module docstring."""
        template = template or ""
        render = (self.parser_cls or ToolParser).render_calls
        out = []
        for i, m in enumerate(messages):
            if m.get("role") == "assistant" and m.get("tool_calls") is not None:
                calls = _calls_of(m["tool_calls"], f"messages[{i}].tool_calls")
                m = dict(m, tool_calls=calls)
                if "tool_calls" not in template and calls:
                    text = render([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
                    m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
            out.append(m)
        if self.tools and self.choice != "none" and "tools" not in template:
            text = self.tools_prompt()
            if out and out[0].get("role") in ("system", "developer"):
                out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text)
            else:
                out.insert(0, {"role": "system", "content": text})
        return out

    def tools_prompt(self) -> str:
        """The tools described for a template that does not render ``tools``."""
        lines = ["You can call these functions (their parameters are JSON schemas):"]
        for t in self.tools:
            fn = t["function"]
            lines.append(json.dumps({"name": fn["name"], "description": fn.get("description", ""),
                                     "parameters": parameters_of(t)}, ensure_ascii=False))
        if self.mode == "auto":
            example = self.parser_cls.render_calls([("function_name", {"argument": "value"})])
            lines.append(f"To call functions, answer with: {example}")
        return "\n".join(lines)

    def update_params(self, params: dict[str, Any]) -> None:
        """Add the request's constraint (required, named) to its sampling parameters, and
        keep special tokens in the text when the parser's markers are special tokens."""
        if self.mode == "named":
            schema = parameters_of(self.tools[self.names.index(self.named)])
            params["json_schema"] = json.dumps(bounded_for_generation(schema, self.max_string_length))
        elif self.mode == "required":
            schema = required_schema(self.tools, self.parallel)
            params["json_schema"] = json.dumps(bounded_for_generation(schema, self.max_string_length))
        elif self.mode == "auto" and self.parser_cls.special_markers and self.skip_special_tokens is None:
            params["skip_special_tokens"] = False

    # --------------------------------------------------------------- reply
    def new_parser(self) -> ToolParser | None:
        if self.mode == "named":
            return NamedCallParser(self.named)
        if self.mode == "required":
            return RequiredCallsParser(self.names, None if self.parallel else 1)
        if self.mode == "auto":
            return self.parser_cls(self.names, None if self.parallel else 1)
        return None

    def message(self, message: dict[str, Any], finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A non-streamed reply: ``message["content"]`` parsed into ``tool_calls``."""
        parser = self.new_parser()
        if parser is None:
            return message, finish_reason
        content, calls = parse_tool_calls(parser, message.get("content") or "")
        if not calls:
            return message, finish_reason
        message = dict(message, content=content.rstrip() or None, tool_calls=[
            {"id": new_call_id(), "type": "function", "function": {"name": n, "arguments": a}} for n, a in calls])
        return message, "tool_calls" if finish_reason == "stop" else finish_reason

    def stream(self) -> ToolCallStream | None:
        """A streamed reply's converter (one per choice), or None when nothing is parsed."""
        parser = self.new_parser()
        return None if parser is None else ToolCallStream(parser)


class ToolCallStream:
    """Turns one choice's content deltas into OpenAI deltas with ``tool_calls``.

    Joined, the content deltas equal the non-streamed ``content`` and each call's argument
    fragments its ``arguments``, however the text was cut: trailing whitespace is held
    back, and dropped at the end when the reply made calls (as :meth:`ToolCalling.message`
    strips it)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.num_calls = 0
        self._held = ""

    def process(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """``delta`` (``content`` and other fields, such as ``reasoning_content``) as the
        deltas to send: the other fields first, then content and tool calls in order."""
        delta = dict(delta)
        text = delta.pop("content", None)
        out = [delta] if delta else []
        if text:
            out += self._render(self.parser.feed(text))
        return out

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas and the finish reason (``tool_calls`` after calls, instead of stop)."""
        out = self._render(self.parser.finish())
        if self._held and not self.num_calls:
            out.append({"content": self._held})
        self._held = ""
        return out, "tool_calls" if self.num_calls and finish_reason == "stop" else finish_reason

    def _render(self, events) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, Text):
                text = self._held + e.text
                body = text.rstrip()
                self._held = text[len(body):]
                if body:
                    out.append({"content": body})
            elif isinstance(e, CallStart):
                out.append({"tool_calls": [{"index": self.num_calls, "id": new_call_id(), "type": "function",
                                            "function": {"name": e.name, "arguments": ""}}]})
                self.num_calls += 1
            elif isinstance(e, CallArgs):
                out.append({"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": e.text}}]})
        return out


def _calls_of(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` with each ``function.arguments`` as a mapping."""
    if not isinstance(calls, list):
        raise _bad(where, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}[{j}].function", "must be an object with the function's name and arguments")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise _bad(f"{where}[{j}].function.arguments", "must be a JSON object (as a string)") from None
        if not isinstance(args, dict):
            raise _bad(f"{where}[{j}].function.arguments", "must be a JSON object")
        out.append(dict(call, function=dict(fn, arguments=args)))
    return out


class ChoiceStreams:
    """The :class:`ToolCallStream` of each choice of a streamed reply (none when the
    request's mode is ``none``)."""

    def __init__(self, tools: ToolCalling, num_choices: int) -> None:
        self._streams = [tools.stream() for _ in range(num_choices)]

    def deltas(self, index: int, delta: dict[str, Any], finished: bool,
               finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """Choice ``index``'s ``delta`` as the deltas to send (at least one, maybe empty)
        and the finish reason to send with the last of them."""
        stream = self._streams[index]
        if stream is None:
            return [delta], finish_reason
        out = stream.process(delta)
        if finished:
            tail, finish_reason = stream.finish(finish_reason)
            out += tail
        return out or [{}], finish_reason

"""Tool-call parsers: find the calls in a model's output, whole or streamed.

A parser reads the *content* part of an output (after any reasoning was split off) and
turns it into events: :class:`Text` outside calls, and per call :class:`CallStart` (its
name), :class:`CallArgs` (fragments of its arguments as JSON text) and :class:`CallEnd`.
It is incremental: :meth:`ToolParser.feed` takes the text as it is generated,
:meth:`ToolParser.finish` ends it, and the events do not depend on how the text was cut
into pieces. Text that might be the start of a call marker is held back until decided.

Rules every parser follows:

- A call's events are sent once it is complete and well formed (``hold_calls``, the
  default): its :class:`CallStart`, then its arguments, which are the arguments object as
  the model wrote it (re-encoded where the format is not JSON, as pythonic's). A parser
  whose output a grammar guarantees (``tool_choice`` required or named) sets
  ``hold_calls = False``: a call then starts once its name is known and its arguments
  stream as the model writes them, each fragment extending a valid JSON prefix.
- Parsing stops at the first call that is not well formed or names an undeclared tool:
  from there on everything is :class:`Text`, that call's own text included, so nothing
  the model wrote is lost. Only a call already started (``hold_calls`` false, the output
  cut by ``max_tokens``) ends with ``CallEnd(ok=False, raw)`` instead; a stream just ends
  it, :func:`parse_tool_calls` drops it (or gives its text back as content when no call
  completed). There, text cut short after complete calls is dropped, not made content.
- With ``max_calls`` set, calls beyond it are parsed but dropped.

Formats are registered by name (``--tool-call-parser``) with :func:`register_tool_parser`;
other distributions add theirs through the entry-point group ``radixserve.tool_parsers``
(``name = "module:ParserClass"``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from radixserve_server.tool_calling.json_scan import WS, JsonScanner, JsonSyntaxError

ENTRY_POINT_GROUP = "radixserve.tool_parsers"


# ----------------------------------------------------------------- events
@dataclass
class Text:
    text: str


@dataclass
class CallStart:
    name: str


@dataclass
class CallArgs:
    text: str


@dataclass
class CallEnd:
    ok: bool
    raw: str = ""  # when not ok: the call's text as the model wrote it


Event = Text | CallStart | CallArgs | CallEnd


class _Broken(Exception):
    """The text at the parser's position is not a (declared) call."""


def _held_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of ``text`` that is a proper start of some marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class ToolParser:
    """The base of every tool-call format (see the module docstring for the contract).

    A subclass sets ``markers`` (strings that open a call region anywhere in the text)
    and/or ``leading`` (characters that open one when they start the output), and writes
    :meth:`_region`, a generator that reads one region's calls with the helpers below
    (``c = yield from self._next_char()`` waits for input). :meth:`render_calls` writes
    calls back in the format, for chat templates that do not render ``tool_calls``.
    """

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()
    leading: ClassVar[str] = ""
    # the markers are special tokens in the models that use them: decode them
    special_markers: ClassVar[bool] = False
    hold_calls: ClassVar[bool] = True  # send a call once it is complete (see the module docstring)
    arg_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")

    def __init__(self, tools: Iterable[str], max_calls: int | None = None) -> None:
        self.tools = set(tools)
        self.max_calls = max_calls
        self.num_calls = 0  # committed calls
        self.num_done = 0  # of which complete
        self._buf = ""
        self._i = 0
        self._eof = False
        self._events: list[Event] = []
        self._committed = False  # the call in progress names a declared tool (and is not dropped)
        self._held: list[Event] = []  # its events, until it is complete (hold_calls)
        self._raw_start = 0  # where the text of the call in progress begins
        self._region_calls = 0
        self._gen: Iterator[None] | None = self._run()

    # ------------------------------------------------------------ public
    def feed(self, text: str) -> list[Event]:
        self._buf += text
        self._resume()
        return self._take()

    def finish(self) -> list[Event]:
        self._eof = True
        self._resume()
        return self._take()

    @classmethod
    def render_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """The calls (name, arguments) as this format writes them."""
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
                         for n, a in calls)

    # ------------------------------------------------------------ driver
    def _resume(self) -> None:
        while self._gen is not None:
            try:
                next(self._gen)
            except StopIteration:
                self._gen = None
            if not self._eof:
                return

    def _take(self) -> list[Event]:
        out: list[Event] = []
        for e in self._events:  # merge neighbours of the same kind
            if out and type(e) is type(out[-1]) and isinstance(e, (Text, CallArgs)):
                out[-1] = type(e)(out[-1].text + e.text)
            elif not (isinstance(e, (Text, CallArgs)) and not e.text):
                out.append(e)
        self._events = []
        return out

    def _run(self) -> Iterator[None]:
        try:
            yield from self._body()
        except _Broken:
            raw = self._buf[self._raw_start:self._i]
            if self._committed and not self.hold_calls:
                self._events.append(CallEnd(False, raw))
            elif self.hold_calls or not self.num_done:
                self._events.append(Text(raw))
            # else: a grammar-made list of calls cut short after complete ones: the rest is dropped
            self._committed, self._held = False, []
        while True:  # everything left is plain text
            self._events.append(Text(self._buf[self._i:]))
            self._i = len(self._buf)
            if self._eof:
                return
            yield

    def _body(self) -> Iterator[None]:
        if self.leading:
            c = yield from self._next_char()
            while c is not None and c in WS:
                self._i += 1
                c = yield from self._next_char()
            self._events.append(Text(self._buf[:self._i]))
            if c is not None and c in self.leading:
                yield from self._in_region(None)
        while True:
            marker = yield from self._text_until_marker()
            if marker is None:
                return
            yield from self._in_region(marker)

    def _in_region(self, marker: str | None) -> Iterator[None]:
        self._raw_start = self._i - len(marker or "")
        self._region_calls = 0
        yield from self._region(marker)
        if self._region_calls == 0:
            raise _Broken

    def _region(self, marker: str | None) -> Iterator[None]:
        """Read one call region (every format defines it; the base class has no format)."""
        raise NotImplementedError(f"{type(self).__name__} must define _region (see ToolParser)")
        yield  # a generator, like the formats' own _region

    # ----------------------------------------------------------- helpers
    def _next_char(self) -> Iterator[None]:
        """The next character, not consumed; None at the end of the output."""
        while self._i >= len(self._buf):
            if self._eof:
                return None
            yield
        return self._buf[self._i]

    def _skip_ws(self) -> Iterator[None]:
        """Skip whitespace; the next character (not consumed) or None."""
        while True:
            c = yield from self._next_char()
            if c is None or c not in WS:
                return c
            self._i += 1

    def _text_until_marker(self) -> Iterator[None]:
        """Send text up to the next marker and consume it; None at the end of the output."""
        while True:
            rest = self._buf[self._i:]
            hits = [(k, m) for m in self.markers if (k := rest.find(m)) >= 0]
            if hits:
                k, m = min(hits)
                self._events.append(Text(rest[:k]))
                self._i += k + len(m)
                return m
            keep = 0 if self._eof else _held_suffix(rest, self.markers)
            self._events.append(Text(rest[:len(rest) - keep]))
            self._i += len(rest) - keep
            if self._eof:
                return None
            yield

    def _expect(self, word: str) -> Iterator[None]:
        """Consume ``word`` or break."""
        for ch in word:
            c = yield from self._next_char()
            if c != ch:
                raise _Broken
            self._i += 1

    def _closer(self, word: str) -> Iterator[None]:
        """Consume optional whitespace and ``word`` (a region's closing marker) if they
        come next; otherwise leave the text for the text that follows the region. A part
        of ``word`` cut off by the end of the output is dropped."""
        back = self._i
        yield from self._skip_ws()
        for k, ch in enumerate(word):
            c = yield from self._next_char()
            if c is None and k > 0:
                return
            if c != ch:
                self._i = back
                return
            self._i += 1

    def _commit(self, name: str) -> None:
        if name not in self.tools:
            raise _Broken
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return  # parsed, but dropped
        self._committed = True
        self.num_calls += 1
        (self._held if self.hold_calls else self._events).append(CallStart(name))

    def _send_args(self, text: str) -> None:
        if self._committed and text:
            (self._held if self.hold_calls else self._events).append(CallArgs(text))

    def _call_done(self) -> None:
        if self._committed:
            self._events += [*self._held, CallEnd(True)]
            self.num_done += 1
        self._held = []
        self._committed = False
        self._raw_start = self._i
        self._region_calls += 1

    def _json_call(self) -> Iterator[None]:
        """One call as a JSON object ``{"name": ..., "arguments": {...}}`` (any of
        ``arg_keys`` names the arguments, which may also be an object as a JSON string)."""
        scanner, base = JsonScanner(), self._i
        key = name = None
        name_start = args_start = args_end = None
        sent = 0
        while not scanner.done:
            c = yield from self._next_char()
            if c is None:
                raise _Broken
            try:
                events = scanner.feed(c)
            except JsonSyntaxError:
                raise _Broken from None
            self._i += 1
            for kind, depth, value in events:
                if depth != 1:
                    continue
                if kind == "key":
                    key = value
                elif kind == "start" and key == "name" and name_start is None:
                    name_start = base + value
                elif kind == "start" and key in self.arg_keys and args_start is None:
                    if c not in '{"':
                        raise _Broken  # arguments must be an object
                    args_start = sent = base + value
                elif kind == "end" and key == "name" and name is None:
                    name = json.loads(self._buf[name_start:base + value])
                    if not isinstance(name, str):
                        raise _Broken
                    self._commit(name)
                elif kind == "end" and key in self.arg_keys and args_start is not None and args_end is None:
                    args_end = base + value
            if args_start is not None and self._buf[args_start] == "{" and name is not None:
                upto = self._i if args_end is None else args_end
                self._send_args(self._buf[sent:upto])
                sent = max(sent, upto)
        if name is None:
            raise _Broken
        if args_start is None:
            self._send_args("{}")
        elif self._buf[args_start] == '"':  # the arguments as a JSON string
            try:
                args = json.loads(json.loads(self._buf[args_start:args_end]))
            except ValueError:
                raise _Broken from None
            if not isinstance(args, dict):
                raise _Broken
            self._send_args(json.dumps(args, ensure_ascii=False))
        self._call_done()

    def _json_args(self) -> Iterator[None]:
        """The arguments object of a call already committed, streamed as it comes."""
        c = yield from self._skip_ws()
        if c != "{":
            raise _Broken
        scanner, sent = JsonScanner(), self._i
        while not scanner.done:
            c = yield from self._next_char()
            if c is None:
                raise _Broken
            try:
                scanner.feed(c)
            except JsonSyntaxError:
                raise _Broken from None
            self._i += 1
            self._send_args(self._buf[sent:self._i])
            sent = self._i
        self._call_done()

    def _json_array(self) -> Iterator[None]:
        """``[call, call, ...]`` of JSON calls (the ``[`` not yet consumed)."""
        c = yield from self._skip_ws()
        if c != "[":
            raise _Broken
        self._i += 1
        while True:
            c = yield from self._skip_ws()
            if c != "{":
                raise _Broken
            yield from self._json_call()
            c = yield from self._skip_ws()
            if c == ",":
                self._i += 1
            elif c == "]":
                self._i += 1
                return
            else:
                raise _Broken


# --------------------------------------------------------------- registry
TOOL_PARSERS: dict[str, type[ToolParser]] = {}
_entry_points_loaded = False


def register_tool_parser(*names: str):
    """Class decorator: make a :class:`ToolParser` available as ``--tool-call-parser NAME``."""

    def add(cls: type[ToolParser]) -> type[ToolParser]:
        for n in names:
            TOOL_PARSERS[n] = cls
        return cls

    return add


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        TOOL_PARSERS.setdefault(ep.name, ep.load())


def tool_parser_names() -> list[str]:
    _load_entry_points()
    return sorted(TOOL_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; a ValueError naming the choices if none is."""
    _load_entry_points()
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"--tool-call-parser: invalid value {name!r}; choose from: "
                         f"{', '.join(tool_parser_names())}") from None


def parse_tool_calls(parser: ToolParser, text: str) -> tuple[str, list[tuple[str, str]]]:
    """A whole output: (the text outside calls, [(name, arguments JSON), ...]). A call that
    breaks is given back as text, so with no calls the text is ``text`` itself; only a
    started call cut short after others completed (``hold_calls`` false: a grammar-made
    list of calls cut by ``max_tokens``) is dropped, leaving the completed calls."""
    content: list[str] = []
    calls: list[tuple[str, str]] = []
    for e in parser.feed(text) + parser.finish():
        if isinstance(e, Text):
            content.append(e.text)
        elif isinstance(e, CallStart):
            calls.append((e.name, ""))
        elif isinstance(e, CallArgs):
            calls[-1] = (calls[-1][0], calls[-1][1] + e.text)
        elif not e.ok:
            calls.pop()
            if not calls:
                content.append(e.raw)
    return "".join(content), calls

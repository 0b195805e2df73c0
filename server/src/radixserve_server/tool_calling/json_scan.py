"""An incremental JSON syntax checker, fed one character at a time.

Tool-call parsers stream a call's arguments as the model writes them; this scanner says,
character by character, whether the text so far is still the start of a valid JSON
object or array, where each member's key and value begin and end, and when the value is
complete. Every character it has accepted extends a valid JSON prefix, so the text it
accepted can be sent on at once. The top-level value must be an object or an array (so
its end is its closing bracket, never a lookahead).
"""

from __future__ import annotations

import json

WS = " \t\n\r"
HEX = "0123456789abcdefABCDEF"
DIGITS = "0123456789"
LITERALS = {"t": "true", "f": "false", "n": "null"}
ESCAPES = '"\\/bfnrt'

# JSON numbers as a small automaton: state -> {character class -> next state}; the states
# in NUMBER_ENDS may end the number.
_NUMBER = {
    "start": {"-": "minus", "0": "zero", "1": "int"},
    "minus": {"0": "zero", "1": "int"},
    "zero": {".": "dot", "e": "exp"},
    "int": {"0": "int", "1": "int", ".": "dot", "e": "exp"},
    "dot": {"0": "frac", "1": "frac"},
    "frac": {"0": "frac", "1": "frac", "e": "exp"},
    "exp": {"+": "exp_sign", "-": "exp_sign", "0": "exp_digits", "1": "exp_digits"},
    "exp_sign": {"0": "exp_digits", "1": "exp_digits"},
    "exp_digits": {"0": "exp_digits", "1": "exp_digits"},
}
NUMBER_ENDS = {"zero", "int", "frac", "exp_digits"}


def _number_class(c: str) -> str:
    if c == "0":
        return "0"
    if c in DIGITS:
        return "1"
    return "e" if c in "eE" else c


class JsonSyntaxError(ValueError):
    """The character just fed cannot continue a JSON value."""


class JsonScanner:
    """Checks one top-level JSON object or array, fed with :meth:`feed`.

    ``feed`` returns the events the character caused, as tuples:

    - ``("key", depth, key)``: an object key (decoded) ended; ``depth`` counts the
      containers around it (1 for a member of the top-level object);
    - ``("start", depth, pos)``: a value starts at character ``pos`` (its first character);
    - ``("end", depth, pos)``: a value ended just before character ``pos`` (exclusive).

    Positions count the characters fed so far, from 0. After the top-level value's
    closing bracket :attr:`done` is true and nothing more may be fed.
    """

    def __init__(self) -> None:
        self.pos = 0
        self.done = False
        self._stack: list[str] = []
        self._state = "top"
        self._is_key = False
        self._key: list[str] = []
        self._word = ""
        self._matched = 0
        self._number = "start"
        self._hex = 0

    @property
    def depth(self) -> int:
        return len(self._stack)

    def feed(self, c: str) -> list[tuple]:
        if self.done:
            raise JsonSyntaxError("text after the end of the JSON value")
        events: list[tuple] = []
        self._step(c, events)
        self.pos += 1
        return events

    # ------------------------------------------------------------ internals
    def _error(self, c: str, expected: str) -> JsonSyntaxError:
        return JsonSyntaxError(f"unexpected {c!r} at character {self.pos}: expected {expected}")

    def _start(self, events: list[tuple]) -> None:
        events.append(("start", len(self._stack), self.pos))

    def _end(self, events: list[tuple], end: int) -> None:
        events.append(("end", len(self._stack), end))
        if self._stack:
            self._state = "after"
        else:
            self.done = True
            self._state = "done"

    def _close(self, events: list[tuple]) -> None:
        self._stack.pop()
        self._end(events, self.pos + 1)

    def _step(self, c: str, events: list[tuple]) -> None:
        state = self._state
        if state == "string":
            if c == '"':
                if self._is_key:
                    key = json.loads('"' + "".join(self._key) + '"')
                    events.append(("key", len(self._stack), key))
                    self._state = "colon"
                else:
                    self._end(events, self.pos + 1)
            elif c == "\\":
                self._state = "escape"
                self._keep(c)
            elif c < " ":
                raise self._error(c, "an escaped control character inside a string")
            else:
                self._keep(c)
        elif state == "escape":
            if c == "u":
                self._state, self._hex = "unicode", 0
            elif c in ESCAPES:
                self._state = "string"
            else:
                raise self._error(c, f"one of {ESCAPES} or u after a backslash")
            self._keep(c)
        elif state == "unicode":
            if c not in HEX:
                raise self._error(c, "a hexadecimal digit")
            self._keep(c)
            self._hex += 1
            if self._hex == 4:
                self._state = "string"
        elif state == "number":
            nxt = _NUMBER[self._number].get(_number_class(c))
            if nxt is not None:
                self._number = nxt
                return
            if self._number not in NUMBER_ENDS:
                raise self._error(c, "the rest of a number")
            self._end(events, self.pos)
            self._step(c, events)  # the character after the number
        elif state == "literal":
            if c != self._word[self._matched]:
                raise self._error(c, repr(self._word))
            self._matched += 1
            if self._matched == len(self._word):
                self._end(events, self.pos + 1)
        elif c in WS:
            return
        elif state == "top":
            if c not in "{[":
                raise self._error(c, "'{' or '['")
            self._open(c, events)
        elif state == "value":
            self._value(c, events)
        elif state == "value_or_close":
            if c == "]":
                self._close(events)
            else:
                self._value(c, events)
        elif state in ("key_or_close", "key"):
            if c == '"':
                self._state, self._is_key, self._key = "string", True, []
            elif c == "}" and state == "key_or_close":
                self._close(events)
            else:
                raise self._error(c, "a key in double quotes" + (" or '}'" if state == "key_or_close" else ""))
        elif state == "colon":
            if c != ":":
                raise self._error(c, "':'")
            self._state = "value"
        elif state == "after":
            top = self._stack[-1]
            if c == ",":
                self._state = "key" if top == "{" else "value"
            elif (c == "}" and top == "{") or (c == "]" and top == "["):
                self._close(events)
            else:
                raise self._error(c, "',' or '" + ("}" if top == "{" else "]") + "'")
        else:
            raise self._error(c, "nothing more")

    def _keep(self, c: str) -> None:
        if self._is_key:
            self._key.append(c)

    def _open(self, c: str, events: list[tuple]) -> None:
        self._start(events)
        self._stack.append(c)
        self._state = "key_or_close" if c == "{" else "value_or_close"

    def _value(self, c: str, events: list[tuple]) -> None:
        if c in "{[":
            self._open(c, events)
        elif c == '"':
            self._start(events)
            self._state, self._is_key = "string", False
        elif c == "-" or c in DIGITS:
            self._start(events)
            self._state, self._number = "number", _NUMBER["start"][_number_class(c)]
        elif c in LITERALS:
            self._start(events)
            self._state, self._word, self._matched = "literal", LITERALS[c], 1
        else:
            raise self._error(c, "a JSON value")

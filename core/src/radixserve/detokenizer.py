"""Incremental detokenisation and stop-string matching, O(new text) per token.

:class:`IncrementalDetokenizer` decodes only a window of recent ids, so each step costs
O(window) instead of re-decoding the whole output. Text becomes final only when the
window decodes without a trailing replacement character (a multi-byte character split
across tokens), so ``text`` is always a prefix of the full output's decoding. With stop
strings, the last ``max(len(stop)) - 1`` characters are held back from :meth:`delta`
until the request ends, so a stream never shows the start of a stop string that will be
trimmed later.

:class:`StopStringMatcher` (the scheduler's) feeds one token at a time and searches only
the text that became final in this step, plus the ``max(len(stop)) - 1`` characters
before it, so a stop string is found wherever it starts, also inside a token longer than
the stop string, at O(new text) per step. It also takes ``stop_regex`` patterns: a
match must end in the new text; the search starts the pattern's widest match before it
(the whole text for a pattern without a bound on its width).
"""

from __future__ import annotations

import re


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 stop_regex: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # decoded text that is final (no partial character at its end)
        self._prefix_offset = 0  # window start: context so the next ids decode the same as in full
        self._read_offset = 0  # ids up to here are in ``text``
        self._hold = max((len(s) for s in stop or ()), default=1) - 1
        if stop_regex:  # a bounded pattern's widest match; an unbounded one holds nothing back
            from radixserve.sampling.params import regex_width

            widths = [w for p in stop_regex if (w := regex_width(p)[1]) is not None]
            self._hold = max([self._hold, *(w - 1 for w in widths)])
        self.sent = 0  # characters already released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> None:
        if not new_ids:
            return
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)

    def delta(self) -> str:
        """Text that became final since the last call (holding back a possible stop prefix)."""
        limit = len(self.text) - self._hold
        if limit <= self.sent:
            return ""
        out = self.text[self.sent:limit]
        self.sent = limit
        return out

    def finish(self, final_text: str | None = None) -> str:
        """The rest of the text once the request ended. ``final_text`` is the engine's
        output with a matched stop string trimmed, when there was one."""
        full = final_text if final_text is not None else self._decode(self.ids)
        out = full[self.sent:]
        self.sent = len(full)
        self.text = full
        return out


class StopStringMatcher:
    """Finds the first stop string in a request's output as tokens arrive.

    :meth:`add` returns ``(position, stop_string)`` of the earliest stop string that occurs
    in the final text once this token is added (``None`` if none does). Occurrences that
    lie wholly in text that was final before the token were reported (or ignored, while
    ``min_new_tokens`` held the check back) by earlier calls, so only the new text and the
    ``max(len(stop)) - 1`` characters before it are searched.
    """

    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True,
                 stop_regex: list[str] = ()) -> None:
        from radixserve.sampling.params import regex_width

        self.stop = list(stop)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._overlap = max((len(s) for s in self.stop), default=1) - 1
        # (compiled pattern, characters before the new text to search again; None: all)
        self.regex = [(re.compile(p), None if (w := regex_width(p)[1]) is None else w - 1) for p in stop_regex]

    @property
    def text(self) -> str:
        return self.detok.text

    def add(self, token: int, check: bool = True) -> tuple[int, str] | None:
        before = len(self.detok.text)
        self.detok.add([token])
        text = self.detok.text
        if not check or len(text) == before:
            return None
        start = max(0, before - self._overlap)
        best: tuple[int, str] | None = None
        for s in self.stop:
            pos = text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        for pattern, back in self.regex:
            for m in pattern.finditer(text, 0 if back is None else max(0, before - back)):
                if m.end() > before:  # a match wholly in older text was seen (or held back) before
                    if best is None or m.start() < best[0]:
                        best = (m.start(), pattern.pattern)
                    break
        return best

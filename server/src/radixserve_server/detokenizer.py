"""Incremental detokenisation of a request's output, safe across multi-byte characters.

Decoding only a window of recent ids keeps each step O(window) instead of re-decoding
the whole output. Text is released only when the window decodes without a trailing
replacement character (a multi-byte character split across tokens). With stop strings,
the last ``max(len(stop)) - 1`` characters are held back until the request ends, so a
stream never shows the beginning of a stop string that will later be trimmed.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # decoded text that is final (no partial character at its end)
        self._prefix_offset = 0  # window start: context so the next ids decode the same as in full
        self._read_offset = 0  # ids up to here are in ``text``
        self._hold = max((len(s) for s in stop or ()), default=1) - 1
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

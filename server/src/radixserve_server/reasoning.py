"""Chat replies of reasoning models: ``<think>…</think>`` becomes ``reasoning_content``
(``--reasoning-parser deepseek-r1|qwen3``), the rest ``content``.

Where a reply starts (inside the reasoning, past it, or before it with the option of
opening a think block) is decided from the prompt's tokens exactly as the engine decides
it for structured output (:mod:`radixserve.reasoning`); the text is then split here.

* inside: everything up to the first ``</think>`` is reasoning (an opening ``<think>``
  the model repeats first is dropped); a reply cut before ``</think>`` is all reasoning;
* before (``qwen3`` without a marker in the prompt): a reply that opens with ``<think>``
  (after optional whitespace) reasons until ``</think>``; any other reply is all content;
* past (the prompt closed the think block, e.g. Qwen3 with ``enable_thinking: false``):
  all content.

The markers themselves belong to neither part; the text between them is kept as it is
(no stripping), so reasoning + content is the reply minus its markers.

Streaming (:class:`ReasoningSplitter`) holds back text that may still turn out to be part
of a marker, so the streamed reasoning deltas joined equal the non-streamed
``reasoning_content``, and likewise for ``content``, however the text is chunked. Request
fields (SGLang's): ``separate_reasoning`` (default true; false leaves the reply untouched
in ``content``) and ``stream_reasoning`` (default true; false holds the reasoning back and
sends it in one delta when ``</think>`` arrives, or at the end of a reply cut short).
"""

from __future__ import annotations

from typing import Any

from radixserve.reasoning import BEFORE, INSIDE, PAST, THINK_END, THINK_START, ReasoningSpec


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    """One reply's text, fed in pieces, split into (reasoning, content) pieces."""

    def __init__(self, state: str, start: str = THINK_START, end: str = THINK_END,
                 stream_reasoning: bool = True) -> None:
        if state not in (BEFORE, INSIDE, PAST):
            raise ValueError(f"unknown reasoning state {state!r}")
        self.state = state
        self.start, self.end = start, end
        self.stream_reasoning = stream_reasoning
        self._buf = ""  # text not yet handed out
        self._opening = state == INSIDE  # a repeated opening marker may still come
        self._held = ""  # reasoning kept back (stream_reasoning false)

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that ``text`` settles; either may be empty."""
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """Whatever was held back, at the end of the reply."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf = self._buf
            if self.state == BEFORE:
                head = buf.lstrip()
                if head.startswith(self.start):
                    self._buf, self.state, self._opening = head[len(self.start):], INSIDE, True
                    continue
                if not final and self.start.startswith(head):  # whitespace, or the marker's beginning
                    break
                self.state = PAST
                continue
            if self.state == INSIDE:
                if self._opening:
                    if buf.startswith(self.start):
                        self._buf = buf[len(self.start):]
                        continue
                    if not final and self.start.startswith(buf):
                        break
                    self._opening = False
                at = buf.find(self.end)
                if at >= 0:
                    reasoning.append(buf[:at])
                    self._buf, self.state = buf[at + len(self.end):], PAST
                    continue
                keep = 0 if final else _partial_suffix(buf, self.end)
                reasoning.append(buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                break
            content.append(buf)
            self._buf = ""
            break
        text = "".join(reasoning)
        if not self.stream_reasoning and self.state == INSIDE and not final:
            self._held += text
            text = ""
        else:
            text, self._held = self._held + text, ""
        return text, "".join(content)


def split_reasoning(text: str, start_state: str, spec: ReasoningSpec | None = None) -> tuple[str, str]:
    """A whole reply's (reasoning, content)."""
    s = ReasoningSplitter(start_state, *((spec.start_text, spec.end_text) if spec else ()))
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2


class ChatReasoning:
    """The reasoning split of one chat request (all its choices start alike: one prompt)."""

    def __init__(self, spec: ReasoningSpec, prompt_ids: list[int], stream_reasoning: bool) -> None:
        self.spec = spec
        self.start_state = spec.initial_state(prompt_ids)
        self.stream_reasoning = stream_reasoning

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.start_state, self.spec.start_text, self.spec.end_text, self.stream_reasoning)

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of a whole reply: ``reasoning_content`` null when there is
        none, ``content`` null when the whole reply was reasoning (as SGLang)."""
        reasoning, content = split_reasoning(text, self.start_state, self.spec)
        return {"role": "assistant", "content": content if content or not reasoning else None,
                "reasoning_content": reasoning or None}


def chat_reasoning(spec: ReasoningSpec | None, body, prompt_ids: list[int]) -> ChatReasoning | None:
    """The split for a chat request, or None when there is none (no ``--reasoning-parser``,
    or ``separate_reasoning: false``)."""
    if spec is None or not body.separate_reasoning:
        return None
    return ChatReasoning(spec, prompt_ids, body.stream_reasoning)


class StreamSplit:
    """Streaming: one splitter per choice; ``delta(index, text, finished)`` gives the
    ``delta`` fields (``reasoning_content`` and/or ``content``) of one engine update. The
    ``content`` part is what a later stage (the tool-call parser) should see."""

    def __init__(self, reasoning: ChatReasoning | None, num_choices: int) -> None:
        self.splitters = [reasoning.splitter() for _ in range(num_choices)] if reasoning else None

    def parts(self, index: int, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) settled by this update of choice ``index``."""
        if self.splitters is None:
            return "", text
        s = self.splitters[index]
        reasoning, content = s.feed(text)
        if finished:
            r, c = s.finish()
            reasoning, content = reasoning + r, content + c
        return reasoning, content

"""The reasoning split of chat replies (``--reasoning-parser deepseek-r1|qwen3``) on recorded
outputs of those models: whole replies, and the same replies streamed in random pieces,
which must join to the same reasoning and content."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from radixserve.reasoning import BEFORE, INSIDE, PAST, ReasoningSpec
from radixserve_server.reasoning import (
    ChatReasoning,
    ReasoningSplitter,
    StreamSplit,
    chat_reasoning,
    split_reasoning,
)

START_ID, END_ID, IM_START, IM_END = 10, 11, 20, 21
QWEN3 = ReasoningSpec("qwen3", START_ID, END_ID, frozenset({IM_START, IM_END}))
DEEPSEEK = ReasoningSpec("deepseek-r1", START_ID, END_ID, frozenset({IM_START, IM_END}))

# (parser's start state, reply, expected reasoning, expected content)
RECORDED = [
    # Qwen3, thinking (its template leaves the prompt at "<|im_start|>assistant\n")
    (BEFORE, "<think>\nOkay, the user asks for 2 + 2. That is 4.\n</think>\n\nThe answer is **4**.",
     "\nOkay, the user asks for 2 + 2. That is 4.\n", "\n\nThe answer is **4**."),
    # Qwen3 with enable_thinking false: the prompt closed an empty think block
    (PAST, "The answer is **4**.", "", "The answer is **4**."),
    # ... and a reply that writes a think tag anyway stays content
    (PAST, "<think>x</think>y", "", "<think>x</think>y"),
    # Qwen3 answering without thinking: all content, tags inside it included
    (BEFORE, "Use <think> and </think> to mark reasoning.", "", "Use <think> and </think> to mark reasoning."),
    (BEFORE, "", "", ""),
    (BEFORE, "\n\n", "", "\n\n"),
    (BEFORE, "<thin", "", "<thin"),  # cut inside a would-be marker: content
    # leading whitespace before the opening tag is dropped
    (BEFORE, "\n<think>why</think>so", "why", "so"),
    # Qwen3 cut by max_tokens while thinking: all reasoning
    (BEFORE, "<think>\nLet me work through this step by step. First, 17 is", "\nLet me work through this step by step. "
     "First, 17 is", ""),
    (BEFORE, "<think>\nalmost done</thi", "\nalmost done</thi", ""),
    # Qwen3 thinking then a tool call (the tool parser gets the content)
    (BEFORE, '<think>\nI should look up the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
     '"arguments": {"city": "Paris"}}\n</tool_call>', "\nI should look up the weather.\n",
     '\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    # only the first </think> ends the reasoning
    (BEFORE, "<think>a</think>b</think>c", "a", "b</think>c"),
    (BEFORE, "<think></think>\n\nHi!", "", "\n\nHi!"),
    # DeepSeek-R1: the prompt ends with "<think>\n", the reply has no opening tag
    (INSIDE, "Okay, so I need to add 2 and 2.\nThat makes 4.\n</think>\n\nThe sum of 2 and 2 is **4**.",
     "Okay, so I need to add 2 and 2.\nThat makes 4.\n", "\n\nThe sum of 2 and 2 is **4**."),
    # DeepSeek-R1-0528 repeats the opening tag
    (INSIDE, "<think>\nHmm, 2 + 2.\n</think>\n4", "\nHmm, 2 + 2.\n", "\n4"),
    (INSIDE, "<think><think>x</think>y", "x", "y"),
    # DeepSeek-R1 cut while thinking
    (INSIDE, "Wait, maybe I should reconsider the <", "Wait, maybe I should reconsider the <", ""),
    (INSIDE, "", "", ""),
    (INSIDE, "<think>", "", ""),
    (INSIDE, "</think>", "", ""),
    (INSIDE, "</think>Only an answer.", "", "Only an answer."),
    (INSIDE, "a < b and c </ d </thinking> </think>e", "a < b and c </ d </thinking> ", "e"),
]


@pytest.mark.parametrize("start, text, reasoning, content", RECORDED)
def test_recorded_replies_split(start, text, reasoning, content):
    assert split_reasoning(text, start) == (reasoning, content)


def _stream(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[list[str], list[str]]:
    rs, cs = [], []
    for piece in pieces:
        r, c = splitter.feed(piece)
        rs.append(r)
        cs.append(c)
    r, c = splitter.finish()
    return rs + [r], cs + [c]


def _random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_streamed_pieces_join_to_the_whole_split(stream_reasoning):
    rng = random.Random(0)
    for start, text, reasoning, content in RECORDED:
        for _ in range(30):
            pieces = _random_pieces(text, rng)
            rs, cs = _stream(ReasoningSplitter(start, stream_reasoning=stream_reasoning), pieces)
            assert ("".join(rs), "".join(cs)) == (reasoning, content), (text, pieces)
        rs, cs = _stream(ReasoningSplitter(start, stream_reasoning=stream_reasoning), list(text))
        assert ("".join(rs), "".join(cs)) == (reasoning, content)  # one character at a time


def test_partial_markers_are_held_back_then_released():
    s = ReasoningSplitter(BEFORE)
    assert s.feed("<th") == ("", "")
    assert s.feed("ink>abc</") == ("abc", "")
    assert s.feed("thi") == ("", "")
    assert s.feed("nk>\n\nHi") == ("", "\n\nHi")
    s = ReasoningSplitter(INSIDE)
    assert s.feed("x </b") == ("x </b", "")  # not a possible beginning of </think>
    assert s.feed("</thx") == ("</thx", "")


def test_stream_reasoning_false_sends_the_reasoning_at_once():
    """SGLang's stream_reasoning false: the reasoning is held back and sent whole when
    </think> comes (with the content after it), or at the end of a reply cut short."""
    s = ReasoningSplitter(BEFORE, stream_reasoning=False)
    assert s.feed("<think>one ") == ("", "")
    assert s.feed("two") == ("", "")
    assert s.feed(" three</think>An") == ("one two three", "An")
    assert s.feed("swer") == ("", "swer")
    s = ReasoningSplitter(INSIDE, stream_reasoning=False)
    assert s.feed("cut ") == ("", "")
    assert s.feed("short") == ("", "")
    assert s.finish() == ("cut short", "")


def test_start_state_from_the_prompt_tokens():
    words = [1, 2, 3]
    thinking = [IM_START, *words, IM_END, IM_START, 4]  # "<|im_start|>user ...<|im_end|><|im_start|>assistant"
    assert QWEN3.initial_state(thinking) == BEFORE
    assert DEEPSEEK.initial_state(thinking) == INSIDE
    assert QWEN3.initial_state(thinking + [START_ID, END_ID]) == PAST  # enable_thinking false
    assert DEEPSEEK.initial_state(thinking + [START_ID]) == INSIDE  # DeepSeek-R1's "<think>\n"
    assert QWEN3.initial_state(thinking + [START_ID, 5, 6]) == INSIDE  # a continued think block
    # an earlier turn's think block does not decide this one: the search stops at a turn's end
    history = [IM_START, 4, START_ID, 5, END_ID, 6, IM_END, IM_START, 1, IM_END, IM_START, 4]
    assert QWEN3.initial_state(history) == BEFORE
    assert DEEPSEEK.initial_state(history) == INSIDE


def test_chat_message_and_stream_fields():
    body = SimpleNamespace(separate_reasoning=True, stream_reasoning=True)
    prompt = [IM_START, 4]
    reasoning = chat_reasoning(QWEN3, body, prompt)
    assert isinstance(reasoning, ChatReasoning)
    assert reasoning.message("<think>a</think>b") == {"role": "assistant", "content": "b", "reasoning_content": "a"}
    assert reasoning.message("b") == {"role": "assistant", "content": "b", "reasoning_content": None}
    assert reasoning.message("<think>cut") == {"role": "assistant", "content": None, "reasoning_content": "cut"}
    assert reasoning.message("") == {"role": "assistant", "content": "", "reasoning_content": None}
    assert chat_reasoning(None, body, prompt) is None  # no --reasoning-parser
    assert chat_reasoning(QWEN3, SimpleNamespace(separate_reasoning=False, stream_reasoning=True), prompt) is None
    split = StreamSplit(reasoning, 2)  # one splitter per choice
    assert split.parts(0, "<think>x", False) == ("x", "")
    assert split.parts(1, "y", False) == ("", "y")
    assert split.parts(0, "</th", False) == ("", "")
    assert split.parts(0, "", True) == ("</th", "")  # the end releases what was held back
    assert StreamSplit(None, 1).parts(0, "<think>z", False) == ("", "<think>z")

"""``--reasoning-parser``: the flag, the think tokens it needs, where a request's output
starts (from its prompt under Qwen3's real chat template), and structured output applying
after the reasoning part, in the matcher wrapper and in the engine on a tiny Qwen3 whose
greedy output thinks (:mod:`tiny_reasoning`)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import radixserve
import torch
from radixserve.config import ConfigError, ServerArgs
from radixserve.grammar import allocate_token_bitmask
from radixserve.reasoning import BEFORE, INSIDE, PAST, ReasoningMatcher, build_reasoning_spec
from radixserve.testing.forced_grammar import ForcedMatcher
from radixserve.tokenizer import load_tokenizer
from tiny_models import build_checkpoint
from tiny_reasoning import ANSWER, THOUGHT, build_reasoning_checkpoint

ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
                 "required": ["answer"], "additionalProperties": False}
USER = [{"role": "user", "content": "how are you"}]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_qwen3_reasoning"))
    build_reasoning_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def tok(ckpt):
    return load_tokenizer(ckpt)


@pytest.fixture(scope="module")
def prompts(tok) -> dict[str, list[int]]:
    """Qwen3's template: thinking leaves the prompt at the assistant header; enable_thinking
    false pre-fills an empty think block."""
    thinking = tok.apply_chat_template(USER, add_generation_prompt=True)
    plain = tok.apply_chat_template(USER, add_generation_prompt=True, enable_thinking=False)
    assert thinking.endswith("<|im_start|>assistant\n")
    assert plain == thinking + "<think>\n\n</think>\n\n"
    return {k: tok.encode(v, add_special_tokens=False) for k, v in (("thinking", thinking), ("plain", plain))}


def _engine(ckpt, **kw):
    return radixserve.Engine(ckpt, dtype="float32", max_total_tokens=1024, num_threads=1, **kw)


# ------------------------------------------------------------------ the flag
def test_flag_values_and_tokenizers_without_think_tokens(tmp_path, tok):
    assert ServerArgs(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ConfigError, match=r"--reasoning-parser: invalid value 'qwen'; choose from: deepseek-r1, qwen3"):
        ServerArgs(reasoning_parser="qwen")
    assert build_reasoning_spec(None, tok.hf) is None
    spec = build_reasoning_spec("qwen3", tok.hf)
    assert tok.hf.convert_ids_to_tokens([spec.start_id, spec.end_id]) == ["<think>", "</think>"]
    assert tok.hf.convert_tokens_to_ids("<|im_end|>") in spec.boundary_ids
    # a model whose vocabulary has no think tokens is refused at start-up, before its weights load
    build_checkpoint(str(tmp_path), "llama")
    with pytest.raises(ConfigError, match=r"--reasoning-parser qwen3: this model's tokenizer has no single "
                                          r"'<think>' token \(it encodes as an unknown word\)"):
        radixserve.Engine(str(tmp_path), reasoning_parser="qwen3", max_total_tokens=256)


def test_start_state_from_qwen3_prompts(tok, prompts):
    qwen3, deepseek = build_reasoning_spec("qwen3", tok.hf), build_reasoning_spec("deepseek-r1", tok.hf)
    assert qwen3.initial_state(prompts["thinking"]) == BEFORE
    assert qwen3.initial_state(prompts["plain"]) == PAST
    assert deepseek.initial_state(prompts["thinking"]) == INSIDE
    # after a tool call the template keeps the reply's think block; it is behind a turn boundary
    history = USER + [{"role": "assistant", "content": "", "reasoning_content": "x",
                       "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                      {"role": "tool", "content": "42"}]
    second = tok.encode(tok.apply_chat_template(history, add_generation_prompt=True), add_special_tokens=False)
    assert qwen3.end_id in second and qwen3.initial_state(second) == BEFORE
    # continuing an assistant message that opened a think block
    cont = tok.apply_chat_template(USER, add_generation_prompt=True) + "<think>\nhmm"
    assert qwen3.initial_state(tok.encode(cont, add_special_tokens=False)) == INSIDE


# ------------------------------------------------------------- the matcher
START, END, EOS = 5, 6, 2
GRAMMAR = [40, 41]  # the inner grammar forces these, then EOS


def _spec():
    from radixserve.reasoning import ReasoningSpec

    return ReasoningSpec("qwen3", START, END, frozenset())


def _allowed(m: ReasoningMatcher) -> set[int]:
    mask = allocate_token_bitmask(1, 64)
    m.fill_bitmask(mask, 0)
    bits = ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    return set(torch.nonzero(bits).flatten().tolist())


def test_matcher_masks_nothing_while_reasoning():
    m = ReasoningMatcher(ForcedMatcher(GRAMMAR, [EOS]), _spec(), BEFORE)
    assert _allowed(m) == {GRAMMAR[0], START}  # the grammar's first token, or opening a think block
    assert m.accept_token(START) and m.state == INSIDE
    assert len(_allowed(m)) == 64 and not m.is_terminated()
    for tok in (30, 31, START, 32):  # free text; the grammar sees none of it
        assert m.accept_token(tok)
    assert m.inner.pos == 0
    assert m.accept_token(END) and m.state == PAST
    assert _allowed(m) == {GRAMMAR[0]}
    assert not m.accept_token(30) and m.state == PAST  # the grammar's rules from here on
    for tok in GRAMMAR + [EOS]:
        assert m.accept_token(tok)
    assert m.is_terminated()
    # no think block: the first token is the grammar's and it applies from there
    m = ReasoningMatcher(ForcedMatcher(GRAMMAR, [EOS]), _spec(), BEFORE)
    assert m.accept_token(GRAMMAR[0]) and m.state == PAST and _allowed(m) == {GRAMMAR[1]}
    assert not m.accept_token(START)
    # started inside (a prompt ending in <think>); past (enable_thinking false)
    m = ReasoningMatcher(ForcedMatcher(GRAMMAR, [EOS]), _spec(), INSIDE)
    assert len(_allowed(m)) == 64 and m.accept_token(GRAMMAR[1]) and m.inner.pos == 0
    m = ReasoningMatcher(ForcedMatcher(GRAMMAR, [EOS]), _spec(), PAST)
    assert _allowed(m) == {GRAMMAR[0]}


def test_matcher_rollback_across_the_think_end():
    """Speculative decoding's tree masks accept a draft path, fill, and roll back."""
    m = ReasoningMatcher(ForcedMatcher(GRAMMAR, [EOS]), _spec(), BEFORE)
    for tok in (START, 30):
        assert m.accept_token(tok)
    path = [31, END, GRAMMAR[0]]
    for tok in path:
        assert m.accept_token(tok)
    assert m.state == PAST and m.inner.pos == 1
    m.rollback(len(path))
    assert m.state == INSIDE and m.inner.pos == 0 and len(_allowed(m)) == 64
    m.rollback(2)
    assert m.state == BEFORE and _allowed(m) == {GRAMMAR[0], START}
    for tok in (START, END, *GRAMMAR):
        assert m.accept_token(tok)
    m.rollback(1)
    assert m.state == PAST and m.inner.pos == 1


# -------------------------------------------------------------- the engine
def _greedy(eng, ids, **params):
    return eng.generate(input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": 40, **params})


@pytest.mark.parametrize("parser", ["qwen3", "deepseek-r1"])
def test_structured_output_applies_after_the_reasoning(ckpt, prompts, parser):
    schema = json.dumps(ANSWER_SCHEMA)
    with _engine(ckpt, reasoning_parser=parser) as eng:
        free = _greedy(eng, prompts["thinking"])
        assert free["text"] == f"<think>{THOUGHT}</think>{ANSWER}"
        out = _greedy(eng, prompts["thinking"], json_schema=schema)
        thought, sep, answer = out["text"].partition("</think>")
        # the reasoning is the model's own free text, unmasked; the grammar starts after </think>
        assert sep and thought == f"<think>{THOUGHT}", out["text"]
        jsonschema.validate(json.loads(answer), ANSWER_SCHEMA)
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        assert out["output_ids"][:5] == free["output_ids"][:5]  # <think> hmm so ok </think>
        # enable_thinking false: the prompt closed the think block, the grammar applies at once
        out = _greedy(eng, prompts["plain"], json_schema=schema)
        jsonschema.validate(json.loads(out["text"]), ANSWER_SCHEMA)
        # a regex and an EBNF grammar too
        out = _greedy(eng, prompts["thinking"], regex="(yes|no)")
        assert out["text"].startswith(f"<think>{THOUGHT}</think>") and out["text"].split("</think>")[1] in ("yes", "no")


def test_without_the_parser_the_grammar_applies_from_the_first_token(ckpt, prompts):
    with _engine(ckpt) as eng:
        out = _greedy(eng, prompts["thinking"], json_schema=json.dumps(ANSWER_SCHEMA))
        jsonschema.validate(json.loads(out["text"]), ANSWER_SCHEMA)

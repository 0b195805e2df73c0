"""``--reasoning-parser qwen3`` over HTTP on a tiny Qwen3 whose greedy reply thinks
(:mod:`tiny_reasoning`: Qwen3's real chat template; ``<think>hmmsook</think>finethanks``):
``reasoning_content`` in the message and in streamed deltas, ``enable_thinking``,
``separate_reasoning`` / ``stream_reasoning``, structured output after the reasoning,
400s naming the field, and the start-up refusal for a model without think tokens."""

from __future__ import annotations

import json
import os
import sys

import jsonschema
import pytest
from serverproc import start_server

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from tiny_models import build_checkpoint  # noqa: E402  (the repository's shared test checkpoints)
from tiny_reasoning import ANSWER, THOUGHT, build_reasoning_checkpoint  # noqa: E402

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
ASK = {"messages": [{"role": "user", "content": "how are you"}], "temperature": 0, "max_tokens": 30}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
JSON_REPLY = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_qwen3_reasoning_http"))
    build_reasoning_checkpoint(path)
    server = start_server("--model", path, "--dtype", "float32", "--reasoning-parser", "qwen3", "--num-threads", "1")
    yield server
    code = server.stop()
    assert code == 0, f"server exited with {code}:\n{server.log()}"


def chat(sp, **extra) -> dict:
    with sp.client() as c:
        r = c.post("/v1/chat/completions", json={**ASK, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def streamed(sp, **extra) -> tuple[list[str], list[str], list[dict]]:
    """(reasoning deltas, content deltas, every delta) of a one-choice stream."""
    reasoning, content, deltas = [], [], []
    with sp.client() as c, c.stream("POST", "/v1/chat/completions", json={**ASK, **extra, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for ch in event["choices"]:
                deltas.append(ch["delta"])
                if ch["delta"].get("reasoning_content"):
                    reasoning.append(ch["delta"]["reasoning_content"])
                if ch["delta"].get("content"):
                    content.append(ch["delta"]["content"])
    return reasoning, content, deltas


def test_thinking_reply_is_split(sp):
    out = chat(sp)
    message = out["choices"][0]["message"]
    assert message == {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    assert out["choices"][0]["finish_reason"] == "stop"
    reasoning, content, deltas = streamed(sp)
    assert "".join(reasoning) == THOUGHT and "".join(content) == ANSWER
    assert not any("<think>" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)
    # stream_reasoning false: the reasoning arrives in one delta, once </think> has come
    reasoning, content, _ = streamed(sp, stream_reasoning=False)
    assert reasoning == [THOUGHT] and "".join(content) == ANSWER
    # separate_reasoning false: the reply untouched, in content
    message = chat(sp, separate_reasoning=False)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": f"<think>{THOUGHT}</think>{ANSWER}"}
    reasoning, content, _ = streamed(sp, separate_reasoning=False)
    assert reasoning == [] and "".join(content) == f"<think>{THOUGHT}</think>{ANSWER}"


def test_enable_thinking_false_passes_to_the_template(sp):
    thinking = chat(sp)
    out = chat(sp, **NO_THINKING)
    assert out["choices"][0]["message"] == {"role": "assistant", "content": ANSWER, "reasoning_content": None}
    # Qwen3's template pre-filled "<think>\n\n</think>\n\n": two more prompt tokens
    assert out["usage"]["prompt_tokens"] == thinking["usage"]["prompt_tokens"] + 2
    reasoning, content, _ = streamed(sp, **NO_THINKING)
    assert reasoning == [] and "".join(content) == ANSWER


def test_a_reply_cut_while_thinking_is_all_reasoning(sp):
    out = chat(sp, max_tokens=3)
    assert out["choices"][0]["message"] == {"role": "assistant", "content": None, "reasoning_content": "hmmso"}
    assert out["choices"][0]["finish_reason"] == "length"
    reasoning, content, _ = streamed(sp, max_tokens=3)
    assert "".join(reasoning) == "hmmso" and content == []


def test_structured_output_applies_after_the_reasoning(sp):
    out = chat(sp, **JSON_REPLY, n=2)
    for choice in out["choices"]:
        assert choice["message"]["reasoning_content"] == THOUGHT
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    reasoning, content, _ = streamed(sp, **JSON_REPLY)
    assert "".join(reasoning) == THOUGHT and "".join(content) == out["choices"][0]["message"]["content"]
    out = chat(sp, **JSON_REPLY, **NO_THINKING)
    assert out["choices"][0]["message"]["reasoning_content"] is None
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), SCHEMA)


@pytest.mark.parametrize("extra, param", [
    ({"separate_reasoning": "yes"}, "separate_reasoning"),
    ({"stream_reasoning": 1}, "stream_reasoning"),
    ({"chat_template_kwargs": {"enable_thinking": "false"}}, "chat_template_kwargs.enable_thinking"),
])
def test_invalid_values_name_the_field(sp, extra, param):
    with sp.client() as c:
        r = c.post("/v1/chat/completions", json={**ASK, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_model_without_think_tokens_is_refused_at_start_up(tmp_path):
    build_checkpoint(str(tmp_path), "llama")
    with pytest.raises(RuntimeError) as e:
        start_server("--model", str(tmp_path), "--reasoning-parser", "qwen3")
    assert "exited with 2" in str(e.value)
    assert "--reasoning-parser qwen3: this model's tokenizer has no single '<think>' token" in str(e.value)

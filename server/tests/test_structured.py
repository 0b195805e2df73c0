"""Structured output over HTTP: response_format, the native constraint fields, bad grammars."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import openai
import pytest
from radixserve.testing import grammar_conformance as gc
from serverproc import API_KEY

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def test_response_format_json_schema(oai, idle_after):
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        temperature=0.7, seed=3, n=3, max_tokens=60)
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.finish_reason == "stop"
    # the text-completions endpoint takes response_format too
    r = oai.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=60, temperature=0.7,
                               seed=4, n=2, extra_body={"response_format": {
                                   "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}})
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_response_format_streamed(oai, idle_after):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "A person, as JSON."}], temperature=0,
              max_tokens=60, response_format={"type": "json_schema",
                                              "json_schema": {"name": "person", "schema": PERSON}})
    stream = oai.chat.completions.create(stream=True, **kw)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    assert text == oai.chat.completions.create(**kw).choices[0].message.content
    # json_object: any JSON object (may run out of tokens here, but starts as one)
    r = oai.chat.completions.create(model=MODEL, messages=kw["messages"], max_tokens=4,
                                    response_format={"type": "json_object"})
    assert r.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("case", gc.RUNAWAYS, ids=[c[0] for c in gc.RUNAWAYS])
def test_runaway_response_formats_end(oai, idle_after, case):
    """Prompts that make the model loop inside a string, an array or an object still end
    by the grammar under the default --constrained-json-max-* bounds, as valid JSON."""
    name, instruction, schema = case
    rf = ({"type": "json_object"} if name == "json_object"
          else {"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": instruction}],
                                    response_format=rf, temperature=0, max_tokens=gc.RUNAWAY_MAX_NEW_TOKENS)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert r.usage.completion_tokens < gc.RUNAWAY_MAX_NEW_TOKENS
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_native_regex_and_ebnf(server, idle_after):
    with server.client() as c:
        out = c.post("/generate", json={"text": "Is the sky blue? Answer:", "sampling_params": {
            "regex": r" (yes|no)\.", "max_new_tokens": 10, "temperature": 0.7}}).json()
        assert re.fullmatch(r" (yes|no)\.", out["text"]), out
        grammar = 'root ::= "(" digit "+" digit ")"\ndigit ::= [0-9]'
        out = c.post("/generate", json={"text": "An arithmetic expression:", "sampling_params": {
            "ebnf": grammar, "max_new_tokens": 10, "temperature": 0.7}}).json()
        assert re.fullmatch(r"\(\d\+\d\)", out["text"]), out


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties": {
            "a": {"type": "no-such-type"}}}}}},
    {"messages": [{"role": "user", "content": "x"}], "regex": "(unclosed"},
    {"messages": [{"role": "user", "content": "x"}], "ebnf": "root ::= ( missing"},
    {"messages": [{"role": "user", "content": "x"}], "regex": "a+", "stream": True, "json_schema": "{}"},
    {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
])
def test_bad_constraints_are_400_and_neighbours_survive(server, body, idle_after):
    result = {}

    def neighbour():
        with server.client() as c:
            result["r"] = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0,
                                                          "ignore_eos": True})

    t = threading.Thread(target=neighbour)
    t.start()
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={**body, "max_tokens": 8})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error"
        # the same bad grammar again: answered from the cache of failures, still a 400
        assert c.post("/v1/chat/completions", json={**body, "max_tokens": 8}).status_code == 400
    t.join()
    assert result["r"].status_code == 200
    assert result["r"].json()["usage"]["completion_tokens"] == 8


def test_bad_stream_constraint_is_400_before_streaming(server, idle_after):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                 "regex": "[z-a]", "stream": True, "max_tokens": 4})
    assert r.status_code == 400 and "error" in r.json()

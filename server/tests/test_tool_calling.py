"""Tool calling over HTTP with the official client, on the default model (which never saw
tools): tool_choice named and required return calls whose arguments validate (the grammar
backend enforces them), streamed too; auto with --tool-call-parser hermes (the shared
server's); a full round trip; 400s naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from serverproc import API_KEY

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
       "required": ["a", "b"], "additionalProperties": False}
BOOK = {
    "type": "object",
    "properties": {
        "guests": {"type": "array", "items": {"$ref": "#/$defs/person"}, "minItems": 1, "maxItems": 2},
        "nights": {"type": "integer", "minimum": 1, "maximum": 14},
        "breakfast": {"type": "boolean"},
        "room": {"type": "object", "properties": {"kind": {"enum": ["single", "double"]}},
                 "required": ["kind"], "additionalProperties": False},
    },
    "required": ["guests", "nights", "breakfast", "room"],
    "additionalProperties": False,
    "$defs": {"person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                          "age": {"type": "integer", "minimum": 0}},
                         "required": ["name", "age"], "additionalProperties": False}},
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "book_hotel": BOOK}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"the {n} function", "parameters": s}}
         for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris? Also book a room for two nights for Ann."}]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(stream):
    """(content, [(name, arguments)], finish_reason) from a stream, checking that each call's
    first delta brings its id, type and name with empty arguments."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name, tc
                assert tc.function.arguments == "", tc
                calls[tc.index] = [tc.function.name, ""]
            else:
                assert tc.id is None and tc.function.name is None, tc
                calls[tc.index][1] += tc.function.arguments
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_named_tool_choice_returns_a_valid_call(oai, name, idle_after):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100, temperature=0.7,
                                    seed=7, tool_choice={"type": "function", "function": {"name": name}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls, (name,))


CONTACT = {"type": "object",
           "properties": {"to": {"type": "string", "format": "email"}, "site": {"type": "string", "format": "uri"},
                          "subject": {"type": "string", "maxLength": 40}},
           "required": ["to", "site", "subject"]}


def test_unbounded_formats_end_within_max_tokens(oai, idle_after):
    """Email and URI strings have no length limit in the schema (the grammar backends' own
    format regexes let a sampled small model wander inside them for thousands of tokens):
    the constraint's bounded patterns end the call well within max_tokens."""
    tools = [{"type": "function", "function": {"name": "send", "parameters": CONTACT}}]
    ask = [{"role": "user", "content": "Email bob@example.com the link to example.org"}]
    checker = jsonschema.Draft202012Validator(CONTACT, format_checker=jsonschema.FormatChecker())
    for choice_ in ({"type": "function", "function": {"name": "send"}}, "required"):
        r = oai.chat.completions.create(model=MODEL, messages=ask, tools=tools, tool_choice=choice_,
                                        temperature=1.0, seed=3, n=2, max_tokens=250)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls", choice
            for call in choice.message.tool_calls:
                checker.validate(json.loads(call.function.arguments))


def test_required_returns_valid_calls(oai, idle_after):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                    max_tokens=120, temperature=1.0, seed=1, n=2)
    for choice in r.choices:
        # a list of calls cut by max_tokens keeps the calls completed before the cut
        assert choice.finish_reason in ("tool_calls", "length")
        check_calls(choice.message.tool_calls)
        assert choice.message.content is None


def test_streamed_required_and_named_calls(oai, idle_after):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=100, temperature=0)
    content, calls, finish = streamed_calls(oai.chat.completions.create(stream=True, **kw))
    assert content == "" and finish == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0][1]), SCHEMAS[calls[0][0]])
    whole = oai.chat.completions.create(**kw).choices[0].message.tool_calls
    assert calls == [(c.function.name, c.function.arguments) for c in whole]
    named = {"type": "function", "function": {"name": "add"}}
    content, calls, finish = streamed_calls(oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=40, temperature=0, stream=True))
    assert finish == "tool_calls" and [n for n, _ in calls] == ["add"]
    jsonschema.validate(json.loads(calls[0][1]), ADD)


def test_auto_with_the_hermes_parser(oai, idle_after):
    """The model is steered into the hermes format with a regex (auto allows a constraint)."""
    said = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
            '\n</tool_call>')
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100, temperature=0,
              extra_body={"regex": re.escape(said)})
    r = oai.chat.completions.create(**kw)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "I will check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    content, calls, finish = streamed_calls(oai.chat.completions.create(stream=True, **kw))
    assert (content, calls, finish) == ("I will check.", [(c.function.name, c.function.arguments)
                                                          for c in message.tool_calls], "tool_calls")
    # a call naming an undeclared tool stays content
    bad = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    r = oai.chat.completions.create(**dict(kw, extra_body={"regex": re.escape(bad)}))
    assert r.choices[0].message.content == bad and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    # tool_choice none: never parsed
    r = oai.chat.completions.create(**dict(kw, tool_choice="none"))
    assert r.choices[0].message.content == said and r.choices[0].message.tool_calls is None


def test_full_round_trip(oai, idle_after):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS[:1], tool_choice="required",
                                        max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    check_calls([call], ("get_weather",))
    messages.append(first.choices[0].message)  # the client's own message object, content null
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"})
    second = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS[:1], max_tokens=40,
                                         temperature=0)
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")
    # the call and its result are in the prompt: it is longer than the question alone by them
    alone = oai.chat.completions.create(model=MODEL, messages=messages[:1], tools=TOOLS[:1], max_tokens=1)
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 20


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_fields_are_400s_naming_them(server, extra, param):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()

"""Tool calling without a server: every parser over recorded-style model outputs, whole and
streamed in random pieces; malformed calls fall back to content; request validation;
the constraint schemas of tool_choice required/named; the round trip through a template."""

from __future__ import annotations

import json
import random
import re

import pytest
from radixserve.grammar.bounds import BOUNDED_FORMATS
from radixserve_server.protocol import APIError, ChatCompletionRequest, parse
from radixserve_server.tool_calling import (
    ChoiceStreams,
    ToolCalling,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
    required_schema,
    tool_parser_names,
)
from radixserve_server.tool_calling.json_scan import JsonScanner, JsonSyntaxError
from radixserve_server.tool_calling.parsers import TOOL_PARSERS
from radixserve_server.tool_calling.request import bounded_for_generation

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
USER = [{"role": "user", "content": "Weather in Paris, and 1 + 2?"}]
PARIS = '{"city": "Paris", "unit": "celsius"}'
SUM = '{"a": 1, "b": 2.5}'

# parser -> [(model output, expected content, expected [(name, arguments)])]; arguments are
# compared as JSON text: the model's own text where the format is JSON
RECORDED = {
    "hermes": [
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>', None,
         [("get_weather", PARIS)]),
        (f'I will check both.\n<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>\n'
         f'<tool_call>\n{{"arguments": {SUM}, "name": "add"}}\n</tool_call>', "I will check both.",
         [("get_weather", PARIS), ("add", SUM)]),
        (f'<tool_call>{{"name": "add", "arguments": {SUM}}}</tool_call>\nDone, see above.', "\nDone, see above.",
         [("add", SUM)]),
        ('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>', None,
         [("add", '{"a": 1, "b": 2}')]),  # arguments given as a JSON string
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich \\"Z\\"", "x": [1, {"y": null}], '
         '"t": true, "n": -1.5e-3}}\n</tool_call>', None,
         [("get_weather", '{"city": "Z\\u00fcrich \\"Z\\"", "x": [1, {"y": null}], "t": true, "n": -1.5e-3}')]),
    ],
    "qwen25": [
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>', None,
         [("get_weather", PARIS)]),
    ],
    "llama3": [
        (f'<|python_tag|>{{"name": "get_weather", "parameters": {PARIS}}}', None, [("get_weather", PARIS)]),
        (f'{{"name": "get_weather", "parameters": {PARIS}}}; {{"name": "add", "parameters": {SUM}}}', None,
         [("get_weather", PARIS), ("add", SUM)]),
        (f'Let me look.<|python_tag|>{{"name": "add", "arguments": {SUM}}}', "Let me look.", [("add", SUM)]),
        ('\n {"name": "add", "parameters": {}}', None, [("add", "{}")]),
    ],
    "mistral": [
        (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {PARIS}}}]', None, [("get_weather", PARIS)]),
        (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}, {{"name": "add", "arguments": {SUM}}}]',
         None, [("get_weather", PARIS), ("add", SUM)]),
        (f'Sure.[TOOL_CALLS]get_weather[ARGS]{PARIS}[TOOL_CALLS]add[ARGS]{SUM}', "Sure.",
         [("get_weather", PARIS), ("add", SUM)]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", unit="celsius")]', None, [("get_weather", PARIS)]),
        ('[get_weather(city="Paris (France)", unit=\'celsius\'), add(a=1, b=-2.5)]', None,
         [("get_weather", '{"city": "Paris (France)", "unit": "celsius"}'), ("add", '{"a": 1, "b": -2.5}')]),
        ('<|python_start|>[add(a=1, b=2.5)]<|python_end|>', None, [("add", SUM)]),
        ('[get_weather(city="Oslo", extra={"days": [1, 2], "ok": True, "none": None})]', None,
         [("get_weather", '{"city": "Oslo", "extra": {"days": [1, 2], "ok": true, "none": null}}')]),
    ],
}

# outputs that are not (declared, well-formed) calls: all plain content, unchanged
MALFORMED = {
    "hermes": ['<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
               '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',
               "<tool_call>\nnot json at all\n</tool_call>",
               '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
               '<tool_call>{"arguments": {"a": 1}}</tool_call>',
               "Plain answer that mentions <tool_call but never opens one."],
    "llama3": ['{"answer": 42}', '{"name": "launch_rockets", "parameters": {}}',
               '<|python_tag|>print("hi")', 'The JSON {"name": "add", "parameters": {}} is not at the start'],
    "mistral": ["[TOOL_CALLS] nope", '[TOOL_CALLS] [{"name": "nope", "arguments": {}}]', "[TOOL_CALLS]"],
    "pythonic": ['[get_weather("Paris")]', "[get_weather(city=paris)]", "[1, 2, 3] are numbers",
                 "[launch_rockets(now=True)]", "[]"],
}
MALFORMED["qwen25"] = MALFORMED["hermes"][:2]


def request(**fields) -> ChatCompletionRequest:
    body = parse(ChatCompletionRequest, {"messages": USER, **fields})
    body.check()
    return body


def pieces(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, 7)
        out.append(text[i:i + k])
        i += k
    return out


def streamed(tools: ToolCalling, text: str, rng: random.Random, reason: str = "stop"):
    """(content or None, [(name, arguments)], finish reason) from the deltas of ``text``
    cut into random pieces, checking each call's first delta carries its id and name."""
    streams = ChoiceStreams(tools, 1)
    parts = pieces(text, rng) or [""]
    content, calls, finish = "", {}, None
    for k, piece in enumerate(parts):
        last = k == len(parts) - 1
        deltas, fin = streams.deltas(0, {"content": piece}, last, reason if last else None)
        finish = fin if last else finish
        for d in deltas:
            content += d.get("content", "")
            for tc in d.get("tool_calls", []):
                if tc["index"] not in calls:
                    assert tc["id"].startswith("call_") and tc["type"] == "function", tc
                    assert tc["function"]["arguments"] == "" and tc["function"]["name"], tc
                    assert tc["index"] == len(calls)
                    calls[tc["index"]] = [tc["function"]["name"], ""]
                else:
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                    calls[tc["index"]][1] += tc["function"]["arguments"]
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def whole(tools: ToolCalling, text: str, reason: str = "stop"):
    message, finish = tools.message({"role": "assistant", "content": text}, reason)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    for c in message.get("tool_calls", []):
        assert c["id"].startswith("call_") and c["type"] == "function"
    return message["content"], calls, finish


# ----------------------------------------------------------------- parsers
def test_registry_names_the_issue_parsers():
    assert {"hermes", "qwen25", "llama3", "mistral", "pythonic"} <= set(tool_parser_names())
    with pytest.raises(ValueError, match="--tool-call-parser: invalid value 'nope'; choose from: .*hermes"):
        get_tool_parser("nope")


def test_the_server_flag_names_the_choices():
    import argparse

    from radixserve.config import ConfigError
    from radixserve_server.launch import add_arguments, http_args_from

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert http_args_from(parser.parse_args(["--tool-call-parser", "qwen25"])).tool_call_parser == "qwen25"
    assert http_args_from(parser.parse_args([])).tool_call_parser is None
    with pytest.raises(ConfigError, match="--tool-call-parser: invalid value 'nope'; choose from: .*pythonic"):
        http_args_from(parser.parse_args(["--tool-call-parser", "nope"]))
    assert http_args_from(parser.parse_args([])).tool_call_max_string_length == 512
    args = http_args_from(parser.parse_args(["--tool-call-max-string-length", "0"]))
    assert args.tool_call_max_string_length == 0
    with pytest.raises(ConfigError, match="--tool-call-max-string-length must be >= 0"):
        http_args_from(parser.parse_args(["--tool-call-max-string-length", "-1"]))


@pytest.mark.parametrize("name,text,content,calls",
                         [(n, *case) for n, cases in RECORDED.items() for case in cases])
def test_recorded_outputs_whole_and_streamed(name, text, content, calls):
    tools = ToolCalling(request(tools=TOOLS), name)
    got = whole(tools, text)
    assert got == (content, calls, "tool_calls")
    for _, args in got[1]:
        json.loads(args)
    rng = random.Random(f"{name}{text}")
    for _ in range(25):
        assert streamed(tools, text, rng) == got


@pytest.mark.parametrize("name,text", [(n, t) for n, texts in MALFORMED.items() for t in texts])
def test_malformed_calls_are_plain_content(name, text):
    tools = ToolCalling(request(tools=TOOLS), name)
    assert whole(tools, text) == (text, [], "stop")
    rng = random.Random(text)
    for _ in range(10):
        assert streamed(tools, text, rng) == (text, [], "stop")


def test_text_outside_calls_is_kept_and_later_calls_after_a_broken_one_are_content():
    tools = ToolCalling(request(tools=TOOLS), "hermes")
    good = f'<tool_call>{{"name": "add", "arguments": {SUM}}}</tool_call>'
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    text = f"Before. {good} Between. {bad} After. {good}"
    content, calls, finish = whole(tools, text)
    assert calls == [("add", SUM)] and finish == "tool_calls"
    assert content == f"Before.  Between. {bad} After. {good}"
    assert streamed(tools, text, random.Random(0)) == (content, calls, finish)


def test_a_call_cut_short_is_content():
    tools = ToolCalling(request(tools=TOOLS), "hermes")
    text = 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    assert whole(tools, text, "length") == (text, [], "length")
    assert streamed(tools, text, random.Random(1), "length") == (text, [], "length")


def test_parallel_tool_calls_false_keeps_the_first_call():
    tools = ToolCalling(request(tools=TOOLS, parallel_tool_calls=False), "llama3")
    text = f'{{"name": "get_weather", "parameters": {PARIS}}}; {{"name": "add", "parameters": {SUM}}}'
    assert whole(tools, text) == (None, [("get_weather", PARIS)], "tool_calls")
    assert streamed(tools, text, random.Random(2)) == (None, [("get_weather", PARIS)], "tool_calls")


def test_markers_are_held_back_until_decided():
    tools = ToolCalling(request(tools=TOOLS), "hermes")
    streams = ChoiceStreams(tools, 1)
    assert streams.deltas(0, {"content": "Hi <tool"}, False, None)[0] == [{"content": "Hi"}]
    assert streams.deltas(0, {"content": "bar> there"}, False, None)[0] == [{"content": " <toolbar> there"}]
    # another field of the delta (the reasoning split's) goes first, untouched
    deltas, _ = streams.deltas(0, {"reasoning_content": "hmm", "content": "!"}, True, "stop")
    assert deltas == [{"reasoning_content": "hmm"}, {"content": "!"}]


def test_modes():
    assert ToolCalling(request(tools=TOOLS), None).mode == "none"  # auto without --tool-call-parser
    assert ToolCalling(request(tools=TOOLS, tool_choice="none"), "hermes").mode == "none"
    assert ToolCalling(request(), "hermes").mode == "none"
    assert ToolCalling(request(tools=TOOLS), "hermes").mode == "auto"
    assert ToolCalling(request(tools=TOOLS, tool_choice="required"), None).mode == "required"
    named = ToolCalling(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}), None)
    assert named.mode == "named" and named.new_parser() is not None
    # without parsing, a reply and its stream are left alone
    plain = ToolCalling(request(tools=TOOLS), None)
    text = f'<tool_call>{{"name": "add", "arguments": {SUM}}}</tool_call>'
    assert plain.message({"role": "assistant", "content": text}, "stop") == (
        {"role": "assistant", "content": text}, "stop")
    assert ChoiceStreams(plain, 1).deltas(0, {"content": text}, True, "stop") == ([{"content": text}], "stop")


def test_forced_modes_parse_what_the_grammar_makes():
    named = ToolCalling(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}), None)
    assert whole(named, SUM) == (None, [("add", SUM)], "tool_calls")
    assert streamed(named, SUM, random.Random(3)) == (None, [("add", SUM)], "tool_calls")
    required = ToolCalling(request(tools=TOOLS, tool_choice="required"), "pythonic")
    text = f'[{{"name": "get_weather", "parameters": {PARIS}}}, {{"name": "add", "parameters": {SUM}}}]'
    expected = (None, [("get_weather", PARIS), ("add", SUM)], "tool_calls")
    assert whole(required, text) == expected
    for seed in range(10):
        assert streamed(required, text, random.Random(seed)) == expected
    # output cut short by max_tokens: the text comes back as content; a stream, which sent the
    # call's start and arguments as they came, ends with what it sent
    assert whole(required, text[:50], "length") == (text[:50], [], "length")
    assert streamed(required, text[:50], random.Random(4), "length") == (
        None, [("get_weather", '{"city": "P')], "length")
    assert whole(named, "", "length") == ("", [], "length")
    # cut after a completed call: that call is kept, the unfinished one dropped
    for cut in (text[:text.index('"add"') - 3], text[:text.index('"add"') + 20]):
        assert whole(required, cut, "length") == (None, [("get_weather", PARIS)], "length")
        assert streamed(required, cut, random.Random(5), "length")[::2] == (None, "length")


def test_a_parser_registered_by_another_package():
    @register_tool_parser("test-xml")
    class XmlParser(ToolParser):
        markers = ("<call>",)

        def _region(self, marker):
            yield from self._json_call()
            yield from self._closer("</call>")

    try:
        tools = ToolCalling(request(tools=TOOLS), "test-xml")
        assert whole(tools, f'<call>{{"name": "add", "arguments": {SUM}}}</call>') == (None, [("add", SUM)],
                                                                                       "tool_calls")
    finally:
        del TOOL_PARSERS["test-xml"]


def test_json_scanner_agrees_with_json_loads():
    rng = random.Random(5)
    good = ['{"a": [1, -0.5e+3, true, false, null, "x\\"\\u00e9\\n"], "b": {"c": {}}}', "[]", "[[], {}]",
            '{"k": 0}', '{ "s" : "\\/" }']
    bad = ['{"a": 01}', '{"a": 1.}', '{"a": tru}', "{'a': 1}", '{"a": 1,}', '{"a" 1}', '{"a": "\x01"}',
           '{"a": "\\x"}', "[1 2]", '{"a": -}', '{"a": 1e}', "{]"]
    for text in good:
        s = JsonScanner()
        for c in text:
            s.feed(c)
        assert s.done, text
    for text in bad:
        s = JsonScanner()
        with pytest.raises(JsonSyntaxError):
            for c in text:
                s.feed(c)
            assert s.done  # never reached for these texts
            raise AssertionError(text)
    for _ in range(300):  # random mutations: the scanner accepts a text exactly when json does
        text = list(rng.choice(good))
        for _ in range(rng.randint(1, 2)):
            text[rng.randrange(len(text))] = rng.choice('{}[]",:0-.e1 ax\\')
        text = "".join(text)
        s, ok = JsonScanner(), True
        try:
            for c in text.rstrip():
                s.feed(c)
            ok = s.done
        except JsonSyntaxError:
            ok = False
        try:
            value = json.loads(text)
            expected = isinstance(value, (dict, list))
        except ValueError:
            expected = False
        assert ok == expected, text


# -------------------------------------------------------------- validation
@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "get_weather"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]}, "tools[0].function.colour"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]}, "tools[0].x"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "custom", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}, "regex": "a+"}, "regex"),
    ({"tools": TOOLS, "tool_choice": "required", "json_schema": "{}"}, "json_schema"),
])
def test_invalid_tools_and_tool_choice_are_400s_naming_the_field(fields, param):
    with pytest.raises(APIError) as e:
        request(**fields)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert e.value.message.startswith(param), e.value.message


def test_valid_requests_pass():
    for fields in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False},
                   {"tools": TOOLS, "tool_choice": "none", "response_format": {"type": "json_object"}},
                   {"tool_choice": "none"}, {"tool_choice": "auto"},
                   {"tools": [{"type": "function", "function": {"name": "f-1_x", "description": "d", "strict": True}}],
                    "tool_choice": {"type": "function", "function": {"name": "f-1_x"}}}):
        request(**fields)


# ------------------------------------------------------------------ schemas
NESTED = {
    "type": "object",
    "properties": {
        "guests": {"type": "array", "items": {"$ref": "#/$defs/person"}, "minItems": 1, "maxItems": 2},
        "nights": {"type": "integer", "minimum": 1, "maximum": 14},
        "budget": {"type": "number"},
        "breakfast": {"type": "boolean"},
        "room": {"type": "object", "properties": {"kind": {"enum": ["single", "double"]}},
                 "required": ["kind"], "additionalProperties": False},
    },
    "required": ["guests", "nights", "breakfast", "room"],
    "additionalProperties": False,
    "$defs": {"person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                         "required": ["name"], "additionalProperties": False}},
}
SCHEMA_TOOLS = [*TOOLS, {"type": "function", "function": {"name": "book", "parameters": NESTED}},
                {"type": "function", "function": {"name": "ping"}}]


def test_required_schema_accepts_exactly_the_declared_calls():
    jsonschema = pytest.importorskip("jsonschema")
    schema = required_schema(SCHEMA_TOOLS)
    ok = [[{"name": "add", "parameters": {"a": 1, "b": 2}}],
          [{"name": "book", "parameters": {"guests": [{"name": "Ann"}], "nights": 2, "breakfast": True,
                                           "room": {"kind": "double"}}}, {"name": "ping", "parameters": {}}]]
    bad = [[], [{"name": "add", "parameters": {"a": "1", "b": 2}}], [{"name": "sub", "parameters": {}}],
           [{"name": "book", "parameters": {"guests": [{"age": 3}], "nights": 2, "breakfast": True,
                                            "room": {"kind": "double"}}}],
           [{"name": "add", "parameters": {"a": 1, "b": 2}, "extra": 1}]]
    for instance in ok:
        jsonschema.validate(instance, schema)
    for instance in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(instance, schema)
    single = required_schema(SCHEMA_TOOLS, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok[1], single)


def test_update_params_sets_the_constraint():
    params: dict = {}
    ToolCalling(request(tools=SCHEMA_TOOLS, tool_choice={"type": "function", "function": {"name": "book"}}),
                None, 0).update_params(params)
    assert json.loads(params["json_schema"]) == NESTED
    params = {}
    ToolCalling(request(tools=SCHEMA_TOOLS, tool_choice="required", parallel_tool_calls=False),
                None, 0).update_params(params)
    assert json.loads(params["json_schema"]) == required_schema(SCHEMA_TOOLS, parallel=False)
    params = {}  # the default bounds free strings
    ToolCalling(request(tools=SCHEMA_TOOLS, tool_choice="required"), None).update_params(params)
    assert json.loads(params["json_schema"]) == bounded_for_generation(required_schema(SCHEMA_TOOLS), 512)
    params = {}
    ToolCalling(request(tools=TOOLS), "mistral").update_params(params)  # [TOOL_CALLS] is a special token
    assert params == {"skip_special_tokens": False}
    params = {}
    ToolCalling(request(tools=TOOLS, skip_special_tokens=True), "mistral").update_params(params)
    assert params == {}


@pytest.fixture(scope="module")
def tokenizer():
    from radixserve.model_loader import load_checkpoint
    from radixserve.tokenizer import load_tokenizer

    ckpt = load_checkpoint(None)
    return load_tokenizer(ckpt.tokenizer_dir, ckpt.gguf_file, None)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_both_grammar_backends_compile_the_schemas(tokenizer, backend):
    if backend == "xgrammar":
        mod = pytest.importorskip("radixserve_grammar_xgrammar")
        cls = mod.XGrammarBackend
    else:
        mod = pytest.importorskip("radixserve_grammar_llguidance")
        cls = mod.LLGuidanceBackend
    hf = tokenizer.hf
    compiler = cls(tokenizer=hf, vocab_size=len(hf), eos_token_ids=[hf.eos_token_id])
    for parallel in (True, False):
        compiler.compile("json_schema", json.dumps(required_schema(SCHEMA_TOOLS, parallel)))
    formats = {"type": "object", "properties": {f"p{i}": {"type": "string", "format": f}
                                                for i, f in enumerate(BOUNDED_FORMATS)}}
    tools = [*SCHEMA_TOOLS, {"type": "function", "function": {"name": "formats", "parameters": formats}}]
    for tool in tools:
        params: dict = {}
        choice = {"type": "function", "function": {"name": tool["function"]["name"]}}
        ToolCalling(request(tools=tools, tool_choice=choice), None).update_params(params)
        compiler.compile("json_schema", params["json_schema"])


# -------------------------------------------------------------- round trip
def round_trip_messages(args: str = PARIS):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    return [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]


def test_round_trip_renders_calls_and_results_in_a_template_without_tools(tokenizer):
    body = request(messages=round_trip_messages(), tools=TOOLS)
    tools = ToolCalling(body, "hermes")
    messages = tools.prepare_messages([m.flat(i) for i, m in enumerate(body.messages)], tokenizer.chat_template)
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == json.loads(PARIS)  # a mapping
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=body.tools)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' \
        in text
    assert "<|im_start|>tool\n18 degrees and sunny<|im_end|>" in text
    assert '"name": "get_weather"' in text.split("<|im_start|>user")[0]  # the tools, in the system turn
    assert text.endswith("<|im_start|>assistant\n")


def test_round_trip_keeps_tool_calls_for_templates_that_render_them():
    template = ("{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
                "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
                "{% else %}{{ m.role }}: {{ m.content }}{% endif %}\n{% endfor %}{{ tools | length }}")
    body = request(messages=round_trip_messages(), tools=TOOLS)
    messages = ToolCalling(body, None).prepare_messages([m.flat(i) for i, m in enumerate(body.messages)], template)
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["function"]["arguments"] == json.loads(PARIS)
    assert len(messages) == 3  # the template renders tools itself: no system message added


def test_round_trip_arguments_must_be_a_json_object():
    body = request(messages=round_trip_messages("{not json"), tools=TOOLS)
    with pytest.raises(APIError) as e:
        ToolCalling(body, None).prepare_messages([m.flat(i) for i, m in enumerate(body.messages)], "")
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"


def test_unbounded_formats_get_bounded_patterns_in_the_constraint():

    schema = {"type": "object", "properties": {
        "to": {"type": "string", "format": "email"},
        "format": {"type": "string", "format": "date"},  # a property named format; a bounded format
        "links": {"type": "array", "items": {"type": "string", "format": "uri"}},
        "own": {"type": "string", "format": "hostname", "pattern": "^a+$"}}}
    out = bounded_for_generation(schema)
    props = out["properties"]
    assert props["to"] == {"type": "string", "pattern": BOUNDED_FORMATS["email"]}
    assert props["links"]["items"] == {"type": "string", "pattern": BOUNDED_FORMATS["uri"]}
    assert props["format"] == schema["properties"]["format"]
    assert props["own"] == schema["properties"]["own"]  # the client's own pattern stays
    assert schema["properties"]["to"]["format"] == "email"  # the tool's schema is untouched
    free = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string", "maxLength": 9},
                                             "c": {"type": "string", "minLength": 600}}}
    props = bounded_for_generation(free, 512)["properties"]
    assert props == {"a": {"type": "string", "maxLength": 512}, "b": free["properties"]["b"],
                     "c": {"type": "string", "minLength": 600, "maxLength": 600}}
    assert bounded_for_generation(free, 0) == free
    email, uri = "bob.smith@mail.example.com", "https://example.org/a/b?x=1"
    examples = {"email": email, "idn-email": email, "uri": uri, "iri": uri, "uri-reference": uri,
                "iri-reference": uri, "hostname": "www.example.org"}
    assert set(examples) == set(BOUNDED_FORMATS)
    for fmt, pattern in BOUNDED_FORMATS.items():
        assert re.fullmatch(pattern.strip("^$"), examples[fmt]), fmt
        assert not re.fullmatch(pattern.strip("^$"), "x" * 2000), fmt

"""Structured-output conformance: what every grammar backend must do on a real engine.

A backend's test module builds an engine with ``--grammar-backend <name>`` and calls the
``check_*`` functions; each raises AssertionError naming the failing output. Needs
``jsonschema`` and ``lark`` (test dependencies of the grammar plugins).
"""

from __future__ import annotations

import json
import re

NUM_SAMPLES = 10
TEMPERATURE = 0.7
MAX_NEW_TOKENS = 128

# (id, instruction, schema): nested objects, enums, bounded arrays, numeric ranges,
# optional fields and string patterns. Objects are closed (additionalProperties false,
# as OpenAI's strict mode requires) so every backend ends them the same way.
SCHEMAS: list[tuple[str, str, dict]] = [
    ("nested", "Describe a person and where they live as JSON.", {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 16},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "minLength": 1, "maxLength": 16},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            },
        },
        "required": ["person"],
        "additionalProperties": False,
    }),
    ("enums", "Pick a shirt colour and size as JSON.", {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "in_stock": {"type": "boolean"},
        },
        "required": ["color", "size", "in_stock"],
        "additionalProperties": False,
    }),
    ("array_bounds", "List a few test scores as JSON.", {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "minItems": 2,
                "maxItems": 4,
            },
            "labels": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "maxItems": 2,
            },
        },
        "required": ["scores", "labels"],
        "additionalProperties": False,
    }),
    ("number_ranges", "Report today's weather as JSON.", {
        "type": "object",
        "properties": {
            "celsius": {"type": "integer", "minimum": -40, "maximum": 45},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            "wind": {"type": "number", "minimum": 0, "maximum": 200},
        },
        "required": ["celsius", "humidity", "wind"],
        "additionalProperties": False,
    }),
    ("optional_fields", "Describe a film as JSON.", {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 1, "maxLength": 24},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "genre": {"enum": ["drama", "comedy", "horror"]},
        },
        "required": ["title"],
        "additionalProperties": False,
    }),
    ("string_patterns", "Give a flight booking as JSON.", {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "flight": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3,4}$"},
        },
        "required": ["date", "flight"],
        "additionalProperties": False,
    }),
]

# (id, instruction, pattern); bounded so a sample always ends within MAX_NEW_TOKENS
REGEXES: list[tuple[str, str, str]] = [
    ("phone", "What is your phone number?", r"\(\d{3}\) \d{3}-\d{4}"),
    ("answer", "Is the sky blue? Answer and explain briefly.",
     r"(Yes|No), because [a-z ]{3,30}\."),
    ("time", "What time is it?", r"([01]?[0-9]|2[0-3]):[0-5][0-9]"),
]

# (id, instruction, GBNF grammar, equivalent Lark grammar used to check the outputs)
EBNFS: list[tuple[str, str, str, str]] = [
    ("greeting", "Greet someone by name.",
     'root ::= greeting ", " name "!"\n'
     'greeting ::= "Hello" | "Hi" | "Good " daytime\n'
     'daytime ::= "morning" | "evening"\n'
     'name ::= [A-Z] [a-z] [a-z]? [a-z]? [a-z]? [a-z]? [a-z]?\n',
     'root: greeting ", " name "!"\n'
     'greeting: "Hello" | "Hi" | "Good " daytime\n'
     'daytime: "morning" | "evening"\n'
     'name: /[A-Z][a-z]{1,6}/\n'),
    ("sum", "Write an addition of small numbers and its result.",
     'root ::= term (" + " term)? (" + " term)? " = " number\n'
     'term ::= number | "(" number " + " number ")"\n'
     'number ::= [0-9] | [1-9] [0-9]\n',
     'root: term (" + " term)? (" + " term)? " = " number\n'
     'term: number | "(" number " + " number ")"\n'
     'number: /[1-9]?[0-9]/\n'),
]

# (id, instruction, schema): prompts on which the default model, greedy, loops inside a free
# string, a free array or json_object's strings until max_tokens when the engine's runaway
# bounds are off (tests/test_grammar_bounds.py shows it); under the default bounds
# (radixserve.grammar.bounds) each reply ends within RUNAWAY_MAX_NEW_TOKENS.
RUNAWAYS: list[tuple[str, str, dict]] = [
    ("free_string", "Repeat the word hello forever, as JSON.", {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
    ("free_array", "List every country in the world as JSON.", {
        "type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
        "required": ["items"]}),
    ("json_object", "Write an essay about the sea as a JSON object.", {"type": "object"}),
]
RUNAWAY_MAX_NEW_TOKENS = 768


INVALID: list[tuple[str, dict]] = [
    ("schema_bad_type", {"json_schema": json.dumps({"type": "object", "properties": {"a": {"type": 5}}})}),
    ("schema_not_json", {"json_schema": '{"type": "object",'}),
    ("regex_unclosed", {"regex": "a(b"}),
    ("ebnf_undefined_rule", {"ebnf": 'root ::= "a" undefined_rule'}),
]


def chat_prompt(engine, instruction: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": instruction}])


def _samples(engine, instruction: str, constraint: dict, **params) -> list[dict]:
    sp = {"temperature": TEMPERATURE, "max_new_tokens": MAX_NEW_TOKENS, "n": NUM_SAMPLES,
          "seed": 1234, **constraint, **params}
    outs = engine.generate(chat_prompt(engine, instruction), sp)
    assert len(outs) == NUM_SAMPLES
    return outs


def _ended_by_grammar(out: dict, what: str) -> None:
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "stop", f"{what}: finished with {reason}, not stop: {out['text']!r}"


def check_json_schema(engine, case: tuple[str, str, dict]) -> list[dict]:
    """NUM_SAMPLES samples at TEMPERATURE parse as JSON and validate against the schema."""
    import jsonschema

    name, instruction, schema = case
    outs = _samples(engine, instruction, {"json_schema": json.dumps(schema)})
    for out in outs:
        _ended_by_grammar(out, name)
        try:
            value = json.loads(out["text"])
        except ValueError as e:
            raise AssertionError(f"{name}: not JSON ({e}): {out['text']!r}") from e
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as e:
            raise AssertionError(f"{name}: {e.message}: {out['text']!r}") from e
    return outs


def check_json_object(engine) -> list[dict]:
    """``{"type": "object"}`` (OpenAI json_object) gives any JSON object."""
    outs = _samples(engine, "Describe your favourite animal as a JSON object.",
                    {"json_schema": '{"type": "object"}'}, max_new_tokens=64)
    finished = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert finished, "no json_object sample finished within the token budget"
    for out in finished:
        assert isinstance(json.loads(out["text"]), dict), out["text"]
    for out in outs:  # unfinished ones are still a valid prefix: they start an object
        assert out["text"].lstrip().startswith("{"), out["text"]
    return outs


def _json_sizes(value) -> tuple[int, int]:
    """The longest string (keys included) and the largest array or object in ``value``."""
    if isinstance(value, str):
        return len(value), 0
    if isinstance(value, list):
        inner = [_json_sizes(v) for v in value]
        return max([0, *(a for a, _ in inner)]), max([len(value), *(b for _, b in inner)])
    if isinstance(value, dict):
        inner = [_json_sizes(v) for v in value.values()]
        return (max([0, *(len(k) for k in value), *(a for a, _ in inner)]),
                max([len(value), *(b for _, b in inner)]))
    return 0, 0


def runaway_outputs(engine, cases=None, max_new_tokens: int = RUNAWAY_MAX_NEW_TOKENS) -> list[dict]:
    """Greedy replies to ``cases`` (default :data:`RUNAWAYS`), batched."""
    cases = RUNAWAYS if cases is None else cases
    prompts = [chat_prompt(engine, instruction) for _, instruction, _ in cases]
    return engine.generate(prompts, [{"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                      "json_schema": json.dumps(schema)} for _, _, schema in cases])


def check_runaway_bounded(engine) -> list[dict]:
    """Under the engine's ``--constrained-json-max-string-length`` and
    ``--constrained-json-max-items``, each :data:`RUNAWAYS` reply ends by the grammar
    within RUNAWAY_MAX_NEW_TOKENS, validates against its schema, and keeps every free
    string and array within the bounds."""
    import jsonschema

    grammar = engine.scheduler.grammar
    max_string, max_items = grammar.json_bounds
    assert max_string > 0 and max_items > 0, "the engine runs with the runaway bounds off"
    outs = runaway_outputs(engine)
    for (name, _, schema), out in zip(RUNAWAYS, outs):
        _ended_by_grammar(out, name)
        value = json.loads(out["text"])
        jsonschema.validate(value, schema)
        longest, largest = _json_sizes(value)
        assert longest <= max_string, f"{name}: a string of {longest} characters: {out['text']!r}"
        assert largest <= max_items, f"{name}: a container of {largest} items: {out['text']!r}"
    return outs


def check_regex(engine, case: tuple[str, str, str]) -> list[dict]:
    name, instruction, pattern = case
    outs = _samples(engine, instruction, {"regex": pattern}, max_new_tokens=48)
    for out in outs:
        _ended_by_grammar(out, name)
        assert re.fullmatch(pattern, out["text"]), f"{name}: {out['text']!r} !~ {pattern}"
    return outs


def check_ebnf(engine, case: tuple[str, str, str, str]) -> list[dict]:
    import lark

    name, instruction, grammar, lark_grammar = case
    parser = lark.Lark(lark_grammar, start="root", parser="earley", lexer="dynamic")
    outs = _samples(engine, instruction, {"ebnf": grammar}, max_new_tokens=48)
    for out in outs:
        _ended_by_grammar(out, name)
        try:
            parser.parse(out["text"])
        except lark.exceptions.LarkError as e:
            raise AssertionError(f"{name}: {out['text']!r} does not parse: {e}") from e
    return outs


SAMPLER_SETTINGS: list[dict] = [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 1.3, "top_p": 0.8},
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 0.8, "repetition_penalty": 1.5},
    {"temperature": 0.8, "frequency_penalty": 1.5, "presence_penalty": 1.0},
    {"temperature": 0.0, "repetition_penalty": 1.3, "min_new_tokens": 2},
    {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": 7},
]


def check_sampler_settings(engine) -> list[dict]:
    """Masks hold under every sampler setting, all in one batch."""
    pattern = r"[0-9]{2}-[A-Z]{2}-(red|blue)"
    prompt = chat_prompt(engine, "Write a product code.")
    params = [{"max_new_tokens": 24, "regex": pattern, **s} for s in SAMPLER_SETTINGS]
    outs = engine.generate([prompt] * len(params), params)
    for setting, out in zip(SAMPLER_SETTINGS, outs):
        _ended_by_grammar(out, str(setting))
        assert re.fullmatch(pattern, out["text"]), f"{setting}: {out['text']!r}"
    return outs


def check_mixed_batch(engine) -> None:
    """Unconstrained greedy neighbours get the same tokens as without constrained ones."""
    free_prompts = ["The capital of France is", "Write a haiku about the sea."]
    free = {"temperature": 0.0, "max_new_tokens": 16}
    alone = engine.generate(free_prompts, free)
    schema = json.dumps(SCHEMAS[1][2])
    prompts = [free_prompts[0], chat_prompt(engine, SCHEMAS[1][1]), free_prompts[1],
               chat_prompt(engine, "What time is it?")]
    params = [free, {"temperature": 0.7, "max_new_tokens": 48, "json_schema": schema}, free,
              {"temperature": 0.0, "max_new_tokens": 16, "regex": REGEXES[2][2]}]
    mixed = engine.generate(prompts, params)
    assert mixed[0]["output_ids"] == alone[0]["output_ids"]
    assert mixed[2]["output_ids"] == alone[1]["output_ids"]
    json.loads(mixed[1]["text"])
    assert re.fullmatch(REGEXES[2][2], mixed[3]["text"]), mixed[3]["text"]


def check_invalid(engine, case: tuple[str, dict]) -> str:
    """A grammar that does not compile fails only its own request (abort, status 400, the
    compiler's reason); a neighbour in the same batch finishes normally. Returns the message."""
    name, constraint = case
    prompts = ["Count to five:", "Say hello."]
    params = [{"temperature": 0.0, "max_new_tokens": 8},
              {"temperature": 0.0, "max_new_tokens": 8, **constraint}]
    ok, bad = engine.generate(prompts, params)
    reason = bad["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400, f"{name}: {reason}"
    assert reason["message"] and "timed out" not in reason["message"], f"{name}: {reason}"
    assert bad["output_ids"] == [], name
    assert ok["meta_info"]["finish_reason"]["type"] in ("length", "stop"), ok["meta_info"]
    assert len(ok["output_ids"]) > 0
    return reason["message"]


def check_cache(engine) -> None:
    """A second compile of the same grammar (good or bad) is a cache hit."""
    stats = engine.get_stats
    pattern = r"cache-test-[0-9]"
    prompt = "Say something."
    engine.generate(prompt, {"regex": pattern, "max_new_tokens": 12})
    before = stats()
    out = engine.generate(prompt, {"regex": pattern, "max_new_tokens": 12, "temperature": 0.0})
    after = stats()
    assert re.fullmatch(pattern, out["text"]), out["text"]
    assert after["num_grammar_compiles"] == before["num_grammar_compiles"]
    assert after["num_grammar_cache_hits"] == before["num_grammar_cache_hits"] + 1
    bad = {"regex": "cache-(test", "max_new_tokens": 4}
    first = engine.generate(prompt, bad)["meta_info"]["finish_reason"]
    before = stats()
    second = engine.generate(prompt, bad)["meta_info"]["finish_reason"]
    after = stats()
    assert first == second and first["status_code"] == 400
    assert after["num_grammar_compiles"] == before["num_grammar_compiles"]
    assert after["num_grammar_cache_hits"] == before["num_grammar_cache_hits"] + 1


def check_matcher_contract(factory, hf_tokenizer, eos_token_ids: list[int]) -> None:
    """The backend object itself: masks, accept, rollback, termination, errors, and a
    model vocabulary wider than the tokenizer's (padding tokens are never allowed)."""
    import torch

    from radixserve.grammar import GrammarBackend, GrammarError, allocate_token_bitmask

    vocab = len(hf_tokenizer) + 64
    backend = factory(tokenizer=hf_tokenizer, vocab_size=vocab, eos_token_ids=eos_token_ids)
    assert isinstance(backend, GrammarBackend)
    digit = {d: hf_tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
    letter = hf_tokenizer.convert_tokens_to_ids("a")
    compiled = backend.compile("regex", "[0-9]{3}")

    def allowed(matcher) -> set[int]:
        mask = allocate_token_bitmask(2, vocab)
        mask.zero_()
        matcher.fill_bitmask(mask, 1)
        assert not mask[0].any(), "a matcher wrote outside its row"
        bits = ((mask[1].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)
        return set(bits.nonzero().view(-1).tolist())

    m = backend.new_matcher(compiled)
    first = allowed(m)
    assert digit["7"] in first and letter not in first
    assert all(t < len(hf_tokenizer) for t in first), "a padding token was allowed"
    for t in first:
        text = hf_tokenizer.decode([t])
        assert text.isdigit() and len(text) <= 3, f"token {t} ({text!r}) allowed by [0-9]{{3}}"
    assert not m.accept_token(letter)
    for d in "12":
        assert m.accept_token(digit[d]) and not m.is_terminated()
    m.rollback(1)
    assert m.accept_token(digit["5"]) and m.accept_token(digit["6"])
    if not m.is_terminated():  # complete: only end-of-sequence may follow
        assert allowed(m) <= set(eos_token_ids) and allowed(m)
        assert m.accept_token(eos_token_ids[0]) and m.is_terminated()
    other = backend.new_matcher(compiled)  # matchers are independent
    assert digit["7"] in allowed(other)
    for kind, text in (("regex", "a(b"), ("json_schema", '{"type": 5}'),
                       ("json_schema", "{not json"), ("ebnf", "root ::= missing")):
        try:
            backend.compile(kind, text)
        except GrammarError as e:
            assert str(e).strip(), f"{kind} {text!r}: empty reason"
        else:
            raise AssertionError(f"{kind} {text!r} compiled")
    for kind, text in (("json_schema", '{"type": "array", "items": {"type": "integer"}}'),
                       ("json_object", ""), ("ebnf", 'root ::= "yes" | "no"')):
        backend.new_matcher(backend.compile(kind, text))


def check_serialization(factory, hf_tokenizer, eos_token_ids: list[int]) -> bool:
    """A backend that compiles in worker processes (it overrides ``serialize`` and
    ``deserialize``) survives the trip there and back: the pickled backend compiles, and
    the grammar it serialized loads into matchers that allow and accept what the original's
    do. False (nothing checked) for a backend that compiles on threads."""
    import pickle

    import torch

    from radixserve.grammar import allocate_token_bitmask

    backend = factory(tokenizer=hf_tokenizer, vocab_size=len(hf_tokenizer), eos_token_ids=eos_token_ids)
    if not backend.compiles_in_processes:
        return False
    worker = pickle.loads(pickle.dumps(backend))  # what a worker process receives
    digits = [hf_tokenizer.convert_tokens_to_ids(d) for d in "42"]
    for kind, text in (("regex", "[0-9]{2}"), ("json_schema", '{"type": "array", "items": {"type": "integer"}}'),
                       ("ebnf", 'root ::= [0-9] [0-9]')):
        data = worker.serialize(worker.compile(kind, text))
        assert isinstance(data, bytes), f"serialize gave {type(data).__name__}, not bytes"
        loaded = backend.new_matcher(backend.deserialize(data))
        original = backend.new_matcher(backend.compile(kind, text))
        masks = allocate_token_bitmask(2, len(hf_tokenizer))
        loaded.fill_bitmask(masks, 0)
        original.fill_bitmask(masks, 1)
        assert torch.equal(masks[0], masks[1]), f"{kind} {text!r}: the deserialized grammar allows other tokens"
        if kind != "json_schema":
            for t in digits:
                assert loaded.accept_token(t) and original.accept_token(t), f"{kind} {text!r}: token {t} refused"
    return True

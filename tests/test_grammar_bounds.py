"""Runaway guards for JSON constraints (radixserve.grammar.bounds): what the bounded copy
of a schema says, the flags that set the bounds, and that on the default model the
runaway prompts end by the grammar with the bounds on and run to ``max_new_tokens``
with them off."""

from __future__ import annotations

import json

import jsonschema
import pytest
from radixserve.config import ConfigError, ServerArgs
from radixserve.grammar.bounds import (
    BOUNDED_FORMATS,
    JSON_OBJECT_MAX_DEPTH,
    bound_constraint,
    bound_schema,
    bounded_json_object,
)
from radixserve.testing import grammar_conformance as gc


def test_free_strings_and_arrays_get_the_bounds():
    schema = {"type": "object", "properties": {
        "s": {"type": "string"},
        "a": {"type": "array", "items": {"type": "string"}},
        "n": {"type": ["string", "null"]},
    }}
    out = bound_schema(schema, 100, 7)
    props = out["properties"]
    assert props["s"] == {"type": "string", "maxLength": 100}
    assert props["a"] == {"type": "array", "items": {"type": "string", "maxLength": 100}, "maxItems": 7}
    assert props["n"]["maxLength"] == 100
    assert out["additionalProperties"] is False  # names its properties, says nothing of others
    assert "maxLength" not in schema["properties"]["s"], "the input schema was modified"


def test_the_schemas_own_bounds_win_and_minimums_raise_the_bound():
    out = bound_schema({"type": "array", "maxItems": 500, "items": {"type": "string", "maxLength": 2000}}, 10, 3)
    assert out == {"type": "array", "maxItems": 500, "items": {"type": "string", "maxLength": 2000}}
    out = bound_schema({"type": "array", "minItems": 9, "items": {"type": "string", "minLength": 40}}, 10, 3)
    assert out["maxItems"] == 9 and out["items"]["maxLength"] == 40


@pytest.mark.parametrize("node", [
    {"type": "string", "pattern": "^[a-z]+$"},
    {"type": "string", "enum": ["a", "b"]},
    {"type": "string", "const": "x"},
    {"type": "string", "format": "date"},
    {"type": "integer"},
    {"type": "array", "items": False},
])
def test_constrained_nodes_are_left_alone(node):
    assert bound_schema(node, 10, 3) == node


def test_unbounded_formats_get_bounded_patterns():
    out = bound_schema({"type": "string", "format": "email"}, 10, 3)
    assert out == {"type": "string", "pattern": BOUNDED_FORMATS["email"]}


def test_objects():
    # open objects get maxProperties (at least as many as they name); explicit choices stay
    out = bound_schema({"type": "object"}, 10, 3)
    assert out["maxProperties"] == 3 and out["additionalProperties"] is False
    assert out["patternProperties"] == {"^.{0,10}$": {"$ref": "#/$defs/radixserve_any2"}}
    closed = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}
    assert bound_schema(closed, 10, 3) == closed
    extra = {"type": "object", "properties": {str(i): {"type": "integer"} for i in range(5)},
             "additionalProperties": {"type": "integer"}}
    assert bound_schema(extra, 10, 3)["maxProperties"] == 5


def test_free_members_and_items_become_bounded_values():
    schema = {"type": "object", "properties": {"meta": {"type": "object"}, "tags": {"type": "array"}},
              "required": ["meta", "tags"], "$defs": {"mine": {"type": "integer"}}}
    out = bound_schema(schema, 8, 3)
    jsonschema.Draft202012Validator.check_schema(out)
    assert out["$defs"]["mine"] == {"type": "integer"}
    jsonschema.validate({"meta": {"k": [1, "short"]}, "tags": ["a", {"b": None}]}, out)
    for bad in ({"meta": {"k": "x" * 9}, "tags": []}, {"meta": {}, "tags": [["x" * 9]]},
                {"meta": {}, "tags": [1, 2, 3, 4]}, {"meta": {"k" * 9: 1}, "tags": []}):
        jsonschema.validate(bad, schema)  # the client's schema admits it, the generated one does not
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, out)
    assert bound_schema({"type": "array"}, 0, 0) == {"type": "array"}


def test_zero_turns_a_bound_off():
    schema = {"type": "array", "items": {"type": "string"}}
    assert bound_schema(schema, 0, 4) == {**schema, "maxItems": 4}
    assert bound_schema(schema, 12, 0) == {"type": "array", "items": {"type": "string", "maxLength": 12}}
    text = json.dumps(schema)
    assert bound_constraint("json_schema", text, 0, 0) == ("json_schema", text)
    assert bound_constraint("json_object", "", 0, 0) == ("json_object", "")


def test_bound_constraint():
    assert bound_constraint("regex", "a+", 5, 5) == ("regex", "a+")
    assert bound_constraint("json_schema", '{"type": ', 5, 5) == ("json_schema", '{"type": ')  # backend reports it
    unchanged = json.dumps({"type": "integer"})
    assert bound_constraint("json_schema", unchanged, 5, 5) == ("json_schema", unchanged)
    kind, text = bound_constraint("json_schema", json.dumps({"type": "string"}), 5, 5)
    assert (kind, json.loads(text)) == ("json_schema", {"type": "string", "maxLength": 5})
    kind, text = bound_constraint("json_object", "", 5, 5)
    assert kind == "json_schema" and json.loads(text) == bounded_json_object(5, 5)


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max([0, *map(_depth, value.values())])
    if isinstance(value, list):
        return 1 + max([0, *map(_depth, value)])
    return 0


def test_bounded_json_object_accepts_bounded_objects_only():
    schema = bounded_json_object(8, 3)
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = {"key": [1, "short", {"k": None}], "b": True}
    jsonschema.validate(ok, schema)
    for bad in ([1], {"k": "x" * 9}, {"k" * 9: 1}, {"a": 1, "b": 2, "c": 3, "d": 4}, {"a": [1, 2, 3, 4]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    nested: object = 1
    for _ in range(JSON_OBJECT_MAX_DEPTH):
        nested = {"k": nested}
    assert _depth(nested) == JSON_OBJECT_MAX_DEPTH
    jsonschema.validate(nested, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"k": nested}, schema)
    # strings unbounded: keys are free too; items unbounded: any number of members
    jsonschema.validate({"k" * 100: "x" * 100, **{str(i): i for i in range(10)}}, bounded_json_object(0, 0))


@pytest.mark.parametrize("flag", ["constrained_json_max_string_length", "constrained_json_max_items"])
def test_flags_validate(flag):
    assert getattr(ServerArgs(**{flag: 0}), flag) == 0
    with pytest.raises(ConfigError, match=flag.replace("_", "[-_]")):
        ServerArgs(**{flag: -1})


class _Recording:
    """A grammar backend that records what it is asked to compile."""

    def __init__(self):
        self.compiled: list[tuple[str, str]] = []

    def compile(self, kind, text):
        self.compiled.append((kind, text))
        return text


def test_cli_flags_reach_the_compiled_constraint():
    import argparse

    from radixserve.grammar.manager import GrammarManager

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args([
        "--constrained-json-max-string-length", "33", "--constrained-json-max-items", "4",
        "--constrained-json-disable-any-whitespace"]))
    assert (args.constrained_json_max_string_length, args.constrained_json_max_items) == (33, 4)
    backend = _Recording()
    manager = GrammarManager(backend, compile_timeout=30, json_max_string_length=33, json_max_items=4)
    job = manager.get(("json_schema", json.dumps({"type": "array", "items": {"type": "string"}})))
    assert job.done.wait(30) and job.error is None
    kind, text = backend.compiled[0]
    assert kind == "json_schema"
    assert json.loads(text) == {"type": "array", "items": {"type": "string", "maxLength": 33}, "maxItems": 4}


xgrammar = pytest.importorskip("xgrammar", reason="the engine runs below need the xgrammar backend "
                                                  "(scripts/install.sh installs it)")


@pytest.fixture(scope="module")
def engines():
    """Two engines on the default model: bounds off, and small bounds."""
    import radixserve
    import torch

    threads = torch.get_num_threads()
    made = []
    try:
        for bounds in ((0, 0), (64, 8)):
            made.append(radixserve.Engine(grammar_backend="xgrammar", max_total_tokens=4096, num_threads=1,
                                          constrained_json_max_string_length=bounds[0],
                                          constrained_json_max_items=bounds[1]))
        yield made
    finally:
        for eng in made:
            eng.shutdown()
        torch.set_num_threads(threads)


def test_runaways_run_to_max_new_tokens_without_the_bounds(engines):
    off = engines[0]
    for (name, _, _), out in zip(gc.RUNAWAYS, gc.runaway_outputs(off, max_new_tokens=160)):
        assert out["meta_info"]["finish_reason"]["type"] == "length", (name, out["text"])
    off.check_idle_invariant()


def test_runaways_end_under_small_bounds(engines):
    on = engines[1]
    assert on.scheduler.grammar.json_bounds == (64, 8)
    gc.check_runaway_bounded(on)
    on.check_idle_invariant()

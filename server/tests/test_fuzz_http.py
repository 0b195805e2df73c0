"""Malformed-but-parseable bodies are 400s, never 500s: hypothesis builds bodies for the
generation, tokenizer and admin routes of one running server (valid bodies with one field
replaced or added, and whole bodies of any JSON shape), with numbers past every limit
(5,000 digits, 1e999, NaN), strings with lone surrogates and nesting thousands of levels
deep, and checks that none is answered with a 5xx and that the server still serves after.

Deterministic (``derandomize=True``): the same examples on every run.
"""

from __future__ import annotations

import json
import os

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (server[test] installs it)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MESSAGES = [{"role": "user", "content": "Hi"}]
ROUTES = {  # a valid, cheap body per route
    "/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 2, "temperature": 0},
    "/tokenize": {"prompt": "Hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/abort_request": {"rid": "no-such-request"},
}
# fields whose plain integer values would make a request long, not wrong: they get other values
COUNTS = {"max_new_tokens", "max_tokens", "max_completion_tokens", "min_new_tokens", "min_tokens", "n",
          "best_of", "top_logprobs", "logprobs", "top_logprobs_num"}
# raw JSON literals json.dumps cannot write (or writes only as NaN/Infinity)
RAW = ["1" * 5000, "-" + "9" * 4400, "1" + "0" * 30, "1e999", "-1e999", "NaN", "Infinity", "-Infinity",
       "9223372036854775808", "-9223372036854775809", "1.7976931348623157e309", "4.9e-325"]

surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
texts = st.text(st.one_of(st.characters(), surrogates), max_size=12)
raws = st.sampled_from(RAW).map(lambda r: {"__raw__": r})
deep = st.tuples(st.integers(1, 6000), st.sampled_from("[{")).map(lambda d: {"__deep__": d})
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), texts, raws)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(texts, inner, max_size=4)), max_leaves=12)
values = st.one_of(values, deep)


def render(value) -> str:
    """JSON text of ``value``, with its ``__raw__`` and ``__deep__`` stand-ins written out."""
    if isinstance(value, dict) and set(value) == {"__raw__"}:
        return value["__raw__"]
    if isinstance(value, dict) and set(value) == {"__deep__"}:
        depth, opener = value["__deep__"]
        if opener == "[":
            return "[" * depth + "1" + "]" * depth
        return '{"a":' * depth + "1" + "}" * depth
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{render(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(render(v) for v in value) + "]"
    return json.dumps(value)


def long_running(key: str, value) -> bool:
    """A count a request may validly take (or null: no limit), which would only make it long."""
    plain = value is None or isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 10**7
    # sampling_params null or without max_new_tokens: the default (128 new tokens)
    return key in COUNTS and plain or key == "sampling_params" and (value is None or isinstance(value, dict))


@st.composite
def bodies(draw) -> tuple[str, str]:
    route = draw(st.sampled_from(sorted(ROUTES)))
    body = json.loads(json.dumps(ROUTES[route]))
    how = draw(st.sampled_from(["replace", "add", "nested", "whole"]))
    if how == "whole":
        return route, render(draw(values))
    target = body
    if how == "nested" and isinstance(body.get("sampling_params"), dict):
        target = body["sampling_params"]
    elif how == "nested":
        how = "replace"
    key = draw(st.sampled_from(sorted(target))) if how == "replace" else draw(
        st.one_of(st.sampled_from(sorted(COUNTS | {"stop", "seed", "logit_bias", "response_format", "regex",
                                                    "json_schema", "stream", "rid", "input_ids", "tools",
                                                    "top_k", "top_p", "temperature", "echo"})), texts))
    value = draw(values.filter(lambda v: not long_running(key, v)))
    target[key] = value
    return route, render(body)


@pytest.mark.slow
def test_malformed_bodies_are_400_never_500(server):
    seen: dict[int, int] = {}
    log_start = os.path.getsize(server.log_path)
    with server.client(timeout=30.0) as c:

        @settings(max_examples=150, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(bodies())
        def check(case):
            route, raw = case
            r = c.post(route, content=raw.encode("utf-8", "surrogatepass"),
                       headers={"Content-Type": "application/json"})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (route, raw[:300], r.status_code, r.text[:300])
            assert '"server_error"' not in r.text, (route, raw[:300], r.text[:300])

        check()
        assert seen.get(400, 0) > 20, seen  # the cases did reach the checks
        ok = c.post("/generate", json=ROUTES["/generate"])
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2, ok.text
    with open(server.log_path, errors="replace") as fh:
        fh.seek(log_start)
        log = fh.read()
    assert "Traceback" not in log, log[-4000:]  # each refusal is one line
    assert log.count(" 400 ") >= seen[400], log[-4000:]
    server.wait_idle()

"""Grammar limits over HTTP: --grammar-max-spec-bytes answers a 400 naming the field the
client sent, and one client's compiles run one at a time (--grammar-max-compiles-per-client,
the client being the peer's address), so a deep schema past --grammar-compile-timeout holds
one compile worker, is killed, and the next small grammar is served at once. The same
server (default body limit) refuses the audited costly sampling fields (100k stop strings)."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest
from radixserve.testing.deep_schema import deep_tree_schema
from serverproc import API_KEY, start_server

pytestmark = pytest.mark.slow

LIMIT = 250_000  # --grammar-max-spec-bytes: a deep-tree schema (about 190 KB) fits
TIMEOUT = 4  # --grammar-compile-timeout


@pytest.fixture(scope="module")
def limited():
    sp = start_server("--grammar-max-spec-bytes", str(LIMIT), "--grammar-compile-timeout", str(TIMEOUT),
                      api_key=API_KEY, module=True)
    yield sp
    code = sp.stop()
    assert code == 0, f"server exited with {code}:\n{sp.log()}"


def _chat(c, **fields):
    return c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Answer."}],
                                                "max_tokens": 8, **fields})


def test_oversized_constraints_are_400_naming_the_field(limited):
    big_schema = {"type": "object", "properties": {f"field_{i:06d}": {"type": "integer"} for i in range(12_000)}}
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": big_schema}}},
              "response_format"),
             ({"json_schema": big_schema}, "json_schema"),
             ({"regex": "a" * (LIMIT + 1)}, "regex"),
             ({"ebnf": 'root ::= "' + "b" * LIMIT + '"'}, "ebnf")]
    with limited.client() as c:
        for fields, name in cases:
            r = _chat(c, **fields)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == name and "--grammar-max-spec-bytes" in err["message"], err
            assert err["message"].startswith(f"{name} is "), err
        ok = _chat(c, regex="(yes|no)")
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no")


def _gauge(c, name: str) -> float:
    text = c.get("/metrics").text
    return float(re.search(rf"^radixserve:{name}\{{[^}}]*\}} (\S+)$", text, re.M).group(1))


def test_one_clients_deep_schemas_leave_a_worker_to_others(limited):
    """Three deep schemas from one peer (127.0.0.1) compile one at a time, so another peer
    (127.0.0.2) has its small grammar compiled at once meanwhile; each deep compile is
    killed at the time limit (the last ones time out waiting for their turn)."""
    with limited.client() as c:
        assert _chat(c, regex="[0-9]").status_code == 200  # the compile processes have booted
        killed = _gauge(c, "num_grammar_compiles_killed")
    answers = {}

    def deep(i: int) -> None:
        with limited.client() as c:
            answers[i] = _chat(c, json_schema=deep_tree_schema(i))

    threads = [threading.Thread(target=deep, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    with limited.client() as c:  # wait until the engine has all three (no push event over HTTP)
        deadline = time.monotonic() + TIMEOUT
        while _gauge(c, "num_grammar_queue_reqs") < 3:
            assert time.monotonic() < deadline, "the deep schemas never reached the engine"
    other = httpx.HTTPTransport(local_address="127.0.0.2")
    with limited.client(transport=other) as c:
        start = time.monotonic()
        small = _chat(c, regex="[a-c]")
        took = time.monotonic() - start
        assert small.status_code == 200, small.text
        assert _gauge(c, "num_grammar_queue_reqs") == 3, "the deep compiles ended before the check"
    assert took < TIMEOUT / 2, f"another client's one-character regex took {took:.2f} s"
    for t in threads:
        t.join(60)
    for r in answers.values():
        assert r.status_code == 400 and "timed out" in r.json()["error"]["message"], r.text
    with limited.client() as c:
        assert 1 <= _gauge(c, "num_grammar_compiles_killed") - killed <= 3
    limited.wait_idle()


def test_the_audited_costly_requests_are_400s(limited):
    """What slowed every stream before the per-request bounds: 100k stop strings, a
    full-vocabulary logit_bias (n = 16). Under the default body limit they arrive whole and
    are refused naming the field; the server serves the next request."""
    with limited.client() as c:
        for fields, name in (({"stop": [f"s{i}" for i in range(100_000)]}, "stop"),
                             ({"logit_bias": {str(t): 1 for t in range(49152)}}, "logit_bias")):
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "n": 16, **fields})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == name
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200

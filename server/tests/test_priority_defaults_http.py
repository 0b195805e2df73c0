"""Priority scheduling and sampling defaults over HTTP, on a tiny random-weight Llama whose
generation_config.json makes silent requests greedy (top_k 1).

Two servers, started together: ``urgent`` (--enable-priority-scheduling,
--max-running-requests 2, the model's sampling defaults) and ``plain`` (--sampling-defaults
openai, --abort-on-priority-when-disabled)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from serverproc import start_server

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from tiny_models import build_checkpoint  # noqa: E402  (the repository's shared test checkpoints)

CONTEXT = 16384  # long enough that the low-priority requests are still running when the urgent one ends
PROMPT = "w5 w6 w7 w8"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("prio_defaults_http"))
    build_checkpoint(path, "llama", seed=5, max_position_embeddings=CONTEXT)
    gen_path = os.path.join(path, "generation_config.json")
    with open(gen_path) as fh:
        gen = json.load(fh)
    with open(gen_path, "w") as fh:
        json.dump({**gen, "top_k": 1, "top_p": 0.9}, fh)
    common = ("--model", path, "--dtype", "float32", "--context-length", str(CONTEXT),
              "--max-total-tokens", str(3 * CONTEXT))
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_server, *common, "--enable-priority-scheduling", "--max-running-requests", "2"),
                   pool.submit(start_server, *common, "--sampling-defaults", "openai",
                               "--abort-on-priority-when-disabled")]
        procs = []
        try:
            for f in futures:
                procs.append(f.result())
        finally:
            if len(procs) < len(futures):
                for sp in procs:
                    sp.stop()
    yield procs
    with ThreadPoolExecutor(2) as pool:
        codes = list(pool.map(lambda sp: sp.stop(), procs))
    for sp, code in zip(procs, codes):
        assert code == 0, f"server exited with {code}:\n{sp.log()}"


@pytest.fixture()
def urgent(servers):
    yield servers[0]
    servers[0].wait_idle()


@pytest.fixture()
def plain(servers):
    yield servers[1]
    servers[1].wait_idle()


def first_token(lines) -> None:
    """Read a completion stream until its first generated text (the request is running)."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            if json.loads(line[6:])["choices"][0]["text"]:
                return
    raise AssertionError("the stream ended before its first token")


def test_urgent_request_preempts_and_finishes_first(urgent):
    low = {"prompt": PROMPT, "max_tokens": CONTEXT - 16, "ignore_eos": True, "stream": True, "priority": 5}
    lines = []  # each stream's line iterator, kept alive (a dropped one closes its stream)
    with urgent.client() as c, contextlib.ExitStack() as streams:
        for _ in range(2):  # fill both running slots with long low-priority requests
            r = streams.enter_context(c.stream("POST", "/v1/completions", json=low))
            assert r.status_code == 200
            lines.append(r.iter_lines())
            first_token(lines[-1])
        with urgent.client() as c2:
            # without preemption this would wait for a low-priority request: many seconds more
            r = c2.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "priority": 0}, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            info = c2.get("/get_server_info").json()
            assert info["in_flight"] == 2  # both earlier low-priority requests are still running
            assert info["stats"]["num_preemptions"] == 1
            metrics = c2.get("/metrics").text
            assert any(ln.startswith("radixserve:num_preemptions{") and float(ln.rsplit(" ", 1)[1]) == 1.0
                       for ln in metrics.splitlines())
        # closing the streams aborts the low-priority requests; wait_idle checks nothing leaked


def test_priority_on_every_endpoint_and_its_type(urgent):
    with urgent.client() as c:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        # the tiny tokenizer has no chat template: a template error, not a priority error
        assert c.post("/v1/chat/completions", json={**chat, "priority": 1}).json()["error"]["param"] == "messages"
        r = c.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 2}, "priority": -3})
        assert r.status_code == 200, r.text
        for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
                           ("/v1/chat/completions", chat),
                           ("/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}})):
            for bad in ("high", 1.5, True):
                r = c.post(path, json={**body, "priority": bad})
                assert r.status_code == 400 and r.json()["error"]["param"] == "priority", (path, bad, r.text)


def test_priority_refused_when_disabled_with_abort_flag(plain):
    with plain.client() as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "priority": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert "--enable-priority-scheduling" in r.json()["error"]["message"]
        r = c.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 2}, "priority": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def completions(sp, **fields) -> list[str]:
    with sp.client() as c:
        outs = []
        for seed in (1, 2):
            r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True,
                                                "seed": seed, **fields})
            assert r.status_code == 200, r.text
            outs.append(r.json()["choices"][0]["text"])
        return outs


def test_model_sampling_defaults_apply_where_the_request_is_silent(urgent):
    with urgent.client() as c:
        info = c.get("/get_model_info").json()
        assert info["preferred_sampling_params"] == {"top_k": 1, "top_p": 0.9}
        greedy = completions(urgent, temperature=0)[0]
        assert completions(urgent) == [greedy, greedy]  # silent: the model's top_k 1
        sampled = completions(urgent, top_k=-1)  # the request's own field wins
        assert greedy not in sampled and sampled[0] != sampled[1]
        r = c.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True,
                                                                          "seed": 3}})
        assert r.status_code == 200 and r.json()["text"] == greedy  # /generate too


def test_openai_sampling_defaults_ignore_the_model(plain):
    with plain.client() as c:
        assert c.get("/get_model_info").json()["preferred_sampling_params"] is None
    greedy = completions(plain, temperature=0)[0]
    assert greedy not in completions(plain)

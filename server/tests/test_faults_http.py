"""Fault isolation over HTTP, with the fault-injection plugin (tests/plugins/faults)
installed for the server's processes only.

A marked request (failing in the attention backend's metadata, with NaN logits, in the
sampler, or in its grammar matcher) gets a 500 with an OpenAI-style error body; a
neighbour running at the same time gets exactly the tokens it gets alone; the engine's
leak invariant holds; the server answers the next request.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import pytest
from radixserve.testing.install import install_plugin, pythonpath_with
from serverproc import start_server

FAULTS_SRC = Path(__file__).resolve().parents[2] / "tests" / "plugins" / "faults"
METADATA, NAN, BATCH = 7, 8, 9  # the plugin's default marker tokens
NEIGHBOUR = {"input_ids": [504, 3458, 282, 4649, 314], "sampling_params": {
    "temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}}


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory):
    site = install_plugin(FAULTS_SRC, tmp_path_factory.mktemp("faults"))
    sp = start_server("--attention-backend", "faulty", "--grammar-backend", "faulty",
                      env={"PYTHONPATH": pythonpath_with(site)})
    yield sp
    code = sp.stop()
    assert code == 0, f"server exited with {code}:\n{sp.log()}"


@pytest.fixture(scope="module")
def alone(faulty_server):
    with faulty_server.client() as c:
        r = c.post("/generate", json=NEIGHBOUR)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]


MARKED = {
    "metadata": ({"input_ids": [504, METADATA, 282]}, {}, "injected fault in init_forward_metadata"),
    "nan": ({"input_ids": [NAN, 504, 282]}, {}, "NaN logits"),
    "sampler": ({"input_ids": [504, 282]}, {"top_k": 4242, "temperature": 0.7}, "injected fault in the sampler"),
    "fill_bitmask": ({"input_ids": [504, 282]}, {"regex": "fill:100,101,102"}, "injected fault in fill_bitmask"),
    "accept_token": ({"input_ids": [504, 282]}, {"regex": "accept:100,101"}, "injected fault in accept_token"),
}


@pytest.mark.parametrize("where", list(MARKED))
def test_marked_request_fails_alone_over_http(faulty_server, alone, where):
    prompt, params, message = MARKED[where]
    marked = {**prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, **params}}
    with faulty_server.client() as c, concurrent.futures.ThreadPoolExecutor(4) as pool:
        neighbour = pool.submit(c.post, "/generate", json=NEIGHBOUR)
        bad = [pool.submit(c.post, "/generate", json=marked) for _ in range(2)]
        for f in bad:
            r = f.result()
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert message in err["message"] and err["type"] and set(err) >= {"message", "type", "param", "code"}
        ok = neighbour.result()
        assert ok.status_code == 200, ok.text
        assert ok.json()["output_ids"] == alone
    faulty_server.wait_idle()
    with faulty_server.client() as c:  # the server goes on
        assert c.post("/generate", json=NEIGHBOUR).json()["output_ids"] == alone
        stream = c.post("/v1/completions", json={"prompt": [504, 282], "max_tokens": 4, "stream": True,
                                                 "regex": "fill:100,101,102"})
        assert stream.status_code == 200 and "data: [DONE]" in stream.text and "injected fault" in stream.text


def test_a_batch_failure_fails_that_batch_only(faulty_server, alone):
    """Two prompts in one /generate (one prefill batch) that fail together, with no single
    culprit: both get 500, then the server serves the next request."""
    with faulty_server.client() as c:
        r = c.post("/generate", json={"input_ids": [[504, 282, 11], [BATCH, 504]],
                                      "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 500 and "injected batch fault" in r.json()["error"]["message"]
        assert c.post("/generate", json=NEIGHBOUR).json()["output_ids"] == alone
    faulty_server.wait_idle()


def test_nan_prompt_joining_running_decodes_fails_alone(faulty_server, alone):
    """A marked prompt that arrives while the neighbour decodes is prefilled in a mixed
    step (the default): it still fails alone, and the neighbour's tokens do not change."""
    marked = {"input_ids": [NAN, 504, 282], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
    with faulty_server.client() as c, c.stream("POST", "/generate", json={**NEIGHBOUR, "stream": True}) as s:
        lines = s.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        assert first != "data: [DONE]"
        with faulty_server.client() as c2:
            r = c2.post("/generate", json=marked)
        assert r.status_code == 500 and "NaN logits" in r.json()["error"]["message"], r.text
        chunks = [line for line in lines if line.startswith("data:") and line != "data: [DONE]"]
    last = json.loads((chunks or [first])[-1][5:])
    assert last["output_ids"] == alone
    faulty_server.wait_idle()

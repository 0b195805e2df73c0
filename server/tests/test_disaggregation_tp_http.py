"""Prefill-decode disaggregation with ``--tp-size 2`` on either side (a tiny random Llama of 2
KV heads; each transfer engine: mooncake over TCP, torch_dist over gloo, nixl over UCX): every
rank's transfer engine writes the KV heads its pool holds (prefill) or checks those that
arrived (decode).

Servers of TP 2 and TP 1 paired every way (2-2: one whole-pool piece per rank; 2-1: the decode
pool takes a head from each prefill rank; 1-2: each decode rank gets its head from the one
prefill rank; 2-2 only with torch_dist and nixl) give one engine's greedy tokens for several
requests at once, and every side ends idle with no leaked page. A decode server of TP 2 whose
prefill server is gone fails the request alone (503) and serves the next one."""

from __future__ import annotations

import os
import random
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from radixserve.registry import get_registry
from serverproc import free_port, start_server

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from tiny_models import build_checkpoint  # noqa: E402  (the repository's shared test checkpoints)

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
ENV = {"RES_OPTIONS": "timeout:1 attempts:1"}
FLAGS = ["--device", "cpu", "--num-threads", "1", "--log-level", "warning", "--dtype", "float32",
         "--enable-leak-check", "--disaggregation-transfer-timeout", "5"]


@pytest.fixture(scope="module", params=("mooncake", "torch_dist"))
def servers(request, tmp_path_factory):
    """Servers of TP 1 and 2 on each side with mooncake; TP 2 on both with torch_dist (nixl's TP
    paths are the engine-level tests' of tests/test_disaggregation_engine.py: suite time)."""
    reason = get_registry().get("kv_transfer", request.param).unavailable_reason()
    if reason is not None:
        pytest.skip(f"{request.param} transfer engine unavailable: {reason}")
    path = str(tmp_path_factory.mktemp("tiny_disagg_tp"))
    build_checkpoint(path, "llama", seed=5, max_position_embeddings=4096)  # 4 heads, 2 KV heads
    sizes = (1, 2) if request.param == "mooncake" else (2,)
    ports = {tp: free_port() for tp in sizes}
    plans = {("prefill", tp): ["--disaggregation-mode", "prefill", "--tp-size", str(tp),
                               "--disaggregation-bootstrap-port", str(ports[tp])] for tp in sizes}
    plans.update({("decode", tp): ["--disaggregation-mode", "decode", "--tp-size", str(tp), "--page-size", "4"]
                  for tp in sizes})
    plans["single"] = []
    flags = [*FLAGS, "--disaggregation-transfer-backend", request.param]
    started = {}
    with ThreadPoolExecutor(len(plans)) as pool:  # start-up is mostly waiting: all at once
        jobs = {key: pool.submit(start_server, "--model", path, *flags, *args, env=ENV) for key, args in plans.items()}
    try:
        for key, job in jobs.items():
            started[key] = job.result()
        yield started, ports
    finally:
        for job in jobs.values():
            if job.exception() is None:
                job.result().stop()


def generate(server, ids, **extra) -> dict:
    with server.client(timeout=120.0) as c:
        r = c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY, **extra})
        assert r.status_code == 200, r.text
        return r.json()


def disaggregated(prefill, decode, port, ids) -> tuple[dict, dict]:
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": random.getrandbits(63)}
    with ThreadPoolExecutor(2) as pool:
        p, d = pool.submit(generate, prefill, ids, **boot), pool.submit(generate, decode, ids, **boot)
        return p.result(), d.result()


def received(server) -> int:
    with server.client() as c:
        return c.get("/server_info").json()["stats"]["num_disagg_received"]


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 2), (2, 1), (1, 2)])
def test_tokens_equal_one_engine_with_tp_on_either_side(servers, prefill_tp, decode_tp):
    started, ports = servers
    if ("prefill", prefill_tp) not in started or ("decode", decode_tp) not in started:
        pytest.skip("TP 2 to TP 1 and back is the core's head plan, whatever the transport: checked with mooncake")
    prefill, decode = started[("prefill", prefill_tp)], started[("decode", decode_tp)]
    rng = random.Random(prefill_tp * 10 + decode_tp)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (6, 23, 41)]
    before = received(decode)
    with ThreadPoolExecutor(len(prompts)) as pool:
        jobs = [(ids, pool.submit(disaggregated, prefill, decode, ports[prefill_tp], ids)) for ids in prompts]
        for ids, job in jobs:
            first, out = job.result()
            want = generate(started["single"], ids)["output_ids"]
            assert out["output_ids"] == want, (prefill_tp, decode_tp, len(ids))
            assert first["output_ids"] == want[:1]  # the prefill server answers its one token
    assert received(decode) - before == len(prompts)
    for s in (prefill, decode):
        s.wait_idle()


def test_a_gone_prefill_server_fails_the_tp_decode_request_alone(servers):
    started, ports = servers
    decode = started[("decode", 2)]
    with decode.client(timeout=60.0) as c:
        r = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY, "bootstrap_host": "127.0.0.1",
                                      "bootstrap_port": free_port(), "bootstrap_room": 1})
    assert r.status_code == 503, r.text
    ids = [9, 8, 7, 6]
    out = disaggregated(started[("prefill", 2)], decode, ports[2], ids)[1]
    assert out["output_ids"] == generate(started["single"], ids)["output_ids"]
    decode.wait_idle(timeout=30)  # the failed request's pages wait out the transfer timeout, then are freed
    with httpx.Client() as c:  # both TP servers still answer
        for s in (decode, started[("prefill", 2)]):
            assert c.get(s.url + "/health").status_code == 200

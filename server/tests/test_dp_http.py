"""``radixserve serve --dp-size 2`` on a tiny model: the router spreads requests per policy,
the answers are one engine's, per-replica numbers show, and a replica's death takes the
server down loudly."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import httpx
import pytest
from radixserve.config import ConfigError
from serverproc import start_server

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from tiny_models import build_checkpoint  # noqa: E402  (the repository's shared test checkpoints)

PREFIX_A = [(7 * i + 3) % 290 + 5 for i in range(48)]
PREFIX_B = [(11 * i + 5) % 290 + 5 for i in range(48)]
GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_dp"))
    build_checkpoint(path, "llama", seed=5)
    return path


@pytest.fixture(scope="module")
def dp_server(tiny):
    sp = start_server("--model", tiny, "--dtype", "float32", "--dp-size", "2", "--num-threads", "1")
    yield sp
    code = sp.stop()
    assert code == 0, f"server exited with {code}:\n{sp.log()}"


def replicas(c: httpx.Client) -> list[dict]:
    return c.get("/get_server_info").json()["stats"]["dp_replicas"]


def test_cache_aware_keeps_each_prefix_on_one_replica_and_answers_like_one_engine(dp_server, tiny):
    prompts = [(PREFIX_A if k % 2 == 0 else PREFIX_B) + [200 + k, 201 + k] for k in range(6)]
    with dp_server.client() as c:
        outs = []
        for ids in prompts:  # one at a time: the loads stay balanced, the cache decides
            r = c.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY})
            assert r.status_code == 200, r.text
            outs.append(r.json())
        reps = replicas(c)
    assert [r["num_routed"] for r in reps] == [3, 3]  # group A on one replica, group B on the other
    assert all(o["meta_info"]["cached_tokens"] >= len(PREFIX_A) for o in outs[2:])  # every later one hits
    assert sum(r["num_cached_prompt_tokens"] for r in reps) >= 4 * len(PREFIX_A)
    import radixserve

    with radixserve.Engine(tiny, dtype="float32", max_total_tokens=4096) as engine:
        expect = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [e["output_ids"] for e in expect]
    dp_server.wait_idle()


def test_per_replica_numbers_in_server_info_and_metrics(dp_server):
    with dp_server.client() as c:
        info = c.get("/get_server_info").json()
        metrics = c.get("/metrics").text
    assert info["server_args"]["dp_size"] == 2
    assert info["engine"]["dp_size"] == 2 and info["engine"]["load_balance_method"] == "cache_aware"
    stats = info["stats"]
    reps = stats["dp_replicas"]
    assert [r["dp_rank"] for r in reps] == [0, 1] and all(r["alive"] for r in reps)
    assert len({r["pid"] for r in reps}) == 2
    assert stats["max_total_num_tokens"] == sum(r["max_total_num_tokens"] for r in reps)
    assert stats["num_prompt_tokens"] == sum(r["num_prompt_tokens"] for r in reps)
    for rank in ("0", "1"):
        assert f'radixserve:dp_num_routed{{dp_rank="{rank}",' in metrics
        assert f'radixserve:dp_max_total_num_tokens{{dp_rank="{rank}",' in metrics
    assert any(r["tree_size"] for r in reps)
    with dp_server.client() as c:  # /health_generate probes every replica
        assert c.get("/health_generate").status_code == 200
        assert [r["num_routed"] for r in replicas(c)] == [r["num_routed"] + 1 for r in reps]
    with dp_server.client() as c:  # a flush empties every replica's cache and the router's trees
        assert c.post("/flush_cache").json()["success"]
        reps = replicas(c)
    assert all(r["tree_size"] == 0 and r["num_cached_tokens"] == 0 for r in reps)


def test_round_robin_spreads_and_a_dead_replica_takes_the_server_down(tiny):
    sp = start_server("--model", tiny, "--dtype", "float32", "--dp-size", "2", "--num-threads", "1",
                      "--load-balance-method", "round_robin")
    try:
        with sp.client() as c:
            outs = [c.post("/generate", json={"input_ids": PREFIX_A, "sampling_params": GREEDY}).json()
                    for _ in range(4)]
            assert len({tuple(o["output_ids"]) for o in outs}) == 1  # both replicas answer alike
            reps = replicas(c)
            assert [r["num_routed"] for r in reps] == [2, 2]
            result: dict = {}

            def long_request():
                with sp.client() as c2:
                    result["r"] = c2.post("/generate", json={
                        "input_ids": PREFIX_B, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})

            t = threading.Thread(target=long_request)
            t.start()
            deadline = time.monotonic() + 30
            while sum(r["num_in_flight"] for r in replicas(c)) == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        os.kill(reps[1]["pid"], signal.SIGKILL)  # the replica without the long request
        t.join(30)
        r = result["r"]
        assert r.status_code == 503, r.text
        assert "data-parallel replica 1" in r.json()["error"]["message"]
        start = time.monotonic()
        code = sp.proc.wait(15)
        assert code == 1 and time.monotonic() - start < 10, sp.log()
        assert "data-parallel replica 1: the engine process was killed by SIGKILL" in sp.log()
    finally:
        sp.stop(signal.SIGKILL)


def test_the_engine_alone_refuses_dp(tiny):
    import radixserve

    with pytest.raises(ConfigError, match="radixserve serve --dp-size 2"):
        radixserve.Engine(tiny, dp_size=2)

"""A MoE model behind the HTTP server: expert load in /metrics and get_server_info, the
expert distribution endpoints, and a dense model's 400 for them."""

from __future__ import annotations

import json
import os
import sys

import pytest
from serverproc import start_server

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from tiny_models import build_checkpoint  # noqa: E402  (the repository's shared test checkpoints)


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_moe_http"))
    build_checkpoint(path, "qwen3_moe", seed=3)
    out = str(tmp_path_factory.mktemp("expert_records"))
    sp = start_server("--model", path, "--dtype", "float32", "--expert-distribution-recorder-mode", "stat",
                      "--expert-distribution-recorder-dir", out)
    yield sp, out
    code = sp.stop()
    assert code == 0, f"server exited with {code}:\n{sp.log()}"


def test_expert_load_in_metrics_and_the_record_endpoints(moe_server):
    sp, out = moe_server
    with sp.client() as c:
        r = c.post("/generate", json={"input_ids": list(range(3, 40)),
                                      "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert r.status_code == 200, r.text
        stats = c.get("/get_server_info").json()["stats"]
        tokens = stats["moe_expert_tokens"]
        assert sorted(tokens) == ["1", "3"]  # decoder_sparse_step 2: layers 1 and 3 are sparse
        assert all(sum(row) > 0 and len(row) == 8 for row in tokens.values())
        metrics = c.get("/metrics").text
        line = next(ln for ln in metrics.splitlines()
                    if ln.startswith("radixserve:moe_expert_tokens{") and 'layer="1"' in ln and 'expert="0"' in ln)
        assert float(line.rsplit(" ", 1)[1]) == tokens["1"][0]
        assert 'radixserve:moe_expert_imbalance{' in metrics
        assert c.post("/stop_expert_distribution_record").json()["success"]
        r = c.post("/dump_expert_distribution_record")
        assert r.status_code == 200, r.text
        path = r.json()["path"]
        assert os.path.dirname(path) == out
        with open(path) as fh:
            data = json.load(fh)
        assert data["format"] == "radixserve-expert-distribution" and data["mode"] == "stat"
        assert data["counts"] == [tokens["1"], tokens["3"]]
        assert c.post("/start_expert_distribution_record").json()["success"]
    sp.wait_idle()


def test_a_dense_model_answers_400(server):
    with server.client() as c:
        r = c.post("/dump_expert_distribution_record")
        assert r.status_code == 400
        assert "no MoE layers" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 200


def test_dp_attention_server_routes_by_routed_dp_rank(moe_server, tmp_path_factory):
    """``--tp-size 2 --dp-size 2 --enable-dp-attention``: one replica of two attention groups (no
    replica router); ``routed_dp_rank`` picks the group; tokens equal the one-rank server's."""
    one, _ = moe_server
    prompt = list(range(3, 40))
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    with one.client() as c:
        expected = c.post("/generate", json=body).json()["output_ids"]
    path = str(tmp_path_factory.mktemp("qwen3_moe_dp"))
    build_checkpoint(path, "qwen3_moe", seed=3)
    sp = start_server("--model", path, "--dtype", "float32", "--tp-size", "2", "--dp-size", "2",
                      "--enable-dp-attention", "--ep-size", "2")
    try:
        with sp.client() as c:
            r = c.post("/generate", json={**body, "routed_dp_rank": 1})
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == expected
            info = c.get("/get_server_info").json()
            usage = info["stats"]["dp_attention_token_usage"]
            assert usage[0] == 0 and usage[1] > 0, usage  # it ran in group 1 only
            r = c.post("/generate", json={**body, "routed_dp_rank": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "routed_dp_rank"
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 6
        sp.wait_idle()
    finally:
        code = sp.stop()
    assert code == 0, f"server exited with {code}:\n{sp.log()}"

"""Expert load statistics of a MoE model in the engine: the per-expert counters equal the
routing transformers computes on the same prompt, the recorder writes them to a file on
dump and at shutdown, and a dense model refuses the calls without harm."""

from __future__ import annotations

import os

import pytest
import radixserve
import torch
from radixserve.engine.expert_distribution import load_distribution
from tiny_models import build_checkpoint, random_prompts


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_moe_load"))
    hf = build_checkpoint(path, "qwen3_moe", seed=21).eval()
    return path, hf


def hf_expert_counts(hf, prompt: list[int]) -> dict[int, list[int]]:
    """Per sparse layer, (token, choice) pairs per expert as transformers routes ``prompt``."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_router_logits=True)
    cfg = hf.config
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    counts = {}
    for layer, logits in zip(sparse, out.router_logits):
        ids = torch.topk(torch.softmax(logits.float(), -1), cfg.num_experts_per_tok, dim=-1).indices
        counts[layer] = torch.bincount(ids.reshape(-1), minlength=cfg.num_experts).tolist()
    return counts


def test_counters_match_transformers_routing_and_the_record_is_dumped(qwen3_moe, tmp_path, assert_idle):
    path, hf = qwen3_moe
    prompt = random_prompts(1, 37, seed=3)[0]
    expected = hf_expert_counts(hf, prompt)
    engine = radixserve.Engine(path, dtype="float32", max_total_tokens=2048,
                               expert_distribution_recorder_mode="per_pass",
                               expert_distribution_recorder_dir=str(tmp_path))
    try:
        # one token out: a single prefill pass over the prompt, no decode step
        engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 1})
        stats = engine.get_stats()
        assert stats["moe_expert_tokens"] == expected
        assert stats["expert_distribution_recording"] is True
        for layer, row in expected.items():
            mean = sum(row) / len(row)
            assert stats["moe_expert_imbalance"][layer] == pytest.approx(max(row) / mean)
        data = load_distribution(engine.dump_expert_distribution_record())
        assert data["mode"] == "per_pass" and data["layers"] == sorted(expected)
        assert data["counts"] == [expected[i] for i in data["layers"]]
        assert data["num_forward_passes"] == 1 and data["num_tokens"] == len(prompt)
        assert [p["num_tokens"] for p in data["passes"]] == [len(prompt)]

        # a new recording starts from zero; decode passes add top_k pairs per token and layer
        engine.start_expert_distribution_record()
        engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 5})
        engine.stop_expert_distribution_record()
        engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 3})  # not recorded
        data = load_distribution(engine.dump_expert_distribution_record())
        top_k = hf.config.num_experts_per_tok
        assert data["num_tokens"] == sum(p["num_tokens"] for p in data["passes"])
        assert all(sum(row) == top_k * data["num_tokens"] for row in data["counts"])
        assert len(data["passes"]) == data["num_forward_passes"] >= 5  # a prefill (cached prefix) + 4 decodes
        assert_idle(engine)
    finally:
        before = set(os.listdir(tmp_path))
        engine.shutdown()
    written = set(os.listdir(tmp_path)) - before
    assert len(before) == 2 and len(written) == 1  # the two dumps, then the one at shutdown
    assert load_distribution(str(tmp_path / written.pop()))["counts"] == data["counts"]  # still stopped


def test_a_dense_model_refuses_the_recorder_calls_and_keeps_serving(tmp_path):
    path = str(tmp_path / "llama")
    build_checkpoint(path, "llama", seed=1)
    with radixserve.Engine(path, dtype="float32", max_total_tokens=1024) as engine:
        engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1})  # the loop thread runs
        with pytest.raises(ValueError, match="no MoE layers"):
            engine.dump_expert_distribution_record()
        assert "moe_expert_tokens" not in engine.get_stats()
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"temperature": 0, "max_new_tokens": 2})
        assert len(out["output_ids"]) == 2


def test_bad_recorder_mode_names_the_flag():
    from radixserve.config import ConfigError, ServerArgs

    with pytest.raises(ConfigError, match="--expert-distribution-recorder-mode.*stat, per_pass"):
        ServerArgs(expert_distribution_recorder_mode="all")
    with pytest.raises(ConfigError, match="--expert-distribution-recorder-buffer-size"):
        ServerArgs(expert_distribution_recorder_buffer_size=0)

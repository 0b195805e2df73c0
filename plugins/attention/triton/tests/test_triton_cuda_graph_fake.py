"""The triton backend under the core's CUDA-graph runner, on CPU: a fake capture
(:class:`radixserve.engine.cuda_graph.FakeGraphCapturer`) replays by re-running the model
over the bucket's static batch and fails if the backend's decode metadata is not the very
buffers captured. Greedy tokens of a tiny random Llama with graphs (batches padded to the
captured sizes 1, 2, 4) equal eager triton's. The real capture runs in test_triton_gpu.py
and scripts/gpu_check.sh on a GPU."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
if os.path.join(ROOT, "tests") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "tests"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from tiny_models import build_checkpoint

    path = str(tmp_path_factory.mktemp("triton-graph-llama"))
    build_checkpoint(path, "llama", seed=6, max_position_embeddings=256)
    return path


def test_fake_graph_replay_gives_eager_tokens(tiny, monkeypatch):
    from engine_checks import leak_checked_engine
    from radixserve.engine.cuda_graph import FakeGraphCapturer
    from tiny_models import random_prompts

    monkeypatch.setenv("RADIXSERVE_PLUGINS", "radixserve-attention-torch,radixserve-attention-triton")
    prompts = random_prompts(3, 10, seed=2)
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in (2, 4, 6)]
    out = {}
    for mode in ("eager", "graph"):
        with leak_checked_engine(tiny, attention_backend="triton", page_size=4, max_running_requests=4,
                                 context_length=128, cuda_graph_bs=[1, 2, 4]) as engine:
            assert engine.runner.attn_backend.supports_cuda_graph
            if mode == "graph":
                engine.runner.init_cuda_graphs(FakeGraphCapturer())
            out[mode] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
            stats = engine.get_stats()
            if mode == "graph":  # 3 -> 4 (padded), 2 -> 2, 1 -> 1
                assert set(stats["cuda_graph_replays_by_bs"]) == {1, 2, 4}
    assert out["graph"] == out["eager"]

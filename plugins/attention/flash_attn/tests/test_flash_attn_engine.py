"""``radixserve.Engine(attention_backend="fa3" / "fa2")`` gives torch_native's greedy tokens
on the default model, on the GPU (bfloat16 for both: FlashAttention computes in 16 bits).
Skips with the backend's probe reason where it cannot run."""

from __future__ import annotations

import pytest
import radixserve_attention_flash_attn as plugin

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
PROMPTS = [STORY, "def fibonacci(n):", "The capital of France is"]
FOLLOW_UP = STORY + " every morning"  # reuses the first prompt's cached pages
PROBES = {"fa3": plugin.fa3_unavailable_reason, "fa2": plugin.fa2_unavailable_reason}


def _greedy_tokens(engine) -> list[list[int]]:
    engine.flush_cache()
    outs = engine.generate(PROMPTS, [{"temperature": 0.0, "max_new_tokens": 8}] * len(PROMPTS))
    follow = engine.generate(FOLLOW_UP, {"temperature": 0.0, "max_new_tokens": 4})
    assert follow["meta_info"]["cached_tokens"] >= 16, "the follow-up prompt did not reuse the cache"
    engine.check_idle_invariant()
    return [o["output_ids"] for o in outs] + [follow["output_ids"]]


@pytest.mark.parametrize("name,page_size", [("fa3", 16), ("fa2", 16), ("fa2", 256)])
def test_same_greedy_tokens_as_torch_native(monkeypatch, name, page_size):
    reason = PROBES[name]()
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    import radixserve

    monkeypatch.setenv("RADIXSERVE_PLUGINS", "radixserve-attention-torch,radixserve-attention-flash-attn")
    tokens = {}
    # two engines, not a backend swapped into one: decode steps replay CUDA graphs captured
    # with the engine's backend
    for backend in (name, "torch_native"):
        with radixserve.Engine(attention_backend=backend, device="cuda", dtype="bfloat16",
                               page_size=page_size, max_total_tokens=4096, context_length=512,
                               max_running_requests=4) as engine:
            tokens[backend] = _greedy_tokens(engine)
    assert tokens[name] == tokens["torch_native"]

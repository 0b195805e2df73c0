"""``radixserve.Engine(attention_backend="triton")`` gives torch_native's greedy tokens on the
default model. Without a GPU the kernels run in Triton's interpreter, which is slow over 30
layers: the prompts are short, few tokens are generated, and the model is loaded once (the
torch_native reference swaps its attention backend into the same engine)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

# Longer than a page (16), so the follow-up prompt reuses the first one's cached pages and
# the extend kernel reads a cached prefix through the token-slot table.
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
PROMPTS = [STORY, "def fibonacci(n):"]
FOLLOW_UP = STORY + " every morning"


def _greedy_tokens(engine) -> list[list[int]]:
    """A batched prefill and a decode step, then a prefill over a cached prefix."""
    engine.flush_cache()
    outs = engine.generate(PROMPTS, [{"temperature": 0.0, "max_new_tokens": 2}] * len(PROMPTS))
    follow = engine.generate(FOLLOW_UP, {"temperature": 0.0, "max_new_tokens": 1})
    assert follow["meta_info"]["cached_tokens"] >= 16, (
        "the follow-up prompt did not reuse the cache"
    )
    engine.check_idle_invariant()
    return [o["output_ids"] for o in outs] + [follow["output_ids"]]


def _swap_attention_backend(engine, backend) -> None:
    engine.runner.attn_backend = backend
    engine.runner.model.set_attention_backend(backend)


def test_same_greedy_tokens_as_torch_native(monkeypatch):
    import radixserve
    from radixserve_attention_torch import TorchNativeAttention
    from radixserve_attention_triton.backend import TritonAttention

    # Load only the attention plugins: a half-installed plugin elsewhere must not fail this.
    monkeypatch.setenv(
        "RADIXSERVE_PLUGINS", "radixserve-attention-torch,radixserve-attention-triton"
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = radixserve.Engine(
        attention_backend="triton",
        device=device,
        dtype="float32",
        page_size=16,
        max_total_tokens=1024,
        context_length=256,
        max_running_requests=4,
    )
    try:
        backend = engine.runner.attn_backend
        assert isinstance(backend, TritonAttention)
        got = _greedy_tokens(engine)
        _swap_attention_backend(engine, TorchNativeAttention(backend.ctx))
        expected = _greedy_tokens(engine)
    finally:
        engine.shutdown()
    assert got == expected
    assert [len(ids) for ids in got] == [2, 2, 1]

"""Context parallelism (``--attn-cp-size``, gloo on CPU): a long prefill's tokens split over
whole-model ranks, attention passing K/V round the ring with online-softmax merging.

* The pieces: partial attentions over key blocks merge into exactly the attention over all
  keys; which steps are split.
* Greedy tokens equal one rank's: CP 2 on tiny Llama (pages of 1 and 16, chunked prefill so
  later chunks attend to a cached prefix, the radix cache serving a long shared prefix,
  mixed steps), a MoE model, the default model; every rank ends with the whole KV (decode
  runs on every rank as on one); nothing leaks.
* A CP rank killed mid-request ends the request and the engine naming it; flags CP does not
  combine with yet are refused naming them.
"""

from __future__ import annotations

import os
import random

import pytest
import radixserve
import torch
import torch.nn.functional as F
from radixserve.config import ConfigError
from radixserve.distributed.context import MIN_TOKENS, _merge, _partial, splits, token_bounds
from radixserve.layers.attention import AttentionLayer, ForwardMode
from test_multi_rank import _follower_pids, assert_a_killed_follower_ends_the_request
from test_pipeline_parallel import _mixed_batch
from tiny_models import build_checkpoint

GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
COMMON = dict(max_total_tokens=4096, enable_leak_check=True)


def test_partial_attentions_merge_into_the_whole():
    torch.manual_seed(0)
    layer = AttentionLayer(0, 4, 2, 8, 8 ** -0.5, None)
    q, k, v = torch.randn(6, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    mask = torch.rand(6, 10) > 0.3
    mask[:, 0] = True
    mask[5] = False  # a row that sees no key in these blocks
    out = torch.zeros(6, 4, 8)
    lse = torch.full((6, 4), float("-inf"))
    rows = torch.arange(6)
    for a, b in ((0, 4), (4, 7), (7, 10)):
        o, s = _partial(q, k[a:b], v[a:b], mask[:, a:b], layer)
        _merge(out, lse, rows, o, s)
    ref = F.scaled_dot_product_attention(q[:5].transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
                                         v.repeat_interleave(2, 1).transpose(0, 1), attn_mask=mask[:5],
                                         scale=layer.scaling).transpose(0, 1)
    assert torch.allclose(out[:5], ref, atol=1e-5)
    assert torch.equal(out[5], torch.zeros(4, 8)) and torch.isinf(lse[5]).all()


def test_which_steps_are_split():
    batch = _mixed_batch()
    assert not splits(batch)  # 7 tokens: below MIN_TOKENS
    long = batch.__class__(**{**batch.__dict__, "input_ids": torch.zeros(MIN_TOKENS, dtype=torch.int64)})
    assert splits(long)
    assert not splits(long.__class__(**{**long.__dict__, "mode": ForwardMode.DECODE}))
    assert not splits(long.__class__(**{**long.__dict__, "capture_final_hidden": True}))
    assert token_bounds(7, 2) == [(0, 4), (4, 7)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("cp_llama"))
    build_checkpoint(path, "llama", seed=7, num_hidden_layers=4, max_position_embeddings=1024)
    return path


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in (300, 90, 7, 150)]


def _run(path, rounds, **kw) -> tuple[list, dict]:
    with radixserve.Engine(path, **{**COMMON, **kw}) as engine:
        outs = [[o["output_ids"] for o in engine.generate(input_ids=r, sampling_params=GREEDY)] for r in rounds]
        stats = {"split": engine.runner.context.num_split_steps if engine.runner.context else 0}
    return outs, stats


@pytest.mark.parametrize("kw", [dict(page_size=1), dict(page_size=16, chunked_prefill_size=100),
                                dict(disable_mixed_chunk=True)], ids=["pages1", "pages16-chunked", "no-mixed"])
def test_cp2_gives_one_ranks_tokens(tiny, kw):
    first = _prompts()
    again = [p + _prompts(1)[i][:80] for i, p in enumerate(first)]  # the cached prompt plus 80 new tokens
    rounds = [first, again]
    want, _ = _run(tiny, rounds, **kw)
    got, stats = _run(tiny, rounds, attn_cp_size=2, **kw)
    assert got == want
    assert stats["split"] >= 2  # the first prefill, and the second round's over a cached prefix


def test_moe_and_the_default_model_with_cp2(tmp_path, default_model_file):
    path = str(tmp_path / "moe")
    build_checkpoint(path, "qwen3_moe", seed=3, max_position_embeddings=1024)
    rounds = [_prompts()]
    assert _run(path, rounds, attn_cp_size=2)[0] == _run(path, rounds)[0]
    model = os.path.join(*default_model_file)
    prompt = {"prompt": "Here is a long story about a lighthouse keeper. " * 20,
              "sampling_params": {**GREEDY, "max_new_tokens": 8}}
    with radixserve.Engine(model, max_total_tokens=2048) as one:
        want = one.generate(**prompt)["output_ids"]
    with radixserve.Engine(model, max_total_tokens=2048, attn_cp_size=2) as two:
        assert two.generate(**prompt)["output_ids"] == want
        assert two.runner.context.num_split_steps >= 1


def test_a_killed_cp_rank_ends_the_request_and_the_engine(tiny):
    assert_a_killed_follower_ends_the_request(radixserve.Engine(tiny, attn_cp_size=2, **COMMON), _prompts()[0], 400)


@pytest.mark.parametrize("flags,match", [
    (dict(tp_size=2), "--tp-size with --attn-cp-size 2"),
    (dict(pp_size=2), "--pp-size with --attn-cp-size 2"),
    (dict(disaggregation_mode="decode"), "--disaggregation-mode with --attn-cp-size 2"),
])
def test_refused_with_cp(tiny, flags, match):
    with pytest.raises(ConfigError, match=match):
        radixserve.Engine(tiny, attn_cp_size=2, **{**COMMON, **flags})
    assert _follower_pids() == []

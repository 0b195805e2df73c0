"""Pipeline parallelism (``--pp-size``, gloo on CPU): the layers split into stages, each stage's
ranks holding only their layers' weights and KV, micro-batches passed stage to stage.

* The stage split: even by layer count, or ``SGLANG_PP_LAYER_PARTITION``; what cannot be split
  is refused naming the flag or the variable.
* A batch cut into micro-batches: a mixed batch's parts become extend, decode or mixed batches
  whose rows, slots and logits rows are the whole batch's.
* Greedy tokens equal one rank's: PP 2 on tiny Llama (pages of 1 and 16, chunked prefill, the
  radix cache warm, a grammar, one request per micro-batch, an uneven split), TP 2 x PP 2 (4
  ranks), a MoE model, the default model; speculative decoding (NGRAM, a draft model) and
  HiCache with PP 2; nothing leaks.
* A stage killed mid-request ends the request and the engine with a message naming it.
* Flags that do not work with PP yet are refused naming them.
"""

from __future__ import annotations

import os

import pytest
import radixserve
import torch
from radixserve.config import ConfigError
from radixserve.distributed.pipeline import PARTITION_ENV, micro_bounds, split_batch, stage_layers
from radixserve.layers.attention import ForwardBatch, ForwardMode
from test_multi_rank import _follower_pids, assert_a_killed_follower_ends_the_request
from tiny_models import build_checkpoint

GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(20, 61)), [9, 3, 4], [100, 3, 77, 100, 3, 77, 100]]
COMMON = dict(max_total_tokens=2048, enable_leak_check=True)


# ------------------------------------------------------------------ the split
def test_stages_split_layers_evenly_or_as_the_variable_says(monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    assert [stage_layers(30, 4, r) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [stage_layers(4, 1, 0)] == [(0, 4)]
    monkeypatch.setenv(PARTITION_ENV, "3,1")
    assert [stage_layers(4, 2, r) for r in range(2)] == [(0, 3), (3, 4)]
    for bad in ("2,1", "4,0", "a,b", "1,1,2"):
        monkeypatch.setenv(PARTITION_ENV, bad)
        with pytest.raises(ConfigError, match=PARTITION_ENV):
            stage_layers(4, 2, 0)
    monkeypatch.delenv(PARTITION_ENV)
    with pytest.raises(ConfigError, match="--pp-size 5"):
        stage_layers(4, 5, 0)


def _mixed_batch() -> ForwardBatch:
    """Two extends (3 and 2 tokens) and two decode rows, logits at each request's last row."""
    ext = [3, 2, 1, 1]
    t = sum(ext)
    return ForwardBatch(mode=ForwardMode.MIXED, batch_size=4, input_ids=torch.arange(100, 100 + t),
                        positions=torch.arange(t), req_pool_indices=torch.tensor([7, 8, 9, 10]),
                        seq_lens=torch.tensor([3, 6, 9, 12]), out_cache_loc=torch.arange(50, 50 + t),
                        seq_lens_cpu=[3, 6, 9, 12], prefix_lens_cpu=[0, 4, 8, 11], extend_lens_cpu=ext,
                        req_to_token=torch.zeros(1), kv_pool=None,
                        logits_indices=torch.tensor(ext).cumsum(0) - 1, num_decode=2)


def test_a_mixed_batch_splits_into_batches_of_its_own_rows():
    batch = _mixed_batch()
    assert micro_bounds(batch, 2, None) == [(0, 2), (2, 4)]
    assert micro_bounds(batch, 2, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert micro_bounds(batch, 2, 8) == [(0, 4)]
    extend, decode = split_batch(batch, 0, 2), split_batch(batch, 2, 4)
    assert extend.mode is ForwardMode.EXTEND and decode.mode is ForwardMode.DECODE
    assert extend.input_ids.tolist() == [100, 101, 102, 103, 104] and extend.logits_indices.tolist() == [2, 4]
    assert decode.input_ids.tolist() == [105, 106] and decode.out_cache_loc.tolist() == [55, 56]
    assert decode.logits_indices.tolist() == [0, 1] and decode.req_pool_indices.tolist() == [9, 10]
    both = split_batch(batch, 1, 3)
    assert both.mode is ForwardMode.MIXED and both.num_decode == 1 and both.extend_lens_cpu == [2, 1]
    assert both.positions.tolist() == [3, 4, 5] and both.seq_lens_cpu == [6, 9]
    verify = ForwardBatch(**{**batch.__dict__, "mode": ForwardMode.TARGET_VERIFY, "num_decode": 0})
    assert micro_bounds(verify, 2, 1) == [(0, 4)]  # a verify batch goes through whole


# ------------------------------------------------------------------ engines
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("pp_llama"))
    build_checkpoint(path, "llama", seed=7, num_hidden_layers=4, max_position_embeddings=512)
    return path


@pytest.fixture(scope="module")
def one_rank(tiny) -> list[list[int]]:
    with radixserve.Engine(tiny, **COMMON) as one:
        return [o["output_ids"] for o in one.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def _outputs(path, prompts=PROMPTS, params=GREEDY, twice=False, **kw) -> tuple[list, dict]:
    with radixserve.Engine(path, **{**COMMON, **kw}) as engine:
        runs = 2 if twice else 1  # the second run: every prompt's prefix cached
        outs = [[o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
                for _ in range(runs)]
        stats = engine.get_stats()
        stats["micro_batches"] = engine.runner.pipeline.num_micro_batches
        stats["steps"] = engine.scheduler.stats.num_forward_steps
    assert all(o == outs[0] for o in outs)
    return outs[0], stats


@pytest.mark.parametrize("kw", [
    dict(page_size=1), dict(page_size=16, chunked_prefill_size=8), dict(pp_max_micro_batch_size=1),
    dict(disable_mixed_chunk=True, enable_overlap_schedule=True),
], ids=["pages1", "pages16-chunked", "micro1", "no-mixed-overlap"])
def test_pp2_gives_one_ranks_tokens(tiny, one_rank, kw):
    got, stats = _outputs(tiny, pp_size=2, twice=True, **kw)
    assert got == one_rank
    assert stats["num_cached_prompt_tokens"] > 0
    assert stats["micro_batches"] > stats["steps"]  # steps ran as several micro-batches
    if kw.get("enable_overlap_schedule"):
        assert stats["num_overlap_steps"] > 0  # decode steps overlapped across the stages too


def test_uneven_split_and_tp2_x_pp2(tiny, one_rank, monkeypatch):
    monkeypatch.setenv(PARTITION_ENV, "3,1")  # the followers inherit the environment
    assert _outputs(tiny, pp_size=2)[0] == one_rank
    monkeypatch.delenv(PARTITION_ENV)
    assert _outputs(tiny, pp_size=2, tp_size=2)[0] == one_rank  # 4 ranks: two stages of two


def test_a_grammar_and_hidden_states_with_pp2(tiny):
    params = [{"temperature": 0.0, "max_new_tokens": 6, "regex": "w1[0-9]( w2[0-9])+"},  # the tiny vocabulary's words
              {**GREEDY, "max_new_tokens": 4, "return_hidden_states": True}]
    with radixserve.Engine(tiny, **COMMON) as one:
        want = one.generate(input_ids=PROMPTS[:2], sampling_params=params)
    with radixserve.Engine(tiny, pp_size=2, **COMMON) as two:
        got = two.generate(input_ids=PROMPTS[:2], sampling_params=params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    # the last stage's final hidden states reach rank 0
    for g, w in zip(got[1]["meta_info"]["hidden_states"], want[1]["meta_info"]["hidden_states"], strict=True):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-4)
    assert all(10 <= t <= 29 for t in got[0]["output_ids"][:-1]), got[0]["output_ids"]  # the grammar held


def test_moe_model_with_pp2(tmp_path):
    path = str(tmp_path / "moe")
    build_checkpoint(path, "qwen3_moe", seed=3, max_position_embeddings=512)  # layers 1, 3 sparse
    with radixserve.Engine(path, **COMMON) as one:
        want = [o["output_ids"] for o in one.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    assert _outputs(path, pp_size=2)[0] == want


def test_speculative_decoding_with_pp2(tiny, one_rank):
    for kw in (dict(speculative_algorithm="NGRAM"),
               dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny)):
        got, stats = _outputs(tiny, pp_size=2, speculative_disable_by_batch_size=1 << 20, **kw)
        assert got == one_rank and stats["spec_num_draft_tokens"] > 0, kw


def test_hicache_with_pp2(tiny):
    from test_hicache import PARAMS, SMALL, conversations, run_rounds

    small = dict(max_total_tokens=SMALL, disable_mixed_chunk=True, page_size=4, enable_leak_check=True)
    with radixserve.Engine(tiny, **{**small, "max_total_tokens": 4096}) as one:
        want = run_rounds(one, conversations())
    with radixserve.Engine(tiny, pp_size=2, enable_hierarchical_cache=True, hicache_ratio=8, **small) as two:
        assert run_rounds(two, conversations()) == want
        assert two.get_stats()["hicache_host_hit_tokens"] > 0
    assert PARAMS["temperature"] == 0.0


def test_the_default_model_with_pp2(default_model_file):
    path = os.path.join(*default_model_file)
    prompt = {"prompt": "The capital of France is", "sampling_params": {**GREEDY, "max_new_tokens": 8}}
    with radixserve.Engine(path, max_total_tokens=1024) as one:
        want = one.generate(**prompt)["output_ids"]
    with radixserve.Engine(path, max_total_tokens=1024, pp_size=2) as two:
        assert two.generate(**prompt)["output_ids"] == want


# ------------------------------------------------------------------ faults and refusals
def test_a_killed_stage_ends_the_request_and_the_engine(tiny):
    assert_a_killed_follower_ends_the_request(radixserve.Engine(tiny, pp_size=2, **COMMON), [5, 6, 7], 400)


@pytest.mark.parametrize("flags,match", [
    (dict(ep_size=2, tp_size=2), "--ep-size with --pp-size 2"),
    (dict(disaggregation_mode="prefill"), "--disaggregation-mode with --pp-size 2"),
    (dict(speculative_algorithm="EAGLE3"), "EAGLE3 with --pp-size 2"),
    (dict(pp_max_micro_batch_size=0), "--pp-max-micro-batch-size"),
])
def test_refused_with_pp(tiny, flags, match):
    with pytest.raises(ConfigError, match=match):
        radixserve.Engine(tiny, pp_size=2, **{**COMMON, **flags})
    assert _follower_pids() == []

"""DP attention for MoE models (``--enable-dp-attention --dp-size D``, gloo on CPU): the
``--tp-size`` ranks form D attention groups, each with its own requests, KV pool and prefix
cache; MoE layers run expert-parallel over all ranks on every group's tokens.

* Cutting a group's requests out of a batch: a mixed batch's rows, slots and logits rows.
* Greedy tokens equal one rank's: Qwen3-MoE and Mixtral at DP 2 (pages of 1 and 16, chunked
  prefill and mixed steps, both a2a transports), attention TP 2 inside each group of a 4-rank
  Qwen2-MoE (shared expert, dense layer); nothing leaks in any group.
* A lone request runs in one group while the other's ranks only join the MoE layers.
* Placement: a request whose prefix one group caches goes there; others to the least loaded.
* A rank killed mid-request ends the request and the engine; invalid flags are refused.
"""

from __future__ import annotations

import pytest
import radixserve
import torch
from radixserve.config import ConfigError
from radixserve.distributed.dp_attention import select_requests
from radixserve.layers.attention import ForwardBatch, ForwardMode
from test_multi_rank import _follower_pids, assert_a_killed_follower_ends_the_request
from tiny_models import build_checkpoint, random_prompts

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
COMMON = dict(device="cpu", num_threads=1, max_total_tokens=4096, enable_leak_check=True, log_level="warning")
DP2 = dict(tp_size=2, dp_size=2, enable_dp_attention=True)


def test_a_groups_requests_cut_out_of_a_mixed_batch():
    ext = [3, 2, 1, 1]  # two extends, two decode rows
    t = sum(ext)
    batch = ForwardBatch(mode=ForwardMode.MIXED, batch_size=4, input_ids=torch.arange(100, 100 + t),
                         positions=torch.arange(t), req_pool_indices=torch.tensor([7, 8, 9, 10]),
                         seq_lens=torch.tensor([3, 6, 9, 12]), out_cache_loc=torch.arange(50, 50 + t),
                         seq_lens_cpu=[3, 6, 9, 12], prefix_lens_cpu=[0, 4, 8, 11], extend_lens_cpu=ext,
                         req_to_token=torch.zeros(1), kv_pool=None,
                         logits_indices=torch.tensor([1, 2, 4, 5, 6]), num_decode=2, dp_groups=[0, 1, 1, 0])
    g0, g1 = select_requests(batch, [0, 3]), select_requests(batch, [1, 2])
    assert g0.mode is ForwardMode.MIXED and g0.num_decode == 1 and g0.extend_lens_cpu == [3, 1]
    assert g0.input_ids.tolist() == [100, 101, 102, 106] and g0.out_cache_loc.tolist() == [50, 51, 52, 56]
    assert g0.logits_indices.tolist() == [1, 2, 3] and g0.req_pool_indices.tolist() == [7, 10]
    assert g0.dp_groups == [0, 0]
    assert g1.mode is ForwardMode.MIXED and g1.positions.tolist() == [3, 4, 5] and g1.seq_lens_cpu == [6, 9]
    assert g1.logits_indices.tolist() == [1, 2]
    decode = select_requests(batch, [2, 3])
    assert decode.mode is ForwardMode.DECODE and decode.num_decode == 0 and decode.input_ids.tolist() == [105, 106]
    assert select_requests(batch, []).batch_size == 0


# ------------------------------------------------------------------ engines
@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    out = {}
    for variant in ("qwen3_moe", "mixtral", "qwen2_moe"):
        out[variant] = str(tmp_path_factory.mktemp(variant))
        build_checkpoint(out[variant], variant, seed=3, max_position_embeddings=2048)
    return out


PROMPTS = random_prompts(5, 12, seed=5) + [list(range(3, 40))]
_one_rank: dict = {}


def _tokens(path: str, prompts=PROMPTS, **kw) -> tuple[list[list[int]], dict]:
    with radixserve.Engine(path, **{**COMMON, **kw}) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        return [o["output_ids"] for o in outs], engine.get_stats()


def one_rank(path: str, page_size: int) -> list[list[int]]:
    key = (path, page_size)
    if key not in _one_rank:
        _one_rank[key] = _tokens(path, page_size=page_size)[0]
    return _one_rank[key]


@pytest.mark.parametrize("variant,kw", [
    ("qwen3_moe", dict(ep_size=2)),
    ("qwen3_moe", dict(ep_size=2, page_size=16, chunked_prefill_size=8)),
    ("mixtral", dict(ep_size=2, moe_a2a_backend="torch_distributed", page_size=16)),
    ("mixtral", dict(ep_size=1, chunked_prefill_size=8)),  # each expert's intermediate split over both ranks
    ("qwen3_moe", dict(ep_size=2, enable_overlap_schedule=True, disable_mixed_chunk=True)),
], ids=["qwen3-ep2", "qwen3-pages16-chunked", "mixtral-a2a-pages16", "mixtral-moe-tp2", "qwen3-overlap"])
def test_dp2_gives_one_ranks_tokens(models, variant, kw):
    got, stats = _tokens(models[variant], **DP2, **kw)
    assert got == one_rank(models[variant], kw.get("page_size", 1))
    assert all(u > 0 for u in stats["dp_attention_token_usage"])  # both groups held requests' pages
    if kw.get("enable_overlap_schedule"):
        assert stats["num_overlap_steps"] > 0


def test_attention_tp2_inside_each_group(models):
    """4 ranks: two attention groups of two TP ranks; Qwen2-MoE's shared expert summed per group."""
    path = models["qwen2_moe"]
    got, _ = _tokens(path, tp_size=4, dp_size=2, enable_dp_attention=True, ep_size=2)
    assert got == one_rank(path, 1)


def test_a_lone_request_runs_in_one_group_while_the_other_only_joins_the_moe_layers(models):
    path = models["qwen3_moe"]
    expected = one_rank(path, 1)[-1]
    got, stats = _tokens(path, prompts=[PROMPTS[-1]], **DP2, ep_size=2)
    assert got == [expected]
    usage = stats["dp_attention_token_usage"]
    assert sorted(u > 0 for u in usage) == [False, True], usage


def test_a_cached_prefix_draws_its_request_to_that_group(models):
    path = models["qwen3_moe"]
    shared = list(range(3, 40))
    with radixserve.Engine(path, **COMMON, **DP2) as engine:
        first = engine.generate(input_ids=shared + [50, 51], sampling_params=GREEDY)
        assert engine.get_stats()["dp_attention_group_load_tokens"] == [0, 0]
        # one request with the same long prefix, one unrelated: the first goes where the prefix is
        outs = engine.generate(input_ids=[shared + [60, 61], [200, 201, 202]], sampling_params=GREEDY)
        usage = engine.get_stats()["dp_attention_token_usage"]
    assert first["meta_info"]["cached_tokens"] == 0
    assert outs[0]["meta_info"]["cached_tokens"] >= 32  # its group's cache held the prefix
    assert all(u > 0 for u in usage)  # the unrelated one went to the idle group


def test_the_default_model_with_dp_attention(default_model_file):
    """A dense model: the attention groups are replicas in step (no MoE layer to share)."""
    prompts = [[1, 2, 3, 4, 5, 6], list(range(100, 140)), [7, 8, 9]]
    ref, _ = _tokens(None, prompts=prompts, num_threads=None)
    got, stats = _tokens(None, prompts=prompts, num_threads=None, **DP2)
    assert got == ref
    assert all(u > 0 for u in stats["dp_attention_token_usage"])


# ------------------------------------------------------------------ faults and refusals
def test_a_killed_rank_ends_the_request_and_the_engine(models):
    assert_a_killed_follower_ends_the_request(radixserve.Engine(models["qwen3_moe"], **COMMON, **DP2), [5, 6, 7], 1500)


@pytest.mark.parametrize("flags,match", [
    (dict(tp_size=3, dp_size=2), "--dp-size 2 must divide --tp-size 3"),
    (dict(tp_size=2, dp_size=2, pp_size=2), "--pp-size with --enable-dp-attention"),
    (dict(tp_size=2, dp_size=2, speculative_algorithm="NGRAM"), "--speculative-algorithm with --enable-dp-attention"),
    (dict(tp_size=2, dp_size=2, enable_hierarchical_cache=True), "--enable-hierarchical-cache with"),
])
def test_refused_with_dp_attention(models, flags, match):
    with pytest.raises(ConfigError, match=match):
        radixserve.Engine(models["qwen3_moe"], enable_dp_attention=True, **{**COMMON, **flags})
    assert _follower_pids() == []

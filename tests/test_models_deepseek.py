"""DeepSeek-V2-Lite-, V2- and V3-shaped tiny random models (tiny_models.MLA_VARIANTS) against
transformers on the same weights: MLA over the latent KV cache, dense first layer, routed and
shared experts, grouped routing (V2's group-limited greedy, V3's sigmoid with the correction
bias), YaRN.

* Greedy tokens equal transformers' for pages of 1 and 16: a fresh batch (the expanded-form
  prefill), the same prompts again from the radix cache (the absorbed form over a cached
  prefix), and chunked prefill with mixed steps.
* Prompt logits close to transformers' (not only their argmax).
* The pool holds one latent row per token and layer: kv_lora_rank + qk_rope_head_dim values.
* The triton attention backend (interpreted: MLA's two forms) and the triton MoE runner give the
  same tokens, and so do EPLB's redundant experts;
  expert parallelism (both transports), tensor parallelism of the heads and DP attention on
  two gloo ranks give one rank's tokens.
* Single-batch overlap computes the shared experts between the dispatch's start and its wait;
  two-batch overlap starts both micro-batches' dispatches before waiting for either.
* NGRAM and EAGLE-3 speculative decoding keep the tokens (verify steps in the absorbed form); HiCache's host
  and file tiers keep the latent pages.
* A backend without MLA is refused naming the flag; flags MLA cannot run with are refused.
"""

from __future__ import annotations

import pytest
import radixserve
import torch
from radixserve.config import ConfigError
from radixserve_attention_torch.backend import TorchNativeAttention
from tiny_models import MLA_VARIANTS, build_checkpoint, random_prompts

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
COMMON = dict(device="cpu", num_threads=1, max_total_tokens=2048, enable_leak_check=True, log_level="warning")
PROMPTS = random_prompts(3, 12, seed=5) + [list(range(3, 40))]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """Per variant: checkpoint path, transformers model, its greedy tokens for PROMPTS."""
    out = {}
    for variant in MLA_VARIANTS:
        path = str(tmp_path_factory.mktemp(variant))
        hf = build_checkpoint(path, variant, seed=3).eval()
        with torch.no_grad():
            want = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
        out[variant] = dict(path=path, hf=hf, want=want)
    return out


def _tokens(engine, prompts=PROMPTS) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("variant", list(MLA_VARIANTS))
def test_greedy_tokens_equal_transformers(models, variant, page, monkeypatch):
    m = models[variant]
    calls = {"expanded": 0}
    plain = TorchNativeAttention.forward_mla_prefill

    def counted(self, *args):
        calls["expanded"] += 1
        return plain(self, *args)

    monkeypatch.setattr(TorchNativeAttention, "forward_mla_prefill", counted)
    with radixserve.Engine(m["path"], page_size=page, **COMMON) as engine:
        assert _tokens(engine) == m["want"]  # fresh prompts: the expanded prefill
        assert calls["expanded"] > 0
        expanded = calls["expanded"]
        assert _tokens(engine) == m["want"]  # every prompt's prefix cached: the absorbed form only
        assert calls["expanded"] == expanded
        assert engine.get_stats()["num_cached_prompt_tokens"] > 0
    with radixserve.Engine(m["path"], page_size=page, chunked_prefill_size=8, **COMMON) as engine:
        assert _tokens(engine) == m["want"]  # chunks over a prefix, mixed with decode rows


def test_prompt_logits_close_to_transformers(models):
    m = models["deepseek_v3"]
    prompt = PROMPTS[-1]
    with radixserve.Engine(m["path"], **COMMON) as engine:
        got = engine.runner.prompt_logits(prompt).float()
    with torch.no_grad():
        want = m["hf"](torch.tensor([prompt])).logits[0].float()
    assert torch.allclose(got, want, atol=2e-4, rtol=1e-4), (got - want).abs().max()


def test_the_pool_holds_one_latent_row_per_token(models):
    with radixserve.Engine(models["deepseek_v2"]["path"], **COMMON) as engine:
        cfg, pool = engine.model_config, engine.runner.kv_pool
        row = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        assert (pool.num_kv_heads, pool.head_dim, pool.v_head_dim) == (1, row, cfg.kv_lora_rank)
        assert pool.bytes_per_token == cfg.num_hidden_layers * row * 4
        # an equivalent multi-head cache: K and V of every head
        mha = cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                                 + cfg.v_head_dim) * 4
        assert pool.bytes_per_token < mha / 2


@pytest.mark.parametrize("kw", [
    dict(tp_size=2),
    dict(tp_size=2, ep_size=2),
    dict(tp_size=2, ep_size=2, moe_a2a_backend="torch_distributed", page_size=16),
    dict(tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2),
], ids=["tp2", "ep2-none", "ep2-a2a-pages16", "dp-attention2"])
def test_two_ranks_give_one_ranks_tokens(models, kw):
    m = models["deepseek_v3"]
    with radixserve.Engine(m["path"], **{**COMMON, **kw}) as engine:
        assert _tokens(engine) == m["want"]


def test_a_backend_without_mla_is_refused(models, monkeypatch):
    monkeypatch.setattr(TorchNativeAttention, "supports_mla", False)
    with pytest.raises(ConfigError, match="--attention-backend torch_native: this attention backend has no MLA"):
        radixserve.Engine(models["deepseek_v2_lite"]["path"], **COMMON)


@pytest.mark.parametrize("flags,match", [
    (dict(disaggregation_mode="prefill"), "--disaggregation-mode with DeepseekV2ForCausalLM"),
    (dict(attn_cp_size=2), "--attn-cp-size with DeepseekV2ForCausalLM"),
])
def test_flags_mla_cannot_run_with_are_refused(models, flags, match):
    with pytest.raises(ConfigError, match=match):
        radixserve.Engine(models["deepseek_v2_lite"]["path"], **{**COMMON, **flags})


def test_ngram_speculative_decoding_keeps_the_tokens(models):
    """Verify steps are extends over a cached prefix: the absorbed form with a tree mask."""
    from radixserve.testing.speculative_conformance import check_greedy_parity

    prompts = [[5, 6, 7, 8] * 3, list(range(3, 40)) * 2]
    stats = check_greedy_parity("ngram", models["deepseek_v3"]["path"], prompts, max_new_tokens=16,
                                max_total_tokens=2048)
    assert stats["spec_num_draft_tokens"] > 0


def test_eagle3_keeps_the_tokens(models, tmp_path):
    """EAGLE-3 over an MLA target: a random head (a Llama layer with a KV pool of its own) reads
    the outputs of the target's three layers; verify steps attend in the absorbed form. Greedy
    tokens equal plain decoding's."""
    pytest.importorskip("radixserve_speculative_eagle3")
    import json
    from collections import Counter

    from radixserve.models.config import ModelConfig
    from radixserve.testing.speculative_conformance import check_greedy_parity
    from radixserve_speculative_eagle3.checkpoint import expected_shapes, make_config, vocab_mapping, write_head
    from radixserve_speculative_eagle3.head import Eagle3Config

    path = models["deepseek_v3"]["path"]
    with open(f"{path}/config.json") as fh:
        target = ModelConfig.from_hf_dict(json.load(fh))
    config = make_config(target, 64, aux_layer_ids=(0, 1, 2))
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=g) / shape[-1] ** 0.5
               for name, shape in expected_shapes(Eagle3Config.from_dict(config)).items() if name not in ("d2t", "t2d")}
    tensors["d2t"], tensors["t2d"] = vocab_mapping(Counter(range(64)), 64, target.vocab_size)
    write_head(str(tmp_path), config, tensors)
    stats = check_greedy_parity("EAGLE3", path, [[5, 6, 7, 8] * 3, list(range(3, 40))], max_new_tokens=12,
                                max_total_tokens=2048, speculative_draft_model_path=str(tmp_path),
                                speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    assert stats["spec_num_draft_tokens"] > 0


def test_hicache_keeps_latent_pages(models, tmp_path):
    """The host tier and the file tier hold MLA's latent pages (K rows only): a device pool too
    small for the conversations gives the large pool's tokens, and a restarted engine is served
    from the file tier."""
    from test_hicache import PARAMS, SMALL, conversations, engine_for, run_rounds

    path = models["deepseek_v3"]["path"]
    rounds = conversations()
    with engine_for(path) as big:
        reference = run_rounds(big, rounds)
    small = dict(max_total_tokens=SMALL, disable_mixed_chunk=True, enable_hierarchical_cache=True)
    with engine_for(path, hicache_ratio=8, **small) as hi:
        assert run_rounds(hi, rounds) == reference
        assert hi.get_stats()["hicache_host_hit_tokens"] > 0
    storage = dict(hicache_ratio=4, hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
                   hicache_storage_dir=str(tmp_path / "kv"), **small)
    with engine_for(path, **storage) as first:
        run_rounds(first, rounds)
    last = rounds[-1]
    with engine_for(path, **storage) as second:
        outs = second.generate(input_ids=last, sampling_params=PARAMS)
        assert second.get_stats()["hicache_storage_hit_tokens"] > 0
    assert [o["output_ids"] for o in outs] == reference[-len(last):]


_INTERPRETED = r"""
import json, sys
import radixserve
from radixserve.layers.moe import moe_layers

a = json.load(sys.stdin)
results = []
for run in a["runs"]:
    with radixserve.Engine(run.pop("path"), dtype="float32", max_total_tokens=1024, **run) as engine:
        runners = sorted({layer.runner.name for _, layer in moe_layers(engine.runner.model)})
        params = {"temperature": 0.0, "max_new_tokens": a["n"], "ignore_eos": True}
        passes = [[o["output_ids"] for o in engine.generate(input_ids=a["prompts"], sampling_params=params)]
                  for _ in range(2)]  # the second from the radix cache
        results.append({"runners": runners, "passes": passes, "cached": engine.get_stats()["num_cached_prompt_tokens"],
                        "attention": type(engine.runner.attn_backend).__name__})
print("RESULT " + json.dumps(results))
"""


def _interpreted(runs: list[dict], prompts, n: int) -> list[dict]:
    """Engines started in one process with TRITON_INTERPRET=1 (it must be set before triton is
    imported): per run, its MoE runners, the attention backend's class, two passes of greedy
    tokens (the second over the radix cache) and the cached prompt tokens."""
    import json
    import os
    import subprocess
    import sys

    args = {"runs": runs, "prompts": prompts, "n": n}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], input=json.dumps(args), capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_triton_attention_and_moe_runner_under_the_interpreter(models):
    """The triton attention backend's MLA (expanded prefill, then the absorbed form over the cached
    prefix) for every variant on pages of 1 and 16, and DeepSeek's routed experts through the
    triton MoE runner at EP 1 and EP 2 (and under torch_native attention): transformers' tokens."""
    from radixserve.registry import get_registry

    registry = get_registry()
    if "triton" not in registry.names("attention") or "triton" not in registry.names("moe_runner"):
        pytest.skip("the triton attention backend or MoE runner is not installed")
    n = 3
    runs = [dict(path=models[v]["path"], attention_backend="triton", page_size=page)
            for v in MLA_VARIANTS for page in (1, 16)]
    runs += [dict(path=models["deepseek_v3"]["path"], attention_backend="triton", moe_runner_backend="triton",
                  page_size=16, **ep) for ep in ({}, dict(tp_size=2, ep_size=2, moe_a2a_backend="torch_distributed"))]
    runs.append(dict(path=models["deepseek_v2"]["path"], attention_backend="torch_native", moe_runner_backend="triton"))
    pick = [3]  # the 37-token prompt fills two pages of 16
    results = _interpreted(runs, [PROMPTS[i] for i in pick], n)
    for run, result in zip(runs, results):
        want = [w[:n] for i, w in enumerate(next(m for m in models.values() if m["path"] == run["path"])["want"])
                if i in pick]
        assert result["attention"] == {"triton": "TritonAttention", "torch_native": "TorchNativeAttention"}[
            run["attention_backend"]]
        assert result["passes"] == [want, want], run
        assert result["cached"] > 0
    assert results[-1]["runners"] == results[-2]["runners"] == results[-3]["runners"] == ["triton"]


def test_eplb_places_redundant_deepseek_experts(models, tmp_path):
    """The load one rank recorded places two redundant copies of the hottest routed experts
    over EP 2 (8 + 2 physical experts, 5 per rank); the tokens stay transformers'."""
    m = models["deepseek_v3"]
    with radixserve.Engine(m["path"], expert_distribution_recorder_mode="stat",
                           expert_distribution_recorder_dir=str(tmp_path), **COMMON) as engine:
        assert _tokens(engine) == m["want"]
        record = engine.dump_expert_distribution_record()
    with radixserve.Engine(m["path"], tp_size=2, ep_size=2, ep_num_redundant_experts=2, init_expert_location=record,
                           **COMMON) as engine:
        assert _tokens(engine) == m["want"]


def _trace_dispatches(a2a, events: list[str]) -> None:
    """Record "dispatch" when ``a2a`` starts a dispatch and "wait" when one is waited for."""
    start = a2a.dispatch_async

    def traced_start(*args):
        events.append("dispatch")
        pending = start(*args)
        finish = pending.wait
        pending.wait = lambda: (events.append("wait"), finish())[1]
        return pending

    a2a.dispatch_async = traced_start


def test_single_batch_overlap_runs_the_shared_experts_while_tokens_travel(models):
    """--enable-single-batch-overlap over EP 2 (torch_distributed): on rank 0 every MoE block
    starts its dispatch, computes its shared experts, then waits for the routed rows; the
    tokens stay transformers'."""
    from radixserve.layers.moe import moe_layers

    m = models["deepseek_v3"]
    events: list[str] = []
    kw = dict(tp_size=2, ep_size=2, moe_a2a_backend="torch_distributed", enable_single_batch_overlap=True)
    with radixserve.Engine(m["path"], **{**COMMON, **kw}) as engine:
        layers = [layer for _, layer in moe_layers(engine.runner.model)]
        a2a = layers[0].a2a  # one transport serves every layer
        _trace_dispatches(a2a, events)
        for layer in layers:
            def traced_shared(x, shared=layer.shared_output):
                events.append("shared")
                return shared(x)

            layer.shared_output = traced_shared
        assert _tokens(engine) == m["want"]
    assert events and events[:3] == ["dispatch", "shared", "wait"]
    assert events.count("dispatch") == events.count("shared") == events.count("wait")


@pytest.mark.parametrize("kw", [
    dict(tp_size=2, ep_size=2, moe_a2a_backend="torch_distributed"),
    dict(tp_size=2, ep_size=2, enable_single_batch_overlap=True, page_size=16),
], ids=["ep2-a2a", "ep2-none-sbo-pages16"])
def test_two_batch_overlap_interleaves_the_micro_batches(models, kw):
    """--enable-two-batch-overlap: on rank 0 each MoE layer of a step starts both micro-batches'
    dispatches before waiting for either (the second's attention ran in between), and the tokens
    stay transformers'."""
    from radixserve.layers.moe import moe_layers

    m = models["deepseek_v3"]
    events: list[str] = []
    with radixserve.Engine(m["path"], enable_two_batch_overlap=True, **{**COMMON, **kw}) as engine:
        a2a = moe_layers(engine.runner.model)[0][1].a2a
        _trace_dispatches(a2a, events)
        assert _tokens(engine) == m["want"]
        assert engine.runner.two_batch.num_steps > 0
    assert "dispatch,dispatch,wait,wait" in ",".join(events)


def test_two_batch_overlap_refusals_and_warnings(models, caplog):
    """Refused with DP attention (naming both flags); on one rank it has nothing to overlap and
    says so, the tokens unchanged."""
    m = models["deepseek_v2_lite"]
    with pytest.raises(ConfigError, match="--enable-two-batch-overlap with --enable-dp-attention"):
        radixserve.Engine(m["path"], enable_two_batch_overlap=True, tp_size=2, dp_size=2, enable_dp_attention=True,
                          **COMMON)
    with caplog.at_level("WARNING", logger="radixserve.engine.two_batch"):
        with radixserve.Engine(m["path"], enable_two_batch_overlap=True, **COMMON) as engine:
            assert engine.runner.two_batch is None
            assert _tokens(engine) == m["want"]
    assert any("--enable-two-batch-overlap on one rank" in r.message for r in caplog.records)

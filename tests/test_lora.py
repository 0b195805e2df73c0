"""LoRA adapters (``--enable-lora``, ``--lora-paths``) against PEFT on the same weights.

* A batch mixing three adapters of different ranks and targets with the base model gives each
  row PEFT's greedy tokens for its adapter (``PeftModel`` over the transformers model), also
  chunked (mixed prefill/decode steps) and with fewer adapter slots than adapters (requests
  wait for a slot; least recently used adapters leave).
* The radix cache keeps adapters apart: the same prompt under another adapter (or none) is
  not served from the first one's KV, and is under the same adapter.
* The same at tensor parallelism 2 (every rank holds its shard of each adapter in the slots
  rank 0 picks), and on a Qwen2 model (biased QKV).
* Adapters load and unload while requests run, on every rank, without a request failing or
  changing its tokens.
* Bad adapters and bad requests are refused naming the adapter or the field.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time

import pytest
import radixserve
import torch
from radixserve.config import ConfigError
from radixserve.engine.requests import RequestRejected
from tiny_models import build_checkpoint, build_lora_adapter, greedy, random_prompts

# peft imports triton: not at collection, where triton.language would be set up before the triton
# plugins' conftest asks for Triton's interpreter (the oracle is imported inside the fixtures)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="peft (the LoRA oracle) is not installed")

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
COMMON = dict(device="cpu", num_threads=1, max_total_tokens=4096, enable_leak_check=True, log_level="warning")
ADAPTERS = {  # name -> (rank, alpha, target modules)
    "a": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "b": (8, 16, ["q_proj", "v_proj"]),
    "c": (2, 4, ["o_proj", "down_proj", "up_proj"]),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    base = str(tmp_path_factory.mktemp("base"))
    hf = build_checkpoint(base, "llama", seed=1).eval()
    prompts = random_prompts(4, 12, seed=3) + [list(range(5, 45))]
    paths, oracles = {}, {None: hf}
    for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        paths[name] = str(tmp_path_factory.mktemp(f"lora-{name}"))
        oracles[name] = build_lora_adapter(paths[name], hf, rank, alpha, targets, seed=10 + i)
    want = {name: greedy(model, prompts, NEW) for name, model in oracles.items()}
    assert len({json.dumps(w) for w in want.values()}) == len(want), "the adapters must change the tokens"
    return dict(base=base, paths=paths, prompts=prompts, want=want, oracles=oracles)


def _tapes_possible() -> bool:
    from radixserve.kernels import cpu

    return cpu.load() is not None


def _lora_paths(setup) -> list[str]:
    return [f"{n}={p}" for n, p in setup["paths"].items()]


def _mixed(setup) -> tuple[list[list[int]], list, list[list[int]]]:
    """Every prompt under every adapter and the base, interleaved in one batch."""
    names = [None, *ADAPTERS]
    prompts, lora, want = [], [], []
    for i, p in enumerate(setup["prompts"]):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            prompts.append(p)
            lora.append(name)
            want.append(setup["want"][name][i])
    return prompts, lora, want


@pytest.mark.parametrize("kw", [{}, dict(chunked_prefill_size=8, page_size=16), dict(max_loras_per_batch=2),
                                dict(tp_size=2, max_loras_per_batch=2), dict(enable_overlap_schedule=True)],
                         ids=["one-batch", "chunked-pages16", "two-slots", "tp2-two-slots", "overlap"])
def test_a_mixed_batch_gives_each_row_pefts_tokens(setup, kw):
    prompts, lora, want = _mixed(setup)
    with radixserve.Engine(setup["base"], lora_paths=_lora_paths(setup), **{**COMMON, **kw}) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=lora)
        assert [o["output_ids"] for o in outs] == want
        if "max_loras_per_batch" in kw:
            assert len(engine.runner.lora.slots) == 2
        if "enable_overlap_schedule" in kw:
            assert engine.get_stats()["num_overlap_steps"] > 0
        if not kw and _tapes_possible():  # decode steps with adapters replay kernel tapes
            assert engine.get_stats()["cuda_graph_replays"] > 0


def test_qwen2_with_biased_qkv(tmp_path):
    """A Qwen2 model (QKV with bias): three adapters and the base in one batch give PEFT's tokens."""
    hf = build_checkpoint(str(tmp_path / "base"), "qwen2", seed=2).eval()
    prompts = random_prompts(3, 10, seed=6)
    oracles, paths = {None: hf}, []
    for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        oracles[name] = build_lora_adapter(str(tmp_path / name), hf, rank, alpha, targets, seed=30 + i)
        paths.append(f"{name}={tmp_path / name}")
    names = [None, *ADAPTERS]
    lora = [names[(i + j) % 4] for i in range(len(prompts)) for j in range(2)]
    batch = [p for p in prompts for _ in range(2)]
    want = [greedy(oracles[n], [p], NEW)[0] for n, p in zip(lora, batch)]
    assert want != greedy(hf, batch, NEW), "the adapters must change the tokens"
    with radixserve.Engine(str(tmp_path / "base"), lora_paths=paths, **COMMON) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=GREEDY, lora_path=lora)
    assert [o["output_ids"] for o in outs] == want


@pytest.mark.parametrize("tp", [1, 2])
def test_load_and_unload_while_requests_run(setup, tp):
    """A scheduler thread serves a long mixed batch while another thread loads and unloads an
    adapter again and again (every rank), and tries to unload one the batch uses: refused
    while its requests are queued or running; no request fails or changes its tokens, and
    adapters loaded meanwhile serve PEFT's tokens."""
    from radixserve.lora.adapter import LoRAError

    paths, new = setup["paths"], 24
    prompts = setup["prompts"][:3] * 3
    lora = [None, "a", "b"] * 3
    want = [greedy(setup["oracles"][n], [p], new)[0] for n, p in zip(lora, prompts)]
    with radixserve.Engine(setup["base"], lora_paths=[f"a={paths['a']}", f"b={paths['b']}"], max_lora_rank=8,
                           lora_target_modules=["all"], max_loras_per_batch=2, tp_size=tp, **COMMON) as engine:
        engine._ensure_loop()  # a scheduler thread: the calls below run between its steps
        box = {}
        worker = threading.Thread(target=lambda: box.update(outs=engine.generate(
            input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=new), lora_path=lora)))
        worker.start()
        while engine.get_stats()["num_running_reqs"] == 0 and worker.is_alive():
            time.sleep(0.001)  # the batch's first step: its requests now hold adapter a for 20+ more steps
        with pytest.raises(LoRAError, match="'a' is in use"):
            engine.unload_lora_adapter("a")
        cycles = 0
        while worker.is_alive() or cycles == 0:
            engine.load_lora_adapter("c", paths["c"])
            engine.unload_lora_adapter("c")
            cycles += 1
            try:
                engine.unload_lora_adapter("a")
            except LoRAError as e:
                assert "in use" in str(e)
            else:  # every request of a finished (were one still running, its tokens would change)
                engine.load_lora_adapter("a", paths["a"])
        worker.join()
        assert [o["output_ids"] for o in box["outs"]] == want
        engine.load_lora_adapter("c", paths["c"])
        out = engine.generate(input_ids=setup["prompts"][3], sampling_params=GREEDY, lora_path="c")
        assert out["output_ids"] == setup["want"]["c"][3]
        with pytest.raises(LoRAError, match="'missing'.*adapter_config.json not found"):
            engine.load_lora_adapter("missing", str(setup["base"]) + "/nowhere")
        assert sorted(engine.runner.lora.adapters) == ["a", "b", "c"]


def test_the_radix_cache_keeps_adapters_apart(setup):
    prompt = setup["prompts"][-1]
    with radixserve.Engine(setup["base"], lora_paths=_lora_paths(setup), **COMMON) as engine:
        first = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a")
        assert first["output_ids"] == setup["want"]["a"][-1]
        for other in ("b", None):  # the same prompt: nothing cached for another adapter, or the base
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=other)
            assert out["meta_info"]["cached_tokens"] == 0
            assert out["output_ids"] == setup["want"][other][-1]
        again = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a")
        assert again["meta_info"]["cached_tokens"] > 0
        assert again["output_ids"] == setup["want"]["a"][-1]


def test_bad_adapters_and_requests_are_refused(setup, tmp_path):
    with pytest.raises(ConfigError, match="'missing'.*adapter_config.json not found"):
        radixserve.Engine(setup["base"], lora_paths=[f"missing={tmp_path}"], **COMMON)
    with pytest.raises(ConfigError, match="'b': rank 8 is above --max-lora-rank 4"):
        radixserve.Engine(setup["base"], lora_paths=_lora_paths(setup), max_lora_rank=4, **COMMON)
    with pytest.raises(ConfigError, match="'a': targets down_proj, outside --lora-target-modules"):
        radixserve.Engine(setup["base"], lora_paths=_lora_paths(setup), lora_target_modules=["q_proj", "v_proj"],
                          **COMMON)
    wide = tmp_path / "wide"  # a tensor whose shape does not fit the model
    wide.mkdir()
    from safetensors.torch import load_file, save_file

    src = setup["paths"]["b"]
    tensors = load_file(os.path.join(src, "adapter_model.safetensors"))
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 1)
    save_file(tensors, str(wide / "adapter_model.safetensors"))
    (wide / "adapter_config.json").write_text(open(os.path.join(src, "adapter_config.json")).read())
    with pytest.raises(ConfigError, match="'wide': layer 0 .* do not fit the model"):
        radixserve.Engine(setup["base"], lora_paths=[f"wide={wide}"], **COMMON)
    with pytest.raises(ConfigError, match="--pp-size with --enable-lora"):
        radixserve.Engine(setup["base"], lora_paths=_lora_paths(setup), pp_size=2, **COMMON)
    with radixserve.Engine(setup["base"], lora_paths=_lora_paths(setup), **COMMON) as engine:
        with pytest.raises(RequestRejected, match="lora_path: unknown adapter 'nope'; loaded: a, b, c"):
            engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora_path="nope")
        assert engine.generate(input_ids=setup["prompts"][0], sampling_params=GREEDY,
                               lora_path="c")["output_ids"] == setup["want"]["c"][0]
    with radixserve.Engine(setup["base"], **COMMON) as engine:
        with pytest.raises(RequestRejected, match="serves no LoRA adapters"):
            engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora_path="a")


def test_load_and_unload_at_run_time(setup):
    """Adapters join and leave the pool between requests; one that queued or running requests use
    is refused, and an unloaded one is no longer served."""
    from radixserve.lora.adapter import LoRAError

    paths = setup["paths"]
    with radixserve.Engine(setup["base"], lora_paths=[f"a={paths['a']}"], max_lora_rank=8, lora_target_modules=["all"],
                           **COMMON) as engine:
        manager = engine.runner.lora
        manager.load("b", paths["b"])
        outs = engine.generate(input_ids=setup["prompts"][:2], sampling_params=GREEDY, lora_path=["b", "a"])
        assert [o["output_ids"] for o in outs] == [setup["want"]["b"][0], setup["want"]["a"][1]]
        with pytest.raises(LoRAError, match="'a' is in use"):
            manager.unload("a", {"a"})
        manager.unload("a", set())
        with pytest.raises(RequestRejected, match="unknown adapter 'a'; loaded: b"):
            engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY, lora_path="a")
        with pytest.raises(LoRAError, match="'b' is already loaded"):
            manager.load("b", paths["b"])


def test_hicache_storage_keys_include_the_adapter(setup, tmp_path):
    """A restarted engine finds a prompt's pages in the file tier under the adapter that computed
    them, and not under another adapter."""
    from test_hicache import wait_until_idle

    prompt = setup["prompts"][-1]
    kw = dict(COMMON, lora_paths=_lora_paths(setup), page_size=4, enable_hierarchical_cache=True, hicache_ratio=4,
              hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
              hicache_storage_dir=str(tmp_path / "kv"), max_total_tokens=256)
    with radixserve.Engine(setup["base"], **kw) as first:
        assert first.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a")["output_ids"] == \
            setup["want"]["a"][-1]
        wait_until_idle(first)
    with radixserve.Engine(setup["base"], **kw) as second:
        out = second.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="b")
        assert out["output_ids"] == setup["want"]["b"][-1]
        assert second.get_stats()["hicache_storage_hit_tokens"] == 0
        out = second.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a")
        assert out["output_ids"] == setup["want"]["a"][-1]
        assert second.get_stats()["hicache_storage_hit_tokens"] > 0


def test_ngram_speculative_decoding_verifies_with_the_adapter(setup):
    """NGRAM drafts from the request's own tokens; its verify steps run under each row's adapter,
    so the tokens stay PEFT's."""
    prompts = [[7, 8, 9, 10] * 4, [11, 12, 13] * 5, [7, 8, 9, 10] * 4]
    lora = ["a", "b", None]
    new = 16
    want = [greedy(setup["oracles"][name], [p], new)[0] for p, name in zip(prompts, lora)]
    with radixserve.Engine(setup["base"], lora_paths=_lora_paths(setup), speculative_algorithm="NGRAM",
                           speculative_disable_by_batch_size=64,
                           **COMMON) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=new), lora_path=lora)
        assert [o["output_ids"] for o in outs] == want
        assert engine.get_stats()["spec_num_draft_tokens"] > 0


def test_pool_limits_and_an_empty_start(setup):
    """--max-loaded-loras caps the loaded adapters; --enable-lora with no adapters needs the pool's
    rank and targets, then serves adapters loaded later."""
    from radixserve.lora.adapter import LoRAError

    paths = setup["paths"]
    with radixserve.Engine(setup["base"], lora_paths=[f"a={paths['a']}"], max_loaded_loras=1, max_lora_rank=8,
                           lora_target_modules=["all"], **COMMON) as engine:
        with pytest.raises(LoRAError, match="--max-loaded-loras"):
            engine.runner.lora.load("b", paths["b"])
    with pytest.raises(ConfigError, match="needs --max-lora-rank and --lora-target-modules"):
        radixserve.Engine(setup["base"], enable_lora=True, **COMMON)
    with radixserve.Engine(setup["base"], enable_lora=True, max_lora_rank=8, lora_target_modules=["all"],
                           **COMMON) as engine:
        assert engine.runner.lora.adapters == {}
        engine.runner.lora.load("c", paths["c"])
        out = engine.generate(input_ids=setup["prompts"][1], sampling_params=GREEDY, lora_path="c")
        assert out["output_ids"] == setup["want"]["c"][1]


@pytest.mark.slow
def test_the_default_model(hf_default_model, hf_default_tokenizer, tmp_path):
    """The default model (GGUF Q4_1 served by radixserve's kernels; transformers dequantises the
    same file): three adapters and the base in one batch give PEFT's greedy tokens."""
    from radixserve.model_loader import default_model_path

    prompts = [hf_default_tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
    specs = {"x": (8, 16, ["q_proj", "v_proj", "o_proj", "down_proj"]), "y": (4, 8, ["gate_proj", "up_proj"]),
             "z": (4, 8, ["k_proj", "up_proj", "down_proj"])}
    oracles, paths = {None: hf_default_model}, []
    for i, (name, (rank, alpha, targets)) in enumerate(specs.items()):
        oracles[name] = build_lora_adapter(str(tmp_path / name), hf_default_model, rank, alpha, targets, seed=40 + i,
                                           scale=2.0 if name == "z" else 1.0)
        paths.append(f"{name}={tmp_path / name}")
    lora = [None, "x", "y", "z"] * 2
    batch = [p for p in prompts for _ in range(4)]
    want = [greedy(oracles[n], [p], NEW)[0] for n, p in zip(lora, batch)]
    for j in (1, 2, 3):
        assert want[j] != want[0] or want[4 + j] != want[4], f"adapter {lora[j]} must change the tokens"
    with radixserve.Engine(default_model_path(), lora_paths=paths, **COMMON) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=GREEDY, lora_path=lora)
        assert [o["output_ids"] for o in outs] == want
        # structured output under an adapter: a regex that admits either model's greedy text picks
        # the adapter's branch for the adapter's request and the base's for the base's
        texts = [hf_default_tokenizer.decode(w) for w in want[:2]]
        assert texts[0] != texts[1] and not texts[1].startswith(texts[0]) and not texts[0].startswith(texts[1])
        regex = "(" + "|".join("".join("\\" + c if c in "\\.^$*+?{}[]|()" else c for c in t).replace("\n", "\\n")
                               for t in texts) + ")"
        params = dict(temperature=0.0, max_new_tokens=NEW + 4, regex=regex)
        outs = engine.generate(input_ids=[prompts[0]] * 2, sampling_params=[params] * 2, lora_path=["x", None])
        assert [o["text"] for o in outs] == texts[::-1]


def test_int8_base_weights(setup):
    """Weight-only int8 base layers (``--quantization w8a16_int8``) with the deltas added in
    float: whole greedy continuations drift apart after a first differing token (as without
    adapters, test_quantization), so the measure is the next token after each prompt: PEFT's
    (float base plus adapter) nearly always, the base model's much less often."""
    prompts = random_prompts(16, 10, seed=11)
    names = list(ADAPTERS)
    lora = [names[i % len(names)] for i in range(len(prompts))]
    with torch.no_grad():
        peft_first = [int(setup["oracles"][n](torch.tensor([p])).logits[0, -1].argmax()) for n, p in zip(lora, prompts)]
        base_first = [int(setup["oracles"][None](torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    with radixserve.Engine(setup["base"], lora_paths=_lora_paths(setup), quantization="w8a16_int8", **COMMON) as engine:
        assert {m.path for m in engine.runner.model.layers.modules() if hasattr(m, "method")} == {"w8a16_int8"}
        outs = engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, max_new_tokens=1), lora_path=lora)
    ours = [o["output_ids"][0] for o in outs]
    agree_peft = sum(a == b for a, b in zip(ours, peft_first))
    agree_base = sum(a == b for a, b in zip(ours, base_first))
    assert agree_peft >= 13 and agree_base <= 8, (agree_peft, agree_base)  # measured 15 and 0 of 16

"""Tiny random-weight Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints: our engine against transformers.

Each variant of ``tiny_models.MOE_VARIANTS`` is built from a transformers config with
random weights (routers scaled so that top-k choices never sit on a near-tie), saved with
``save_pretrained`` (Mixtral sharded, through ``model.safetensors.index.json``), and loaded
by both sides. With every MoE runner installed here we compare

* prompt logits with transformers' at every position, and
* greedy tokens with transformers' greedy ``generate`` (32 tokens), for several requests of
  different lengths in flight at once, through a small ``--chunked-prefill-size`` (prefill
  chunks of one request share steps with the decodes of the others) and with the radix
  cache serving a second request's shared prefix.

The Triton runner runs on CPU only through Triton's interpreter, which executes each kernel
program in Python: there it gets one small variant, short prompts and a few tokens. Triton
reads ``TRITON_INTERPRET`` when it is first imported, so unless the whole session was started
with it, that case runs in a subprocess started with it.
Also: GGUF files under llama.cpp's MoE names, transformers' fused in-memory expert names,
loading errors, the ``--moe-runner-backend`` flag, and expert weights held once.
"""

from __future__ import annotations

import copy
import glob
import json
import os
from dataclasses import dataclass

import pytest
import torch
from radixserve.layers.moe import SparseMoE, moe_layers
from radixserve.registry import get_registry
from tiny_models import (
    EOS,
    MOE_VARIANTS,
    VOCAB,
    build_checkpoint,
    random_prompts,
    round_to_f16,
    save_gguf,
    save_tokenizer,
)

NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 23, 61)  # 23 and 61 span several prefill chunks
CHUNK = 16  # --chunked-prefill-size
PAGE = 4
# float32 on both sides; differences come only from summation order (fused projections,
# paged attention, the runner's expert GEMMs). Measured max |diff| ~4e-6 on logits of ~4.
LOGITS_RTOL = 1e-4  # max |ours - hf| <= LOGITS_RTOL * max(1, max |hf|)

# The Triton runner under the interpreter: one variant, short prompts, few tokens.
INTERPRETED_VARIANT = "mixtral"
INTERPRETED_PROMPTS = 2
INTERPRETED_TOKENS = 4


def _runner_params() -> list:
    """Every MoE runner installed here (plus ``triton``, skipped with a reason when absent)."""
    reg = get_registry()
    names = sorted(set(reg.names("moe_runner")) | {"triton"})
    params = []
    for name in names:
        entry = reg.entries["moe_runner"].get(name)
        if entry is None:
            params.append(pytest.param(name, marks=pytest.mark.skip(reason=f"MoE runner {name!r} is not installed")))
        elif _interpreted(name) and not _interpreter_on():
            params.append(pytest.param(name, marks=pytest.mark.skip(
                reason="triton on CPU needs TRITON_INTERPRET=1 before triton is first imported; "
                       "test_triton_runner_under_the_interpreter runs this case in a subprocess")))
        elif not entry.is_available:
            params.append(pytest.param(name, marks=pytest.mark.skip(reason=entry.unavailable_reason())))
        else:
            params.append(name)
    return params


def _interpreted(runner: str) -> bool:
    """Whether ``runner`` can only run here through Triton's interpreter (slow)."""
    return runner == "triton" and not torch.cuda.is_available()


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


@dataclass
class MoECheckpoint:
    name: str
    path: str
    hf_model: torch.nn.Module
    prompts: list[list[int]]
    hf_greedy: list[list[int]]  # NEW_TOKENS greedy tokens per prompt, EOS not special
    shared_prefix: list[int]  # a second request: the longest prompt's first 40 tokens + 9 new ones
    hf_shared_greedy: list[int]


def hf_greedy(model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens from transformers ``generate`` with EOS treated as an ordinary token."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    assert len(new) == n, "transformers stopped early; the reference is unusable"
    return new


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, what
    scale = max(1.0, ref.abs().max().item())
    diff = (ours - ref).abs().max().item()
    assert diff <= LOGITS_RTOL * scale, f"{what}: max |diff| {diff:.3g} over {LOGITS_RTOL} * {scale:.3g}"


@pytest.fixture(scope="module", params=list(MOE_VARIANTS))
def moe_ckpt(request, tmp_path_factory) -> MoECheckpoint:
    from transformers import AutoModelForCausalLM

    name = request.param
    seed = 10 + sorted(MOE_VARIANTS).index(name)
    path = str(tmp_path_factory.mktemp(name))
    build_checkpoint(path, name, seed)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(100 + seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    shared = prompts[-1][:40] + random_prompts(1, 9, seed=200 + seed)[0]
    return MoECheckpoint(name, path, hf, prompts, [hf_greedy(hf, p) for p in prompts], shared,
                         hf_greedy(hf, shared))


@pytest.fixture(scope="module", params=_runner_params())
def moe_engine(request, moe_ckpt):
    """``(engine, prompts, new_tokens)`` for one variant and one runner."""
    import radixserve

    runner = request.param
    prompts, new_tokens = moe_ckpt.prompts, NEW_TOKENS
    if _interpreted(runner):
        if moe_ckpt.name != INTERPRETED_VARIANT:
            pytest.skip(f"triton on CPU runs in Triton's interpreter (slow): only the {INTERPRETED_VARIANT} "
                        "variant, with short prompts and few tokens")
        prompts, new_tokens = prompts[:INTERPRETED_PROMPTS], INTERPRETED_TOKENS
    engine = radixserve.Engine(moe_ckpt.path, dtype="float32", page_size=PAGE, max_total_tokens=2048,
                               chunked_prefill_size=CHUNK, moe_runner_backend=runner)
    yield engine, prompts, new_tokens
    engine.shutdown()


# ------------------------------------------------------------ checkpoints and layers
def test_layers_sparse_where_transformers_has_experts(moe_ckpt, moe_engine):
    engine, _, _ = moe_engine
    hf_layers = moe_ckpt.hf_model.model.layers
    sparse = [hasattr(layer.mlp, "experts") for layer in hf_layers]
    ours = [isinstance(layer.mlp, SparseMoE) for layer in engine.runner.model.layers]
    assert ours == sparse
    if moe_ckpt.name != "mixtral":
        assert any(sparse) and not all(sparse), "the Qwen variants must mix dense and sparse layers"
    cfg = engine.model_config
    assert cfg.architecture == type(moe_ckpt.hf_model).__name__
    assert cfg.num_experts == (getattr(moe_ckpt.hf_model.config, "num_local_experts", None)
                               or moe_ckpt.hf_model.config.num_experts)
    assert EOS in cfg.eos_token_ids


def test_sharded_checkpoint_layout(moe_ckpt):
    """Mixtral is saved in several shards through the index, under its own expert names."""
    if MOE_VARIANTS[moe_ckpt.name][2] is None:
        pytest.skip("this variant is saved as one file")
    index = os.path.join(moe_ckpt.path, "model.safetensors.index.json")
    with open(index) as fh:
        names = json.load(fh)["weight_map"]
    assert len(glob.glob(os.path.join(moe_ckpt.path, "*.safetensors"))) > 1
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names


def test_expert_weights_held_once_by_the_runner(moe_engine):
    engine, _, _ = moe_engine
    model = engine.runner.model
    layers = moe_layers(model)
    assert layers
    for _, layer in layers:
        assert layer.w13 is None and layer.w2 is None, "the layer kept its expert weights after binding"
        assert layer.state is not None and layer.runner is not None
        assert layer.runner.name == engine.server_args.moe_runner_backend
    assert not [n for n, p in model.named_parameters() if p.dim() == 3], "3-D expert parameters left"


# --------------------------------------------------------------- against transformers
def test_prompt_logits_match_transformers(moe_ckpt, moe_engine, assert_idle):
    engine, prompts, _ = moe_engine
    for prompt in prompts:
        ours = engine.runner.prompt_logits(prompt)  # [T, V]
        with torch.no_grad():
            ref = moe_ckpt.hf_model(torch.tensor([prompt])).logits[0].float()  # [T, V]
        assert_logits_close(ours, ref, f"{moe_ckpt.name}, prompt of {len(prompt)} tokens")
    assert_idle(engine)


def test_mixed_batch_chunked_prefill_matches_generate(moe_ckpt, moe_engine, assert_idle):
    """All prompts in flight at once: the long ones prefill in chunks of CHUNK tokens while
    the short one already decodes; one request also leaves the batch early."""
    engine, prompts, n = moe_engine
    lengths = [n] * len(prompts) + [max(1, n // 4)]
    ids = prompts + [prompts[-1]]
    params = [{"temperature": 0.0, "max_new_tokens": k, "ignore_eos": True} for k in lengths]
    outs = engine.generate(input_ids=ids, sampling_params=params)
    refs = moe_ckpt.hf_greedy[:len(prompts)] + [moe_ckpt.hf_greedy[len(prompts) - 1]]
    for prompt, k, out, ref in zip(ids, lengths, outs, refs, strict=True):
        assert out["output_ids"] == ref[:k], f"{moe_ckpt.name}, prompt of {len(prompt)} tokens"
        assert out["meta_info"]["completion_tokens"] == k
    assert_idle(engine)


def test_radix_cache_serves_a_shared_prefix(moe_ckpt, moe_engine, assert_idle):
    engine, prompts, n = moe_engine
    params = {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}
    first = prompts[-1]
    shared = moe_ckpt.shared_prefix if len(first) >= 40 else first[:-2] + [7, 8, 9]
    ref_shared = moe_ckpt.hf_shared_greedy if len(first) >= 40 else hf_greedy(moe_ckpt.hf_model, shared, n)
    out1 = engine.generate(input_ids=first, sampling_params=params)
    out2 = engine.generate(input_ids=shared, sampling_params=params)
    assert out1["output_ids"] == moe_ckpt.hf_greedy[len(prompts) - 1][:n]
    common = next(i for i, (a, b) in enumerate(zip(first, shared)) if a != b)
    cached = out2["meta_info"]["cached_tokens"]
    assert 0 < cached <= common and cached >= common // PAGE * PAGE - PAGE, (cached, common)
    assert out2["output_ids"] == ref_shared[:n]
    assert_idle(engine)


# ------------------------------------------- the Triton runner under the interpreter
_INTERPRETED_CHECK = r"""
import json, sys
import radixserve
from engine_checks import wait_until_idle
from radixserve.layers.moe import moe_layers

a = json.load(sys.stdin)
engine = radixserve.Engine(a["path"], dtype="float32", page_size=a["page"], max_total_tokens=2048,
                           chunked_prefill_size=a["chunk"], moe_runner_backend="triton")
try:
    params = {"temperature": 0.0, "max_new_tokens": a["new_tokens"], "ignore_eos": True}
    result = {
        "runners": sorted({layer.runner.name for _, layer in moe_layers(engine.runner.model)}),
        "weights_dropped": all(layer.w13 is None for _, layer in moe_layers(engine.runner.model)),
        "logits": [engine.runner.prompt_logits(p).tolist() for p in a["prompts"]],
        "batch": [o["output_ids"] for o in engine.generate(input_ids=a["prompts"], sampling_params=params)],
    }
    shared = engine.generate(input_ids=a["shared"], sampling_params=params)
    result["shared"], result["cached"] = shared["output_ids"], shared["meta_info"]["cached_tokens"]
    wait_until_idle(engine)
finally:
    engine.shutdown()
print("RESULT " + json.dumps(result))
"""


def test_triton_runner_under_the_interpreter(moe_ckpt):
    """The triton runner on CPU, in a process started with TRITON_INTERPRET=1: prompt
    logits, a batch of two prompts (one prefilled in chunks) and a shared prefix."""
    import subprocess
    import sys

    if "triton" not in get_registry().names("moe_runner"):
        pytest.skip("MoE runner 'triton' is not installed")
    if not _interpreted("triton") or _interpreter_on():
        pytest.skip("triton runs in this process here (the parametrized tests cover it)")
    if moe_ckpt.name != INTERPRETED_VARIANT:
        pytest.skip(f"the interpreter is slow: only the {INTERPRETED_VARIANT} variant")
    prompts = moe_ckpt.prompts[:INTERPRETED_PROMPTS]
    shared = prompts[-1][:-2] + [7, 8, 9]
    n = INTERPRETED_TOKENS
    args = {"path": moe_ckpt.path, "page": PAGE, "chunk": CHUNK, "new_tokens": n, "prompts": prompts,
            "shared": shared}
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED_CHECK], input=json.dumps(args), env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["runners"] == ["triton"] and result["weights_dropped"]
    for prompt, logits in zip(prompts, result["logits"], strict=True):
        with torch.no_grad():
            ref = moe_ckpt.hf_model(torch.tensor([prompt])).logits[0].float()
        assert_logits_close(torch.tensor(logits), ref, f"triton (interpreted), prompt of {len(prompt)} tokens")
    assert result["batch"] == [ref[:n] for ref in moe_ckpt.hf_greedy[:len(prompts)]]
    assert result["shared"] == hf_greedy(moe_ckpt.hf_model, shared, n)
    assert 0 < result["cached"] <= len(prompts[-1]) - 2


# ------------------------------------------------------------------------- GGUF
@pytest.fixture(scope="module")
def gguf_file(moe_ckpt, tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """The variant as a GGUF file (float16 matrices) and a transformers model with exactly its weights."""
    hf = copy.deepcopy(moe_ckpt.hf_model)
    round_to_f16(hf)
    path = str(tmp_path_factory.mktemp(f"{moe_ckpt.name}_gguf") / "model.gguf")
    save_gguf(hf, path)
    return path, hf


def test_gguf_matches_transformers(moe_ckpt, gguf_file, assert_idle):
    import radixserve
    from gguf import GGUFReader

    path, hf = gguf_file
    names = {t.name for t in GGUFReader(path).tensors}
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert {f"blk.{sparse[0]}.ffn_gate_inp.weight", f"blk.{sparse[0]}.ffn_gate_exps.weight",
            f"blk.{sparse[0]}.ffn_up_exps.weight", f"blk.{sparse[0]}.ffn_down_exps.weight"} <= names
    assert (f"blk.{sparse[0]}.ffn_gate_inp_shexp.weight" in names) == (moe_ckpt.name == "qwen2_moe")
    engine = radixserve.Engine(path, tokenizer_path=moe_ckpt.path, dtype="float32", page_size=PAGE,
                               max_total_tokens=1024, chunked_prefill_size=CHUNK)
    try:
        cfg = engine.model_config
        assert cfg.architecture == type(hf).__name__
        assert [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_layer(i)] == sparse
        assert cfg.norm_topk_prob == (moe_ckpt.name != "qwen2_moe")
        for prompt in moe_ckpt.prompts[:2]:
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).logits[0].float()
            assert_logits_close(engine.runner.prompt_logits(prompt), ref, f"{moe_ckpt.name} GGUF")
        prompt = moe_ckpt.prompts[1]
        out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0.0, "max_new_tokens": 16,
                                                                 "ignore_eos": True})
        assert out["output_ids"] == hf_greedy(hf, prompt, 16)
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_gguf_with_one_tensor_per_expert(moe_ckpt, tmp_path):
    """Older Mixtral GGUF files hold ``blk.N.ffn_{gate,up,down}.E.weight`` per expert."""
    import radixserve

    if moe_ckpt.name != "mixtral":
        pytest.skip("the per-expert GGUF layout is Mixtral's")
    hf = copy.deepcopy(moe_ckpt.hf_model)
    round_to_f16(hf)
    path = str(tmp_path / "per_expert.gguf")
    save_gguf(hf, path, per_expert=True)
    from gguf import GGUFReader

    names = {t.name for t in GGUFReader(path).tensors}
    assert "blk.0.ffn_gate.3.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    engine = radixserve.Engine(path, tokenizer_path=moe_ckpt.path, dtype="float32", max_total_tokens=1024)
    try:
        assert engine.model_config.architecture == "MixtralForCausalLM"
        prompt = moe_ckpt.prompts[1]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        assert_logits_close(engine.runner.prompt_logits(prompt), ref, "mixtral GGUF, one tensor per expert")
    finally:
        engine.shutdown()


# --------------------------------------------------------------- weight names, errors
def _copy_dir_with_weights(src: str, dst: str, tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as fh:
        config = fh.read()
    with open(os.path.join(dst, "config.json"), "w") as fh:
        fh.write(config)
    save_tokenizer(dst)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"))
    return dst


def test_fused_in_memory_expert_names_load(moe_ckpt, tmp_path, assert_idle):
    """transformers 5 holds experts as ``mlp.experts.gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]``; a checkpoint carrying those names loads the same model."""
    import radixserve

    state = dict(moe_ckpt.hf_model.state_dict())
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    path = _copy_dir_with_weights(moe_ckpt.path, str(tmp_path / "fused"), state)
    engine = radixserve.Engine(path, dtype="float32", max_total_tokens=1024)
    try:
        prompt = moe_ckpt.prompts[1]
        with torch.no_grad():
            ref = moe_ckpt.hf_model(torch.tensor([prompt])).logits[0].float()
        assert_logits_close(engine.runner.prompt_logits(prompt), ref, f"{moe_ckpt.name} fused names")
        assert_idle(engine)
    finally:
        engine.shutdown()


def _model_for(moe_ckpt):
    from radixserve.model_loader import load_checkpoint

    ckpt = load_checkpoint(moe_ckpt.path)
    cls = get_registry().get("model", ckpt.config.architecture).factory
    return cls(ckpt.config), ckpt


def test_expert_weights_covered_exactly_once(moe_ckpt):
    model, ckpt = _model_for(moe_ckpt)
    per_expert = list(ckpt.weights())
    first = next(n for n, _ in per_expert if ".experts.0." in n)
    fused = {k: v for k, v in moe_ckpt.hf_model.state_dict().items() if ".experts." in k}
    with pytest.raises(ValueError, match="a second time"):
        model.load_weights(per_expert + list(fused.items()))
    with pytest.raises(ValueError, match=r"missing 1 tensors.*w(13|2)#0"):
        model.load_weights([(n, t) for n, t in per_expert if n != first])
    bad = first.replace(".experts.0.", ".experts.99.")
    with pytest.raises(ValueError, match="expert 99 out of range"):
        model.load_weights([(bad, dict(per_expert)[first])])
    with pytest.raises(ValueError, match="does not fit"):
        model.load_weights([(first, dict(per_expert)[first][:, :-1])])


def test_expert_weights_in_a_dense_layer_are_an_error(moe_ckpt):
    model, _ = _model_for(moe_ckpt)
    dense = [i for i, layer in enumerate(model.layers) if not isinstance(layer.mlp, SparseMoE)]
    if not dense:
        pytest.skip("every layer of this variant is sparse")
    cfg = model.config
    name = f"model.layers.{dense[0]}.mlp.experts.0.gate_proj.weight"
    with pytest.raises(ValueError, match="is a dense layer"):
        model.load_weights([(name, torch.zeros(cfg.moe_intermediate_size, cfg.hidden_size))])


def test_unknown_moe_runner_names_the_flag_and_the_choices(moe_ckpt):
    import radixserve

    with pytest.raises(Exception, match=r"--moe-runner-backend.*'no-such-runner'.*choose from: .*torch_native"):
        radixserve.Engine(moe_ckpt.path, dtype="float32", max_total_tokens=1024,
                          moe_runner_backend="no-such-runner")

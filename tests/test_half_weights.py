"""16-bit checkpoints stay 16-bit on CPU under ``--dtype auto`` (issue 36, item 5): the linear
weights of a float16/bfloat16 safetensors checkpoint as ``woq.F16Matrix``/``BF16Matrix``
(widened exactly in registers), the token embedding as a 16-bit table whose looked-up rows are
widened, and a tied LM head sharing one 16-bit copy with the embedding. Same logits and greedy
tokens as the float32 path (``--dtype float32``) and as transformers on the same weights."""

from __future__ import annotations

import logging

import pytest
import radixserve
import torch
from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels import woq
from tiny_models import build_checkpoint, random_prompts, round_to_f16, save_gguf

LOGITS_RTOL = 1e-3  # vs transformers: the float32 path (--dtype float32) differs as much (summation order)
GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
HALF_PATHS = {torch.float16: "radixserve-f16", torch.bfloat16: "radixserve-bf16"}

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="radixserve CPU kernels unavailable")


def _skip_without_widening(dtype: torch.dtype) -> None:
    why = woq.half_kernel_missing(dtype)
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module", params=[("llama", torch.float16), ("llama_tied", torch.bfloat16),
                                        ("qwen2", torch.bfloat16), ("llama_tied", torch.float16)],
                ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}")
def half_ckpt(request, tmp_path_factory):
    """A random tiny model saved as a 16-bit safetensors checkpoint, and transformers' float32
    model holding the same (widened) weights."""
    variant, dtype = request.param
    path = str(tmp_path_factory.mktemp(f"{variant}_half"))
    hf = build_checkpoint(path, variant, seed=11)
    hf.to(dtype).save_pretrained(path, safe_serialization=True)
    return path, dtype, hf.to(dtype).float().eval()


def _linears(engine) -> list:
    return [m for m in engine.runner.model.modules() if hasattr(m, "method")]


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
    return out[0, len(prompt):].tolist()


@needs_kernels
def test_16bit_safetensors_stay_16bit_and_match_the_float32_path(half_ckpt):
    path, dtype, hf = half_ckpt
    _skip_without_widening(dtype)
    prompts = random_prompts(2, 24, seed=4)
    with radixserve.Engine(path, dtype="float32", max_total_tokens=1024) as engine:
        float_bytes = engine.runner.weight_bytes
        float_logits = [engine.runner.prompt_logits(p) for p in prompts]
        float_tokens = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
        assert {m.path for m in _linears(engine)} == {"radixserve"}  # the float32 path is still there
    with radixserve.Engine(path, max_total_tokens=1024) as engine:  # --dtype auto
        runner, model = engine.runner, engine.runner.model
        assert runner.dtype == torch.float32  # activations stay float32
        assert {m.path for m in _linears(engine)} == {HALF_PATHS[dtype]}
        embed = model.embed_tokens
        if hf.config.tie_word_embeddings:  # the head's 16-bit panels are the table: no copy of it
            assert embed.shared is not None and embed.weight_nbytes() == 0 and embed.weight is None
            assert embed.shared is model.lm_head.matrix
        else:
            assert embed.table16 is not None and embed.table16.dtype == dtype and embed.weight is None
            assert embed.weight_nbytes() == 2 * hf.config.vocab_size * hf.config.hidden_size
        assert runner.weight_bytes < 0.56 * float_bytes, (runner.weight_bytes, float_bytes)
        for prompt, want_logits, want_tokens in zip(prompts, float_logits, float_tokens):
            ours = runner.prompt_logits(prompt)
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).logits[0].float()
            scale = max(1.0, ref.abs().max().item())
            assert (ours - ref).abs().max().item() <= LOGITS_RTOL * scale
            assert (ours - want_logits).abs().max().item() <= 1e-5 * scale  # same values, same kernels' order
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
            assert out == want_tokens == _hf_greedy(hf, prompt)
        assert engine.get_stats()["cuda_graph_replays"] > 0  # the 16-bit lookups are recordable kernels


@needs_kernels
def test_a_cpu_without_the_widening_falls_back_to_float32(half_ckpt, monkeypatch, caplog):
    path, dtype, _ = half_ckpt
    if dtype != torch.float16:
        pytest.skip("one dtype is enough")
    from radixserve.quantization import methods

    monkeypatch.setattr(woq, "half_kernel_missing", lambda d: "the CPU has neither F16C nor AVX-512 (test)")
    methods._log_widened.cache_clear()  # logged once per process and reason
    with caplog.at_level(logging.WARNING), radixserve.Engine(path, max_total_tokens=1024) as engine:
        assert {m.path for m in _linears(engine)} == {"radixserve"}
    assert "widened to float32 at load: the CPU has neither F16C nor AVX-512 (test)" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37, 64])
def test_take_rows_gives_the_stored_rows(dtype, rows):
    weight = torch.randn(rows, 24).to(dtype)
    matrix = woq.HALF_MATRICES[dtype].prepare(cpu_kernels.load(), weight)
    ids = torch.tensor([rows - 1, 0, rows // 2, rows - 1])
    assert torch.equal(matrix.take_rows(ids), weight[ids])
    # the C lookup (what the embedding calls, recordable in a decode tape): the same rows, widened
    bad = torch.tensor([rows, -1])
    assert torch.equal(woq.half_rows(cpu_kernels.load(), matrix, ids), weight[ids].float())
    assert torch.equal(woq.half_rows(cpu_kernels.load(), weight, ids), weight[ids].float())
    assert not woq.half_rows(cpu_kernels.load(), matrix, bad).any()  # out of range: zeros, no stray read


@pytest.fixture(scope="module", params=[("llama_tied", "F16"), ("qwen2", "BF16")], ids=lambda p: "-".join(p))
def half_gguf(request, tmp_path_factory):
    """A random tiny model as a GGUF file with 16-bit matrices (a tied one has no output.weight),
    and transformers' float32 model holding the same weights."""
    variant, matrix_type = request.param
    hf_dir = str(tmp_path_factory.mktemp(f"{variant}_gguf"))
    hf = build_checkpoint(hf_dir, variant, seed=5).float().eval()
    if matrix_type == "F16":
        round_to_f16(hf)
    else:
        hf.to(torch.bfloat16).float()
    path = str(tmp_path_factory.mktemp(f"{variant}_gguf_file") / "model.gguf")
    save_gguf(hf, path, matrix_type=matrix_type)
    return hf_dir, path, hf, {"F16": torch.float16, "BF16": torch.bfloat16}[matrix_type]


@needs_kernels
def test_16bit_gguf_token_embedding_stays_16bit_and_a_tied_head_shares_it(half_gguf):
    hf_dir, path, hf, dtype = half_gguf
    _skip_without_widening(dtype)
    prompts = random_prompts(2, 24, seed=8)
    with radixserve.Engine(path, tokenizer_path=hf_dir, quantization="none", max_total_tokens=1024) as engine:
        float_bytes = engine.runner.weight_bytes  # every weight widened to float32 at load
        float_tokens = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
        assert engine.runner.model.embed_tokens.weight.dtype == torch.float32
    with radixserve.Engine(path, tokenizer_path=hf_dir, max_total_tokens=1024) as engine:  # gguf, as stored
        model = engine.runner.model
        assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings
        assert {m.path for m in _linears(engine)} == {"gguf-F16" if dtype == torch.float16 else "gguf-BF16"}
        embed = model.embed_tokens
        assert embed.weight is None and embed.qtable is None
        if hf.config.tie_word_embeddings:
            assert embed.shared is model.lm_head.matrices[0][2] and embed.weight_nbytes() == 0
            assert embed.table16 is None
        else:
            assert embed.table16.dtype == dtype
        assert engine.runner.weight_bytes < 0.56 * float_bytes, (engine.runner.weight_bytes, float_bytes)
        for prompt, want in zip(prompts, float_tokens):
            ours = engine.runner.prompt_logits(prompt)
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).logits[0].float()
            assert (ours - ref).abs().max().item() <= LOGITS_RTOL * max(1.0, ref.abs().max().item())
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
            assert out == want == _hf_greedy(hf, prompt)
        assert engine.get_stats()["cuda_graph_replays"] > 0  # decode steps replayed as kernel tapes

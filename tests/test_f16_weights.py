"""A float16 GGUF on CPU keeps its linear weights float16 (``woq.F16Matrix``: half the bytes of
the float32 copy it used to widen to) and gives transformers' logits and greedy tokens on the
same weights: the widening is exact, only the accumulation order differs."""

from __future__ import annotations

import pytest
import torch
from engine_checks import leak_checked_engine
from radixserve.kernels import cpu as cpu_kernels
from tiny_models import build_checkpoint, random_prompts, round_to_f16, save_gguf

LOGITS_RTOL = 1e-4


@pytest.fixture(scope="module")
def f16_model(tmp_path_factory):
    hf_dir = str(tmp_path_factory.mktemp("f16_llama"))
    hf = build_checkpoint(hf_dir, "llama", seed=3, max_position_embeddings=512).float().eval()
    round_to_f16(hf)
    path = str(tmp_path_factory.mktemp("f16_gguf") / "model.gguf")
    save_gguf(hf, path)
    return hf_dir, path, hf


def test_float16_linear_weights_stay_float16_and_match_transformers(f16_model):
    if cpu_kernels.load() is None:
        pytest.skip(f"radixserve CPU kernels unavailable: {cpu_kernels.status()}")
    hf_dir, path, hf = f16_model
    with leak_checked_engine(path, tokenizer_path=hf_dir) as engine:
        kinds = {m.method.describe(m) for m in engine.runner.model.modules() if hasattr(m, "method")}
        assert kinds == {"gguf-F16"}, kinds
        linear = sum(m.method.weight_nbytes(m) for m in engine.runner.model.modules() if hasattr(m, "method"))
        params = sum(p.numel() for n, p in hf.named_parameters() if n.endswith("proj.weight") or n == "lm_head.weight")
        assert linear < 2.2 * params  # ~2 bytes a weight (panels padded), not float32's 4
        embed = engine.runner.model.embed_tokens  # the F16 table stays F16, rows widened on lookup
        assert embed.table16.dtype == torch.float16 and embed.weight is None
        for prompt in random_prompts(2, 30, seed=5):
            with torch.no_grad():
                ref = hf(torch.tensor([prompt])).logits[0].float()
            ours = engine.runner.prompt_logits(prompt)
            assert (ours - ref).abs().max().item() <= LOGITS_RTOL * max(1.0, ref.abs().max().item())
            out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0.0, "max_new_tokens": 12,
                                                                     "ignore_eos": True})
            with torch.no_grad():
                want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                   min_new_tokens=12)[0, len(prompt):].tolist()
            assert out["output_ids"] == want

"""``--lora-backend triton`` under a real engine: a batch mixing two adapters and the base model,
chunked so that steps mix prefill and decode rows, gives each row PEFT's greedy tokens (the
kernels run in Triton's interpreter without a GPU; a tiny random Llama keeps that quick)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
from radixserve_lora_triton import unavailable_reason

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
if os.path.join(ROOT, "tests") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "tests"))

pytestmark = [
    pytest.mark.skipif(unavailable_reason() is not None, reason=f"triton cannot run: {unavailable_reason()}"),
    pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (the LoRA oracle) is not installed"),
]

NEW = 6


def test_a_mixed_batch_gives_each_row_pefts_tokens(tmp_path, monkeypatch):
    import radixserve
    from tiny_models import build_checkpoint, build_lora_adapter, greedy, random_prompts

    monkeypatch.setenv("RADIXSERVE_PLUGINS", "radixserve-attention-torch,radixserve-lora-triton")
    base = str(tmp_path / "base")
    hf = build_checkpoint(base, "llama", seed=1).eval()
    prompts = random_prompts(3, 10, seed=4) + [list(range(5, 30))]
    oracles = {None: hf}
    paths = []
    for i, (name, rank, targets) in enumerate([("x", 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"]),
                                               ("y", 4, ["v_proj", "down_proj"])]):
        path = str(tmp_path / name)
        oracles[name] = build_lora_adapter(path, hf, rank, 2 * rank, targets, seed=20 + i)
        paths.append(f"{name}={path}")
    names = [None, "x", "y"]
    lora = [names[i % 3] for i in range(len(prompts))] + [names[(i + 1) % 3] for i in range(len(prompts))]
    want = [greedy(oracles[name], [p], NEW)[0] for name, p in zip(lora, prompts + prompts)]
    base_tokens = greedy(hf, prompts + prompts, NEW)
    assert sum(w != b for w, b in zip(want, base_tokens)) >= 4, "the adapters must change the tokens"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with radixserve.Engine(base, lora_paths=paths, lora_backend="triton", device=device, max_total_tokens=2048,
                           chunked_prefill_size=16, enable_leak_check=True, log_level="warning") as engine:
        assert engine.runner.lora.backend.name == "triton"
        outs = engine.generate(input_ids=prompts + prompts, lora_path=lora,
                               sampling_params={"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True})
    assert [o["output_ids"] for o in outs] == want

"""The default model drafting for itself (its GGUF as ``--speculative-draft-model-path``):
greedy outputs token-identical to plain decoding, in one batch and one at a time with the
radix cache warm, and with chunked prefill over pages of 16; nearly every draft token is
accepted."""

from __future__ import annotations

import pytest
import radixserve
from radixserve.model_loader import default_model_path
from radixserve.testing import speculative_conformance as sc

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):\n",
    "Repeat this list exactly: apples, bananas, cherries, dates, figs. Again: apples,",
    "<|im_start|>user\nList three fruits.<|im_end|>\n<|im_start|>assistant\n",
]
GREEDY = {"temperature": 0.0, "max_new_tokens": 32}


def test_self_draft_matches_plain_decoding():
    with radixserve.Engine(max_total_tokens=8192, enable_leak_check=True) as plain:
        want = [o["output_ids"] for o in plain.generate(PROMPTS, GREEDY)]
    spec = dict(speculative_algorithm="standalone", speculative_draft_model_path=default_model_path(),
                speculative_disable_by_batch_size=sc.ALWAYS, max_total_tokens=8192, enable_leak_check=True)
    with radixserve.Engine(**spec) as eng:
        assert [o["output_ids"] for o in eng.generate(PROMPTS, GREEDY)] == want
        stats = eng.get_stats()
        assert stats["spec_acceptance_rate"] > 0.9, stats
        assert [eng.generate(p, GREEDY)["output_ids"] for p in PROMPTS] == want
        assert eng.get_stats()["cache_hit_rate"] > 0.3
    with radixserve.Engine(**spec, chunked_prefill_size=8, page_size=16) as eng:
        assert [o["output_ids"] for o in eng.generate(PROMPTS, GREEDY)] == want

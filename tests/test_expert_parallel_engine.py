"""Expert parallelism through the engine on CPU ranks (gloo): the tiny MoE models of
tiny_models.py at ``--tp-size 2 --ep-size 2`` and ``--tp-size 4 --ep-size 2``, with each
transport and with redundant experts placed from a distribution the single-rank engine
recorded, give the same greedy tokens as one rank; the expert load counters stay per
logical expert. (The plain ``none`` runs on qwen2_moe are in test_multi_rank.py.)
"""

from __future__ import annotations

import pytest
from radixserve.config import ConfigError
from radixserve.engine.engine import Engine
from tiny_models import build_checkpoint, random_prompts

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
CPU = dict(device="cpu", num_threads=1, max_total_tokens=2048, log_level="warning")
MODELS = ("mixtral", "qwen2_moe", "qwen3_moe")  # 4, 8, 8 experts


def _ids(outs) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory) -> dict:
    """Per model: checkpoint, prompts, one rank's greedy tokens and its recorded distribution."""
    out = {}
    for variant in MODELS:
        path = str(tmp_path_factory.mktemp(variant))
        build_checkpoint(path, variant)
        prompts = random_prompts(3, 12, seed=5)
        with Engine(path, expert_distribution_recorder_mode="stat",
                    expert_distribution_recorder_dir=str(tmp_path_factory.mktemp("record")), **CPU) as engine:
            expected = _ids(engine.generate(input_ids=prompts, sampling_params=GREEDY))
            record = engine.dump_expert_distribution_record()
            counts = engine.get_stats()["moe_expert_tokens"]
        out[variant] = dict(path=path, prompts=prompts, expected=expected, record=record, counts=counts)
    return out


CASES = [
    # model, tp, ep, transport, redundant experts
    ("qwen3_moe", 2, 2, "torch_distributed", 0),
    ("qwen3_moe", 4, 2, "torch_distributed", 0),
    ("mixtral", 2, 2, "torch_distributed", 0),
    ("mixtral", 2, 2, "none", 2),  # 4 + 2 = 6 physical experts, 3 per rank
    ("qwen2_moe", 2, 2, "torch_distributed", 2),  # shared expert, a dense layer
    ("qwen3_moe", 4, 2, "none", 4),
    ("qwen2_moe", 4, 2, "torch_distributed", 2),
    ("qwen3_moe", 1, 1, "none", 3),  # copies on one rank
]


@pytest.mark.parametrize("variant,tp,ep,a2a,redundant", CASES, ids=lambda v: str(v))
def test_same_greedy_tokens_as_one_rank(single_rank, variant, tp, ep, a2a, redundant):
    ref = single_rank[variant]
    kw = dict(tp_size=tp, ep_size=ep, moe_a2a_backend=a2a)
    if redundant:
        kw.update(ep_num_redundant_experts=redundant, init_expert_location=ref["record"])
    with Engine(ref["path"], **kw, **CPU) as engine:
        assert _ids(engine.generate(input_ids=ref["prompts"], sampling_params=GREEDY)) == ref["expected"]
        # the same tokens were routed: the per-logical-expert counters equal one rank's
        assert engine.get_stats()["moe_expert_tokens"] == ref["counts"]


def test_uneven_physical_experts_fail_naming_the_flags(single_rank):
    ref = single_rank["qwen3_moe"]
    with pytest.raises(Exception) as info:  # noqa: PT011 - the ConfigError may come wrapped: see below
        Engine(ref["path"], tp_size=2, ep_size=2, ep_num_redundant_experts=1, init_expert_location=ref["record"],
               **CPU)
    # rank 0's ConfigError, or the runtime's "could not start" caused by it (when another
    # rank stopped first on the same error)
    chain, err = [], info.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    msg = "8 experts + --ep-num-redundant-experts 1 = 9 physical experts do not split evenly over --ep-size 2"
    assert any(isinstance(e, ConfigError) and msg in str(e) for e in chain), chain


def test_a_moe_draft_model_ignores_the_targets_expert_placement(single_rank):
    """--init-expert-location describes the target's layers; a MoE draft model (4 experts,
    the record has 8) must be bound without it, and decoding stays lossless."""
    from radixserve.registry import get_registry

    entry = get_registry().entries["speculative"].get("standalone")
    if entry is None or not entry.is_available:
        pytest.skip("the standalone speculative method is not installed")
    ref = single_rank["qwen3_moe"]
    with Engine(ref["path"], ep_num_redundant_experts=2, init_expert_location=ref["record"],
                speculative_algorithm="STANDALONE", speculative_draft_model_path=single_rank["mixtral"]["path"],
                **CPU) as engine:
        assert _ids(engine.generate(input_ids=ref["prompts"], sampling_params=GREEDY)) == ref["expected"]

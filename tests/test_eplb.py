"""EPLB placement (radixserve.engine.eplb) and the layer's logical -> physical mapping
(ExpertLocation), on one process: balance on a skewed record, every logical expert
reachable, the N hottest copied, errors naming the flags, outputs unchanged by copies."""

from __future__ import annotations

import pytest
import torch
from radixserve.config import ConfigError, ServerArgs
from radixserve.engine.eplb import imbalance, plan_layer, plan_placement, rank_loads
from radixserve.engine.moe import setup_moe
from radixserve.layers.moe import ExpertLocation, reference_moe, select_experts
from radixserve.registry import get_registry
from test_expert_parallel import SKEW, E, H, K, TwoLayers, write_record

ZIPF = [1000 / (i + 1) ** 1.2 for i in range(16)]  # expert 0 hottest


def trivial(num_experts: int) -> list[int]:
    return list(range(num_experts))


@pytest.mark.parametrize("load", [SKEW[0], SKEW[1], ZIPF, ZIPF[::-1]], ids=["skew0", "skew1", "zipf", "zipf_rev"])
@pytest.mark.parametrize("num_redundant,ep_size", [(0, 2), (2, 2), (4, 4), (8, 4), (0, 4)])
def test_balance_improves_and_every_expert_is_reachable(load, num_redundant, ep_size):
    n = len(load)
    if (n + num_redundant) % ep_size:
        pytest.skip("does not divide")
    plan = plan_layer(load, num_redundant, ep_size)
    assert len(plan) == n + num_redundant
    assert sorted(set(plan)) == list(range(n))  # every logical expert has a slot
    # the N hottest have two copies, the rest one
    hottest = sorted(range(n), key=lambda e: (-load[e], e))[:num_redundant]
    assert all(plan.count(e) == (2 if e in hottest else 1) for e in range(n))
    before = imbalance(rank_loads(trivial(n), load, ep_size))
    after = imbalance(rank_loads(plan, load, ep_size))
    assert after <= before + 1e-9


def test_skewed_record_is_balanced_much_better():
    load = SKEW[0]  # expert 0 carries most of the load; the trivial layout puts 990 of 1506 on rank 0
    before = imbalance(rank_loads(trivial(E), load, 2))
    placed = imbalance(rank_loads(plan_layer(load, 0, 2), load, 2))  # moved, no copies
    copied = imbalance(rank_loads(plan_layer(load, 2, 2), load, 2))  # expert 0 split over both ranks
    assert before > 1.3 and placed < 1.25 and copied < 1.01
    z_before = imbalance(rank_loads(trivial(16), ZIPF, 4))
    z_placed = imbalance(rank_loads(plan_layer(ZIPF, 0, 4), ZIPF, 4))
    z_copied = imbalance(rank_loads(plan_layer(ZIPF, 4, 4), ZIPF, 4))
    assert z_before > 2.7 and z_placed < 1.7 and z_copied < 1.05


def test_plan_is_deterministic_and_handles_no_load():
    assert plan_layer(SKEW[1], 2, 2) == plan_layer(SKEW[1], 2, 2)
    plan = plan_layer([0] * 8, 2, 2)  # no recorded load: the lowest ids are copied
    assert plan.count(0) == plan.count(1) == 2


def test_errors_name_the_flags(tmp_path):
    with pytest.raises(ConfigError, match=r"--ep-num-redundant-experts 1 .* --ep-size 2"):
        plan_layer(SKEW[0], 1, 2)
    with pytest.raises(ConfigError, match="--ep-num-redundant-experts 9"):
        plan_layer(SKEW[0], 9, 1)
    record = {"num_experts": E, "layers": [0], "counts": [SKEW[0]]}
    with pytest.raises(ConfigError, match=r"no recorded counts for MoE layers \[1\]"):
        plan_placement(record, [0, 1], E, 0, 2)
    with pytest.raises(ConfigError, match="record is for 8 experts"):
        plan_placement(record, [0], 16, 0, 2)
    model = TwoLayers(torch.float32)
    args = ServerArgs(moe_runner_backend="torch_native", ep_num_redundant_experts=9,
                      init_expert_location=write_record(str(tmp_path / "r.json")))
    with pytest.raises(ConfigError, match="--ep-num-redundant-experts 9: between 0 and the number of experts"):
        setup_moe(model, get_registry(), args, dtype=torch.float32, device=torch.device("cpu"), max_num_tokens=8)


def test_location_spreads_tokens_over_copies():
    loc = ExpertLocation([2, 0, 1, 2, 0, 3], 4)  # expert 2 in slots 0 and 3, expert 0 in 1 and 4
    ids = torch.tensor([[2, 0], [2, 1], [2, 3], [2, 0]], dtype=torch.int32)
    phys = loc.to_physical(ids)
    assert phys.dtype == torch.int32
    assert phys[:, 0].tolist() == [0, 3, 0, 3]  # token t -> copy t mod 2
    assert phys[:, 1].tolist() == [1, 2, 5, 4]
    assert torch.equal(torch.tensor(loc.physical_to_logical)[phys.long()], ids.long())
    with pytest.raises(ValueError, match=r"logical experts \[1\] have no physical slot"):
        ExpertLocation([0, 0, 2], 3)


@torch.no_grad()
def test_redundant_experts_leave_the_output_unchanged_on_one_rank(tmp_path):
    """Every copy holds the same weights, so any placement computes the same layer; the
    load counters stay per logical expert."""
    record = write_record(str(tmp_path / "r.json"))
    outs, counts = [], []
    for n in (0, 2, 4):
        model = TwoLayers(torch.float32)
        full = [(b.mlp.w13.data.clone(), b.mlp.w2.data.clone()) for b in model.layers]
        args = ServerArgs(moe_runner_backend="torch_native", ep_num_redundant_experts=n,
                          init_expert_location=record if n else None)
        rec = setup_moe(model, get_registry(), args, dtype=torch.float32, device=torch.device("cpu"),
                        max_num_tokens=64)
        assert model.layers[0].mlp.runner.ctx.num_experts == E + n
        x = torch.randn(29, H, generator=torch.Generator().manual_seed(3))
        for (w13, w2), block in zip(full, model.layers):
            ids, weights = select_experts(block.mlp.gate(x), K, True)
            y = block.mlp(x)
            torch.testing.assert_close(y, reference_moe(x, ids, weights, w13, w2), atol=1e-4, rtol=1e-4)
            x = y
        outs.append(x)
        counts.append(rec.counts.tolist())
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[2], outs[0], atol=1e-5, rtol=1e-5)
    assert counts[0] == counts[1] == counts[2] and len(counts[0][0]) == E

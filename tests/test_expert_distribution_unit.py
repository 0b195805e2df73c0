"""The expert load counters and the expert distribution recorder, on the counters alone
(the engine-level tests with MoE models are in test_expert_distribution.py)."""

from __future__ import annotations

import json

import pytest
import torch
from radixserve.engine.expert_distribution import ExpertDistributionRecorder, load_distribution
from radixserve.layers.moe import ExpertLoadRecorder


def _load(num_layers=2, num_experts=4):
    load = ExpertLoadRecorder(num_layers, num_experts, torch.device("cpu"))
    load.layer_ids = [1, 3]
    return load


def test_counters_add_every_choice_per_layer():
    load = _load()
    load.record(0, torch.tensor([[0, 1], [1, 3]], dtype=torch.int32))
    load.record(1, torch.tensor([[2, 2]], dtype=torch.int32))
    assert load.snapshot() == {1: [1, 2, 0, 1], 3: [0, 0, 2, 0]}


def test_stat_recording_counts_only_between_start_and_stop(tmp_path):
    load = _load()
    load.record(0, torch.tensor([[0, 0]]))  # before the recording: not in it
    rec = ExpertDistributionRecorder(load, num_experts=4, top_k=2, mode=None, directory=str(tmp_path))
    assert not rec.recording and not rec.has_record
    rec.start()
    load.record(0, torch.tensor([[1, 2]]))
    rec.on_forward(1)
    rec.stop()
    load.record(0, torch.tensor([[3, 3]]))  # after stop: not in it
    rec.on_forward(1)
    data = load_distribution(rec.dump())
    assert data["mode"] == "stat" and data["layers"] == [1, 3] and data["top_k"] == 2
    assert data["counts"] == [[0, 1, 1, 0], [0, 0, 0, 0]]
    assert data["num_forward_passes"] == 1 and data["num_tokens"] == 1
    totals = rec.totals()
    assert totals["moe_expert_tokens"][1] == [2, 1, 1, 2]
    assert totals["moe_expert_imbalance"][1] == pytest.approx(2 / 1.5)


def test_per_pass_keeps_the_last_passes(tmp_path):
    load = _load()
    rec = ExpertDistributionRecorder(load, num_experts=4, top_k=1, mode="per_pass", directory=str(tmp_path),
                                     buffer_size=2)
    assert rec.recording  # a mode given at launch records from launch
    for e in range(3):
        load.record(0, torch.tensor([[e]] * (e + 1)))
        rec.on_forward(e + 1)
    data = rec.record()
    assert [p["num_tokens"] for p in data["passes"]] == [2, 3]
    assert data["passes"][1]["counts"][0] == [0, 0, 3, 0]
    assert data["counts"][0] == [1, 2, 3, 0] and data["num_forward_passes"] == 3


def test_bad_mode_names_the_flag_and_a_foreign_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--expert-distribution-recorder-mode.*stat, per_pass"):
        ExpertDistributionRecorder(_load(), num_experts=4, top_k=1, mode="bogus", directory=None)
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"counts": []}))
    with pytest.raises(ValueError, match="not a radixserve expert distribution file"):
        load_distribution(str(path))

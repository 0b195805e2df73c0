"""The torch_native LoRA backend: the conformance suite, and its grouping of rows."""

from __future__ import annotations

import pytest
import torch
from radixserve.testing.lora_conformance import CASES, run_case
from radixserve_lora_torch import make_backend
from radixserve_lora_torch.backend import TorchNativeLoRA


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conforms(case):
    run_case(make_backend, case)


def test_rows_are_grouped_by_slot_as_slices_where_contiguous():
    from radixserve.lora.backend import LoRAContext

    backend = TorchNativeLoRA(LoRAContext(4, 8, torch.float32, torch.device("cpu")))
    groups = dict(backend.prepare(torch.tensor([0, 0, -1, 1, 1, 1, 0, 2])).groups)
    assert groups[1] == slice(3, 6) and groups[2] == slice(7, 8)
    assert groups[0].tolist() == [0, 1, 6]  # scattered: an index


def test_registered():
    from radixserve.registry import get_registry

    entry = get_registry().get("lora", "torch_native")
    assert entry.factory is make_backend and entry.is_available


def test_the_suite_catches_a_backend_that_drops_the_scaling():
    class NoScaling(TorchNativeLoRA):
        def apply(self, x, out, a, b, scaling, info):
            super().apply(x, out, a, b, torch.ones_like(scaling), info)

    with pytest.raises(AssertionError, match="max abs error"):
        run_case(NoScaling, CASES[2])

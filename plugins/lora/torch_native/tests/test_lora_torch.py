"""The torch_native LoRA backend: the conformance suite, and its grouping of rows."""

from __future__ import annotations

import pytest
import torch
from radixserve.testing.lora_conformance import CASES, run_case
from radixserve_lora_torch import make_backend
from radixserve_lora_torch.backend import TorchNativeLoRA


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conforms(case):
    run_case(make_backend, case)  # the C kernel on CPU in float32


def test_the_step_plan():
    """One run of one adapter: plain matmuls over a slice; otherwise the rows per slot in a padded
    [U, M] layout (the stacks sliced, not gathered, when the slots are 0..U-1)."""
    from radixserve.lora.backend import LoRAContext

    backend = TorchNativeLoRA(LoRAContext(4, 8, torch.float32, torch.device("cpu")))
    assert backend.prepare(torch.tensor([-1, 2, 2, 2, -1])).single == (2, slice(1, 4))
    plan = backend.prepare(torch.tensor([0, 0, -1, 1, 1, 1, 0, 2]))
    assert plan.single is None and plan.slot_range == slice(0, 3)
    assert plan.index.tolist() == [[0, 1, 6], [3, 4, 5], [7, 0, 0]]
    assert plan.rows.tolist() == [0, 1, 6, 3, 4, 5, 7] and plan.keep.tolist() == [True] * 7 + [False] * 2
    assert backend.prepare(torch.tensor([1, 3, 1])).slot_range is None


def test_registered():
    from radixserve.registry import get_registry

    entry = get_registry().get("lora", "torch_native")
    assert entry.factory is make_backend and entry.is_available


def test_the_suite_catches_a_backend_that_drops_the_scaling():
    class NoScaling(TorchNativeLoRA):
        def apply(self, x, outs, a, bs, scaling, info):
            super().apply(x, outs, a, bs, torch.ones_like(scaling), info)

    with pytest.raises(AssertionError, match="max abs error"):
        run_case(NoScaling, CASES[2])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_pytorch_path_conforms_too(case):
    """Without the C kernel (another device, or no compiler) the PyTorch path runs."""
    run_case(lambda ctx: TorchNativeLoRA(ctx, use_kernel=False), case)


def test_the_kernel_is_used_on_cpu():
    from radixserve.lora.backend import LoRAContext
    from radixserve_lora_torch import kernel

    if kernel.load() is None:
        pytest.skip("radixserve's CPU kernels cannot be built here (no compiler, or RADIXSERVE_CPU_KERNELS=0)")
    assert TorchNativeLoRA(LoRAContext(2, 4, torch.float32, torch.device("cpu"))).kernel is not None

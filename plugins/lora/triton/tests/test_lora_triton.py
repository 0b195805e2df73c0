"""The triton LoRA backend: the conformance suite (under Triton's interpreter on CPU, compiled
on a GPU), its block plan, and its registration."""

from __future__ import annotations

import pytest
import torch
from radixserve.testing.lora_conformance import CASES, run_case
from radixserve_lora_triton import make_backend, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"triton cannot run: {unavailable_reason()}")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conforms(case):
    run_case(make_backend, case, device=DEVICE)


def test_the_block_plan():
    """Rows grouped by slot, cut into blocks of one slot; rows of no adapter are left out."""
    from radixserve.lora.backend import LoRAContext
    from radixserve_lora_triton.backend import TritonLoRA

    backend = TritonLoRA(LoRAContext(4, 8, torch.float32, torch.device("cpu")))
    assert backend.prepare(torch.tensor([-1, -1])) is None
    plan = backend.prepare(torch.tensor([2, 0, -1, 2, 0, 0]))
    assert plan.rows.tolist() == [1, 4, 5, 0, 3] and plan.block_m == 16
    assert plan.blocks.tolist() == [[0, 3], [3, 2], [0, 2]]
    plan = backend.prepare(torch.tensor([1] * 70 + [3]))
    assert plan.block_m == 64
    assert plan.blocks.tolist() == [[0, 64, 70], [64, 6, 1], [1, 1, 3]]


def test_registered():
    from radixserve.registry import get_registry

    entry = get_registry().get("lora", "triton")
    assert entry.factory is make_backend and entry.is_available


def test_the_kernels_compile_for_a_gpu():
    """The interpreter forgives what the compiler refuses: both kernels build for sm_90 with
    Triton's own toolchain (a process without the interpreter), 16-bit and float32."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "radixserve_lora_triton.compile_check", "--arch", "90", "--dtype",
                           "bf16", "fp32"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sm_90 bf16 block_m=16 rank=16: shared memory shrink" in proc.stdout
    assert "sm_90 fp32 block_m=64 rank=16: shared memory shrink" in proc.stdout

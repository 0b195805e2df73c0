"""The torch_distributed transport against the MoE transport conformance suite: on one rank
(identity) and on 2 CPU ranks (gloo, one process each)."""

from __future__ import annotations

import pytest
import torch
from radixserve.testing import moe_conformance as mc
from radixserve_moe_a2a_torch import TorchDistributedA2A, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@pytest.mark.parametrize("case", mc.A2A_CASES, ids=str)
def test_single_rank(case):
    mc.run_a2a_case(TorchDistributedA2A, case)


def test_on_two_ranks():
    """(4 ranks, and the layer over this transport: the repository's tests/test_expert_parallel.py.)"""
    # tokens fewer than ranks (some ranks get an empty share), many experts, bf16
    cases = [mc.A2ACase(1, 8, 2), mc.A2ACase(3, 16, 8), mc.A2ACase(64, 60, 4), mc.A2ACase(0, 8, 2),
             mc.A2ACase(50, 8, 2, dtype=torch.bfloat16)]
    mc.run_a2a_cases_on_ranks(TorchDistributedA2A, 2, cases)

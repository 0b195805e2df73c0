"""The runner's compiled grouped linear (grouped_linear.c) against per-group F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from radixserve.kernels import cpu as cpu_kernels
from radixserve_moe_torch import kernel as grouped_kernel


@pytest.fixture(scope="module")
def kernels():
    core, grouped = cpu_kernels.load(), grouped_kernel.load()
    if core is None or grouped is None:
        pytest.skip(f"CPU kernels unavailable (the core's: {cpu_kernels.status()})")
    return core, grouped


@pytest.mark.parametrize("rows", [(1, 0, 0, 1), (0, 0, 0, 0), (3, 70, 0, 9, 1), (130, 0, 64, 65)])
@pytest.mark.parametrize("n,k", [(96, 64), (50, 17)])
def test_grouped_linear_matches_per_group_f_linear(kernels, rows, n, k):
    core, grouped = kernels
    """Each group's rows against its own weight; empty groups (and trailing rows past the
    last offset) are skipped."""
    g = torch.Generator().manual_seed(sum(rows) + n)
    groups = len(rows)
    w = torch.randn(groups, n, k, generator=g) / k**0.5
    total = sum(rows)
    x = torch.randn(total + 2, k, generator=g)
    offsets = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int64)
    got = grouped.grouped_linear(x, offsets, core.pack_grouped(w), n)
    assert got.shape == (total + 2, n)
    for i in range(groups):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        torch.testing.assert_close(got[lo:hi], F.linear(x[lo:hi], w[i]), rtol=1e-5, atol=1e-5)

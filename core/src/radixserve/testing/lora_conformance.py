"""Conformance suite for LoRA backends (``register_lora_backends``; contract in
:mod:`radixserve.lora.backend`). A third-party backend runs it as::

    from radixserve.testing.lora_conformance import CASES, run_case

    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_conforms(case):
        run_case(my_factory, case)

Each case builds random stacks for ``slots`` adapters of rank ``rank`` over a layer of one or
more parts (some slots holding a smaller rank, the rest zero, as the pool keeps them), a batch
whose rows use the slots in runs and scattered (``-1``: no adapter), calls ``prepare`` once and
``apply`` on strided column views of a larger output (as a fused layer's parts are), and
compares with :func:`~radixserve.lora.backend.reference_apply`; the columns outside the views
and the rows of no adapter must be left as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.lora.backend import LoRAContext, reference_apply


@dataclass(frozen=True)
class Case:
    rows: tuple[int, ...]  # each row's slot (-1: none)
    slots: int = 4
    rank: int = 8
    k: int = 64
    parts: tuple[int, ...] = (48,)  # each part's output columns
    dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        runs = "".join("." if s < 0 else str(s) for s in self.rows)
        n = "+".join(map(str, self.parts))
        return f"{runs}-S{self.slots}-R{self.rank}-K{self.k}-N{n}-{str(self.dtype).removeprefix('torch.')}"


CASES = [
    Case((0,)),
    Case((-1, -1, -1)),
    Case((0, 0, 0, 1, 1, -1, 2, 2, 2, 2)),
    Case((1, -1, 1, 0, 1, 3, 3, -1, 0)),  # one adapter's rows scattered
    Case(tuple([2] * 40 + [0] * 3), rank=16, k=96, parts=(80,)),
    Case((0, 1, 2, 3, 0, 1, 2, 3), slots=4, rank=4),
    Case((0, 1, -1, 1), dtype=torch.bfloat16),
    Case((0, 0, 1, -1, 2, 1, 1), parts=(32, 16, 16)),  # a fused QKV
    Case(tuple([3] * 9 + [1] * 7), rank=16, parts=(64, 64)),  # a fused gate/up
    Case((0, 1, 2, 3, 3, 2, 1, 0), parts=(24, 8, 8), dtype=torch.bfloat16),
]

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def run_case(factory, case: Case, *, device: str = "cpu", seed: int = 0) -> float:
    """Run ``factory(ctx)``'s backend over ``case``; the max abs error, or AssertionError."""
    g = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    s, r, k, parts = case.slots, case.rank, case.k, case.parts
    a = torch.zeros(s, len(parts) * r, k)
    bs = [torch.zeros(s, r, n) for n in parts]
    for i in range(s):  # slot i holds an adapter of rank r - i (at least 1); the rest stays zero
        ri = max(1, r - i)
        for p, (n, b) in enumerate(zip(parts, bs)):
            a[i, p * r:p * r + ri] = torch.randn(ri, k, generator=g) / k ** 0.5
            b[i, :ri] = torch.randn(ri, n, generator=g) / ri ** 0.5
    scaling = torch.rand(s, generator=g) + 0.5
    t, width = len(case.rows), sum(parts)
    x = torch.randn(t, k, generator=g).to(case.dtype)
    full = torch.randn(t, width + 16, generator=g).to(case.dtype)  # the parts' columns are [8, 8 + width)
    starts = [8 + sum(parts[:p]) for p in range(len(parts))]
    slots = torch.tensor(case.rows, dtype=torch.int64)
    backend = factory(LoRAContext(s, r, case.dtype, dev))
    got = full.clone().to(dev)
    info = backend.prepare(slots.to(dev))
    backend.apply(x.to(dev), [got[:, c:c + n] for c, n in zip(starts, parts)], a.to(dev), [b.to(dev) for b in bs],
                  scaling.to(dev), info)
    want = full.clone()
    reference_apply(x, [want[:, c:c + n] for c, n in zip(starts, parts)], a, bs, scaling, slots)
    got = got.cpu()
    if not torch.equal(got[:, :8], full[:, :8]) or not torch.equal(got[:, 8 + width:], full[:, 8 + width:]):
        raise AssertionError(f"{case}: columns outside the parts' views changed")
    base = slots < 0
    if not torch.equal(got[base], full[base]):
        raise AssertionError(f"{case}: rows without an adapter changed")
    err = (got.float() - want.float()).abs().max().item() if t else 0.0
    if err > TOLERANCE[case.dtype] * (1 + want.float().abs().max().item()):
        raise AssertionError(f"{case}: max abs error {err:.3g}")
    return err

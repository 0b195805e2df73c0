"""The ``triton`` LoRA backend: plans a step's blocks once (:meth:`TritonLoRA.prepare`) and
launches :mod:`.kernels` per layer (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from radixserve.plugin_api.lora import LoRABackend

from radixserve_lora_triton import kernels


@dataclass
class _Plan:
    rows: torch.Tensor  # [n] int32: the adapter rows, grouped by slot
    blocks: torch.Tensor  # [3, B] int32: each block's first place in rows, its row count, its slot
    block_m: int


def block_m_for(longest: int) -> int:
    """Rows per block: a decode step's groups are short, a prefill's long."""
    return 16 if longest <= 16 else 32 if longest <= 32 else 64


def _pow2_at_least_16(n: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(n)))


class TritonLoRA(LoRABackend):
    name = "triton"

    def prepare(self, token_slots: torch.Tensor) -> _Plan | None:
        by_slot: dict[int, list[int]] = {}
        for t, s in enumerate(token_slots.tolist()):
            if s >= 0:
                by_slot.setdefault(s, []).append(t)
        if not by_slot:
            return None
        bm = block_m_for(max(len(v) for v in by_slot.values()))
        rows: list[int] = []
        starts, counts, slots = [], [], []
        for s in sorted(by_slot):
            group = by_slot[s]
            for lo in range(0, len(group), bm):
                starts.append(len(rows) + lo)
                counts.append(min(bm, len(group) - lo))
                slots.append(s)
            rows.extend(group)
        dev = token_slots.device
        return _Plan(torch.tensor(rows, dtype=torch.int32, device=dev),
                     torch.tensor([starts, counts, slots], dtype=torch.int32, device=dev), bm)

    def apply(self, x, outs, a, bs, scaling, info: _Plan | None) -> None:
        if info is None:
            return
        n, num_blocks = info.rows.shape[0], info.blocks.shape[1]
        pr = a.shape[1]
        r = pr // len(bs)
        h = torch.empty(n, pr, dtype=torch.float32, device=x.device)
        block_n = _pow2_at_least_16(pr, 64)
        kernels.shrink_kernel[(num_blocks, triton.cdiv(pr, block_n))](
            x, a, h, scaling, info.rows, info.blocks, num_blocks, x.shape[1], pr,
            x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), h.stride(0),
            BLOCK_M=info.block_m, BLOCK_N=block_n, BLOCK_K=64,
        )
        block_r = _pow2_at_least_16(r, 64)
        for p, (out, b) in enumerate(zip(outs, bs)):
            width = b.shape[2]
            block_n = _pow2_at_least_16(width, 64)
            kernels.expand_kernel[(num_blocks, triton.cdiv(width, block_n))](
                h, b, out, info.rows, info.blocks, num_blocks, r, width, p * r,
                h.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
                BLOCK_M=info.block_m, BLOCK_N=block_n, BLOCK_R=block_r,
            )

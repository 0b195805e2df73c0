"""The fused MoE in four launches of work: align, gate/up GEMM with SiLU * up, down GEMM with
the routing weight, sum over the choices (see kernels.py and align.py).

Block sizes (:func:`choose_config`) follow the average load per expert, ``P / E`` pairs
(``P = N * top_k``), since that is what one expert's GEMM sees:

==================  =======  =======  =======  =======  =====  ======
load per expert     BLOCK_M  BLOCK_N  BLOCK_K  GROUP_M  warps  stages
==================  =======  =======  =======  =======  =====  ======
<= 16 (decode)        16       64      128        1       4      4
<= 64                 32       64      128        4       4      4
> 64 (prefill)        64      128       64        8       8      3
==================  =======  =======  =======  =======  =====  ======

Decode-sized batches are bound by reading the weights: a 16-row block (the smallest
``tl.dot`` tile) wastes least padding and long ``BLOCK_K`` strides keep loads wide. Prefill
is bound by compute: larger tiles reuse each loaded weight tile over 64 pairs, and
``GROUP_M`` orders programs so neighbours share weight tiles in L2. float32 halves
``BLOCK_K`` (and uses 3 stages at most) to stay within shared memory. The gate/up kernel
holds two accumulators, so its tile is effectively ``BLOCK_M x 2 BLOCK_N``.

Workspace per call: ``[P, I]`` (SiLU * up) and ``[P, H]`` (weighted expert outputs) in the
activations' dtype; :func:`fused_moe` runs at most ``max_pairs`` pairs at a time to bound it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from radixserve_moe_triton import kernels
from radixserve_moe_triton.align import align_block_size

#: most (token, choice) pairs per chunk: bounds the two workspaces
MAX_PAIRS = 65536
_COMBINE_TILE = 4096  # elements of Out per combine program: [4096 / BLOCK_H, BLOCK_H]


@dataclass(frozen=True)
class BlockConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


def choose_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> BlockConfig:
    """Tiles for ``num_pairs`` (token, choice) pairs over ``num_experts`` experts."""
    load = num_pairs / max(num_experts, 1)
    if load <= 16:
        cfg = BlockConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=4)
    elif load <= 64:
        cfg = BlockConfig(32, 64, 128, group_m=4, num_warps=4, num_stages=4)
    else:
        cfg = BlockConfig(64, 128, 64, group_m=8, num_warps=8, num_stages=3)
    if dtype == torch.float32:
        cfg = BlockConfig(cfg.block_m, cfg.block_n, cfg.block_k // 2, cfg.group_m, cfg.num_warps,
                          min(cfg.num_stages, 3))
    return cfg


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_ids: torch.Tensor, topk_weights: torch.Tensor,
              config: BlockConfig | None = None, max_pairs: int = MAX_PAIRS) -> torch.Tensor:
    """The runner contract: ``hidden_states  # [N, H]``, ``w13  # [E, 2I, H]``,
    ``w2  # [E, H, I]`` (both contiguous), ``topk_ids  # [N, K]`` (``-1``: skip),
    ``topk_weights  # [N, K]`` -> ``# [N, H]`` in the activations' dtype."""
    num_tokens, hidden = hidden_states.shape
    top_k = topk_ids.shape[1]
    out = torch.empty_like(hidden_states)
    if num_tokens == 0:
        return out
    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    chunk = max(1, max_pairs // top_k)
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        _fused_moe_chunk(x[start:end], w13, w2, ids[start:end], weights[start:end], out[start:end],
                         config)
    return out


def _fused_moe_chunk(x, w13, w2, topk_ids, topk_weights, out, config):
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, _, inter = w2.shape
    num_pairs = num_tokens * top_k
    cfg = config or choose_config(num_pairs, num_experts, x.dtype)
    al = align_block_size(topk_ids, num_experts, cfg.block_m)
    upcast = kernels.INTERPRETED
    launch = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  GROUP_M=cfg.group_m, UPCAST=upcast, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, enable_fp_fusion=True)

    inter_act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [P, I]
    grid = (al.num_blocks * triton.cdiv(inter, cfg.block_n),)
    kernels.gate_up_kernel[grid](
        x, w13, inter_act, al.sorted_pairs, al.expert_ids, al.num_post_padded,
        num_pairs, al.num_blocks, hidden, inter, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), inter_act.stride(0),
        **launch,
    )

    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [P, H]
    grid = (al.num_blocks * triton.cdiv(hidden, cfg.block_n),)
    kernels.down_kernel[grid](
        inter_act, w2, y, topk_weights, al.sorted_pairs, al.expert_ids, al.num_post_padded,
        num_pairs, al.num_blocks, inter, hidden,
        inter_act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        **launch,
    )

    block_h = min(triton.next_power_of_2(hidden), _COMBINE_TILE // 4)
    block_t = _COMBINE_TILE // block_h
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block_h))
    kernels.combine_kernel[grid](
        y, topk_ids, out, num_tokens, hidden, top_k, y.stride(0), out.stride(0),
        BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4, enable_fp_fusion=True,
    )

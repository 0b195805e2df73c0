"""Triton kernels of the fused MoE: two grouped GEMMs over expert-sorted (token, choice)
pairs and the per-token sum over the choices.

Every GEMM program owns one ``BLOCK_M`` block of the sorted pair list (see
:func:`radixserve_moe_triton.align.align_block_size`): all pairs of a block belong to one
expert, whose id the program reads from ``Expert_ids``, so it multiplies a gathered tile of
activations by one expert's weight tile. A pair is named by its flat index
``p = token * top_k + choice``; padding slots hold ``num_pairs`` and are masked out.
Programs whose block lies past ``Num_post_padded`` (the grid is sized for the worst case
from shapes alone, so no host sync is needed) return at once.

- :func:`gate_up_kernel`: ``Inter[p] = silu(x @ w1[e].T) * (x @ w3[e].T)``. Each program
  keeps two float32 accumulators, one for a ``BLOCK_N`` slice of the gate rows of ``w13``
  and one for the same slice of the up rows, and applies SiLU * up in its epilogue, so the
  ``[P, 2I]`` gate/up product is never written.
- :func:`down_kernel`: ``Y[p] = topk_weight[p] * (Inter[p] @ w2[e].T)``, the routing weight
  applied to the float32 accumulator before the one rounding to the activations' dtype.
- :func:`combine_kernel`: ``Out[n] = sum_k Y[n * top_k + k]`` over the choices whose id is
  not ``-1`` (those pairs were never computed), summed in float32.

Weights are read in the core's layout (``w13 [E, 2I, H]``, ``w2 [E, H, I]``, rows contiguous
along the reduction dimension), as ``[BLOCK_K, BLOCK_N]`` tiles through strides.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when this module is
imported. The interpreter multiplies bfloat16 operands of ``tl.dot`` as their raw bits, so
under it (``UPCAST``) both operands are widened to float32 first; the products of two
bfloat16 values are exact in float32, so the result is what a GPU's tensor cores give.
``input_precision="ieee"`` only changes float32 operands (exact products, not tf32).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

#: True when these kernels were built for Triton's interpreter (CPU tensors).
INTERPRETED: bool = bool(knobs.runtime.interpret)


@triton.jit
def _block_of(pid, num_blocks_m, n_cols, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (pair block, column block), visiting ``GROUP_M`` pair blocks per column
    sweep so that neighbouring programs share weight tiles in L2."""
    num_blocks_n = tl.cdiv(n_cols, BLOCK_N)
    per_group = GROUP_M * num_blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_blocks_m - first_m, GROUP_M)
    block_m = first_m + (pid % per_group) % group_rows
    block_n = (pid % per_group) // group_rows
    return block_m, block_n


@triton.jit
def gate_up_kernel(
    X,  # [N, H] activations
    W13,  # [E, 2I, H]
    Inter,  # [P, I] out: silu(gate) * up per pair
    Sorted_pairs,  # [num_blocks_m * BLOCK_M] int32 pair index, num_pairs = padding
    Expert_ids,  # [num_blocks_m] int32 expert of each block
    Num_post_padded,  # [1] int32 pair slots in use (a multiple of BLOCK_M)
    num_pairs,
    num_blocks_m,
    hidden,  # H: the reduction
    inter,  # I: output columns
    top_k,
    stride_xm,
    stride_we,
    stride_wn,
    stride_im,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    block_m, block_n = _block_of(tl.program_id(0), num_blocks_m, inter, BLOCK_N, GROUP_M)
    if block_m * BLOCK_M >= tl.load(Num_post_padded):
        return
    expert = tl.load(Expert_ids + block_m).to(tl.int64)
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(Sorted_pairs + offs_m)  # [M]
    m_valid = pair < num_pairs
    token = (pair // top_k).to(tl.int64)
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = X + token[:, None] * stride_xm + offs_k[None, :]  # [M, K]
    gate_ptrs = W13 + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [K, N]
    up_ptrs = gate_ptrs + inter * stride_wn  # the up rows follow the I gate rows
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_valid = offs_k < hidden - kb * BLOCK_K
        x = tl.load(x_ptrs, mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        w_mask = k_valid[:, None] & n_valid[None, :]
        w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        w_up = tl.load(up_ptrs, mask=w_mask, other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w_gate = w_gate.to(tl.float32)
            w_up = w_up.to(tl.float32)
        acc_gate = tl.dot(x, w_gate, acc_gate, input_precision="ieee")
        acc_up = tl.dot(x, w_up, acc_up, input_precision="ieee")
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K

    act = acc_gate * tl.sigmoid(acc_gate) * acc_up  # silu(gate) * up, in float32
    out_ptrs = Inter + pair.to(tl.int64)[:, None] * stride_im + offs_n[None, :]
    tl.store(out_ptrs, act.to(Inter.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


@triton.jit
def down_kernel(
    Inter,  # [P, I]
    W2,  # [E, H, I]
    Y,  # [P, H] out: routing-weighted expert output per pair
    Topk_weights,  # [P] float32
    Sorted_pairs,
    Expert_ids,
    Num_post_padded,
    num_pairs,
    num_blocks_m,
    inter,  # I: the reduction
    hidden,  # H: output columns
    stride_im,
    stride_we,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    block_m, block_n = _block_of(tl.program_id(0), num_blocks_m, hidden, BLOCK_N, GROUP_M)
    if block_m * BLOCK_M >= tl.load(Num_post_padded):
        return
    expert = tl.load(Expert_ids + block_m).to(tl.int64)
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(Sorted_pairs + offs_m)
    m_valid = pair < num_pairs
    row = pair.to(tl.int64)
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = Inter + row[:, None] * stride_im + offs_k[None, :]  # [M, K]
    w_ptrs = W2 + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(inter, BLOCK_K)):
        k_valid = offs_k < inter - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision="ieee")
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    weight = tl.load(Topk_weights + row, mask=m_valid, other=0.0)  # [M] float32
    acc = acc * weight[:, None]
    out_ptrs = Y + row[:, None] * stride_ym + offs_n[None, :]
    tl.store(out_ptrs, acc.to(Y.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


@triton.jit
def combine_kernel(
    Y,  # [N * top_k, H]
    Topk_ids,  # [N * top_k] int32, -1: not computed
    Out,  # [N, H]
    num_tokens,
    hidden,
    top_k,
    stride_ym,
    stride_om,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One ``[BLOCK_T, BLOCK_H]`` tile of ``Out`` per program."""
    token = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [T]
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [H]
    t_valid = token < num_tokens
    h_valid = offs_h < hidden
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in range(0, top_k):
        pair = token * top_k + k  # [T]
        chosen = tl.load(Topk_ids + pair, mask=t_valid, other=-1) >= 0  # -1: never computed
        y = tl.load(
            Y + pair[:, None] * stride_ym + offs_h[None, :],
            mask=chosen[:, None] & h_valid[None, :],
            other=0.0,
        )
        acc += y.to(tl.float32)
    out_ptrs = Out + token[:, None] * stride_om + offs_h[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=t_valid[:, None] & h_valid[None, :])

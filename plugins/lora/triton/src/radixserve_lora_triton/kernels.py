"""The SGMV kernels. A step's adapter rows are cut into *blocks*: up to ``BLOCK_M`` rows of one
adapter, consecutive in the step's permutation ``rows`` (the adapter rows grouped by slot).
``blocks  # [3, B] int32`` holds each block's first place in ``rows``, its row count and its
slot; both kernels take one block per program along the grid's first axis, so no program
computes rows of another adapter or padding past a group's end.

Products run in float32 (``input_precision="ieee"``: no TF32 on a GPU) unless the stacks are
16-bit, then the shrink multiplies in their dtype; the expand adds in float32 and rounds once.
"""

import triton
import triton.language as tl


@triton.jit
def _block_rows(rows_ptr, blocks_ptr, num_blocks, BLOCK_M: tl.constexpr):
    """The program's block: its first place in ``rows``, its places, which are real, their rows
    and the block's slot."""
    blk = tl.program_id(0)
    start = tl.load(blocks_ptr + blk)
    count = tl.load(blocks_ptr + num_blocks + blk)
    slot = tl.load(blocks_ptr + 2 * num_blocks + blk).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < count
    row = tl.load(rows_ptr + start + m, mask=m_ok, other=0).to(tl.int64)
    return start, m, m_ok, row, slot


@triton.jit
def shrink_kernel(
    x_ptr, a_ptr, h_ptr, scaling_ptr, rows_ptr, blocks_ptr, num_blocks,
    K, N,  # x's columns; the stacks' rows (all parts: P * R)
    stride_xt, stride_xk, stride_as, stride_an, stride_ak, stride_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``h[i] = scaling[s] * x[rows[i]] @ a[s].T`` for the block's places ``i`` (slot ``s``)."""
    start, m, m_ok, row, slot = _block_rows(rows_ptr, blocks_ptr, num_blocks, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xt = tl.load(x_ptr + row[:, None] * stride_xt + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :],
                     other=0.0)
        at = tl.load(a_ptr + slot * stride_as + n[None, :] * stride_an + k[:, None] * stride_ak,
                     mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]: A transposed
        acc += tl.dot(xt.to(at.dtype), at, input_precision="ieee")
    acc = acc * tl.load(scaling_ptr + slot)
    tl.store(h_ptr + (start + m)[:, None] * stride_h + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def expand_kernel(
    h_ptr, b_ptr, out_ptr, rows_ptr, blocks_ptr, num_blocks,
    R, N, h_col,  # the rank; the part's output columns; the part's first column in h
    stride_h, stride_bs, stride_br, stride_bn, stride_ot, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """``out[rows[i]] += h[i, h_col:h_col + R] @ b[s]`` for the block's places ``i``."""
    start, m, m_ok, row, slot = _block_rows(rows_ptr, blocks_ptr, num_blocks, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < R
        ht = tl.load(h_ptr + (start + m)[:, None] * stride_h + h_col + r[None, :], mask=m_ok[:, None] & r_ok[None, :],
                     other=0.0)
        bt = tl.load(b_ptr + slot * stride_bs + r[:, None] * stride_br + n[None, :] * stride_bn,
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(ht, bt.to(tl.float32), input_precision="ieee")
    ok = m_ok[:, None] & n_ok[None, :]
    where = out_ptr + row[:, None] * stride_ot + n[None, :] * stride_on
    old = tl.load(where, mask=ok, other=0.0)
    tl.store(where, (old.to(tl.float32) + acc).to(old.dtype), mask=ok)

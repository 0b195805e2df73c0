"""Triton kernels: paged extend attention and split-K (flash-decoding) decode attention.

The extend kernel also serves target verify (speculative decoding): with ``TREE`` the new
tokens of a request attend to each other through the request's tree mask (ancestors and
self) instead of causally, and sliding windows use ``batch.positions`` (prefix + depth).

Both kernels read a request's cached tokens through the request-to-token-slot table
(``req_to_token[row, pos]`` is the pool slot of position ``pos``), so no per-step index
list is gathered on the host. Softmax is computed online in base 2: scores are scaled by
``scaling * log2(e)`` and exponentiated with ``exp2``; every log-sum-exp passed between
the decode stages is in that base too.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when this module is
imported: set it before the first import to run the kernels on CPU tensors. The
interpreter multiplies bf16 operands as their raw bits, so under it (``UPCAST``) q is
widened to fp32 and every K/V tile and softmax weight is cast to q's dtype before
``tl.dot``, after the same rounding to the activation dtype a GPU applies; on a GPU those
casts are no-ops. ``input_precision="ieee"`` only affects fp32 operands (exact products
rather than tf32).

Head dims: each K row is read as two tiles, its first ``HEAD_DIM`` dims (``BLOCK_D`` wide) and
``PE_DIM`` more (``BLOCK_PE`` wide; none when 0), so a 576-dim MLA row is one 512 tile and
one 64 tile instead of a 1024 tile; V rows have ``V_DIM`` dims (``BLOCK_DV``). MLA's latent
cache (``V_IN_K``: one KV head whose first ``V_DIM == HEAD_DIM`` dims are V) takes V from the
K tile already loaded, never reading ``V_buf``/``V_new``. A plain head is one tile,
``V_DIM == HEAD_DIM``.

KV storage dtype (``--kv-cache-dtype``): the pool (``K_buf``, ``V_buf``) and the new
tokens' ``K_new``/``V_new`` (the backend hands the kernel the same rounded copy it
stores) may be narrower than the activations (bfloat16, float16, fp8): every tile is
widened to q's dtype on load, and softmax weights are rounded to the activation dtype
(``Q``'s), never to the pool's, before the ``P @ V`` product.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

#: True when these kernels were built for Triton's interpreter (CPU tensors).
INTERPRETED: bool = bool(knobs.runtime.interpret)

# Running max starts at a finite floor, not -inf: a row whose keys are all masked in a
# block then keeps max -1e30 and weight exp2(-inf) = 0 instead of exp2(-inf + inf) = nan.
# (A constexpr: compiled kernels may only read globals that are constexpr.)
_NEG_FLOOR = tl.constexpr(-1.0e30)


@triton.jit(do_not_specialize=["window"])
def extend_kernel(
    Q,
    K_new,
    V_new,
    Out,
    K_buf,
    V_buf,
    Req_to_token,
    Req_pool_indices,
    Prefix_lens,
    Extend_lens,
    Qo_start,
    Mask_offsets,
    Tree_mask,
    Positions,
    scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_ot,
    stride_oh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    stride_r2t,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    TREE: tl.constexpr,
    PE_DIM: tl.constexpr,
    BLOCK_PE: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    V_IN_K: tl.constexpr,
):
    """One program: BLOCK_M new tokens of one request for one query head.

    grid = (batch, num_heads, cdiv(max_extend, BLOCK_M)). First the cached prefix (paged,
    through req_to_token), then the new tokens themselves (read from K_new/V_new, causal).
    ``window > 0`` keeps only the ``window`` most recent positions (the token itself included).

    ``TREE`` (target verify): new token ``a`` of request ``b`` sees new token ``j`` iff
    ``Tree_mask[Mask_offsets[b] + a * ext + j]`` (uint8, row-major ``[ext, ext]``), and
    query and key positions of the new tokens come from ``Positions`` (prefix + depth).
    Without it those three pointers are never read.

    K dims (see the module doc, "Head dims"): ``HEAD_DIM`` in the first tile, ``PE_DIM`` more
    in a second; V has ``V_DIM``, or with ``V_IN_K`` is the first tile of K.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    ext = tl.load(Extend_lens + b)
    if mb * BLOCK_M < ext:
        prefix = tl.load(Prefix_lens + b)
        q_start = tl.load(Qo_start + b)
        row = tl.load(Req_pool_indices + b).to(tl.int64)
        kvh = h // GROUP

        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] index among the new tokens
        offs_d = tl.arange(0, BLOCK_D)
        m_valid = offs_m < ext
        d_valid = offs_d < HEAD_DIM
        offs_pe = HEAD_DIM + tl.arange(0, BLOCK_PE)
        pe_valid = offs_pe < HEAD_DIM + PE_DIM
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_valid = offs_dv < V_DIM
        q_rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=m_valid[:, None] & d_valid[None, :],
            other=0.0,
        )  # [M, D]
        if UPCAST:
            q = q.to(tl.float32)
        if PE_DIM > 0:
            q_pe = tl.load(
                Q + q_rows[:, None] * stride_qt + h * stride_qh + offs_pe[None, :],
                mask=m_valid[:, None] & pe_valid[None, :],
                other=0.0,
            ).to(q.dtype)  # [M, PE]
        if TREE:  # positions are prefix + depth in the tree: the block's lowest is >= prefix
            q_pos = tl.load(Positions + q_rows, mask=m_valid, other=0)  # [M]
            q_first = prefix
            mask_base = Tree_mask + tl.load(Mask_offsets + b).to(tl.int64)
        else:
            q_pos = prefix + offs_m
            q_first = prefix + mb * BLOCK_M

        m_i = tl.full([BLOCK_M], _NEG_FLOOR, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

        # Cached prefix: positions [lo, prefix), all before every new token.
        lo = tl.where(window > 0, tl.maximum(q_first - window + 1, 0), 0)
        for n0 in range(lo, prefix, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)  # [N]
            n_valid = pos < prefix
            slot = tl.load(Req_to_token + row * stride_r2t + pos, mask=n_valid, other=0).to(
                tl.int64
            )
            kt = tl.load(
                K_buf + slot[None, :] * stride_kbt + kvh * stride_kbh + offs_d[:, None],
                mask=n_valid[None, :] & d_valid[:, None],
                other=0.0,
            )  # [D, N]
            # Products in q's dtype: the pool's own, or fp32 under UPCAST (see the module doc).
            s = tl.dot(q, kt.to(q.dtype), input_precision="ieee")  # [M, N]
            if PE_DIM > 0:
                kpe = tl.load(
                    K_buf + slot[None, :] * stride_kbt + kvh * stride_kbh + offs_pe[:, None],
                    mask=n_valid[None, :] & pe_valid[:, None],
                    other=0.0,
                )  # [PE, N]
                s += tl.dot(q_pe, kpe.to(q.dtype), input_precision="ieee")
            s = s * scale_log2
            in_window = pos[None, :] > q_pos[:, None] - window  # [M, N]
            allowed = n_valid[None, :] & ((window <= 0) | in_window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if V_IN_K:  # MLA: V is the K tile's first V_DIM dims, already loaded
                v = tl.trans(kt)
            else:
                v = tl.load(
                    V_buf + slot[:, None] * stride_vbt + kvh * stride_vbh + offs_dv[None, :],
                    mask=n_valid[:, None] & dv_valid[None, :],
                    other=0.0,
                )  # [N, DV]
            acc = acc * alpha[:, None] + tl.dot(
                p.to(Q.dtype.element_ty).to(q.dtype), v.to(q.dtype), input_precision="ieee"
            )
            m_i = m_new

        # New tokens: causal within the request, up to the last row of this block; a tree
        # mask may let a token see any other (its ancestors need not come before it).
        if TREE:
            hi = ext
            lo = 0
        else:
            hi = tl.minimum(ext, (mb + 1) * BLOCK_M)
            lo = tl.where(window > 0, tl.maximum(mb * BLOCK_M - window + 1, 0), 0)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_valid = offs_n < hi
            k_rows = (q_start + offs_n).to(tl.int64)
            kt = tl.load(
                K_new + k_rows[None, :] * stride_knt + kvh * stride_knh + offs_d[:, None],
                mask=n_valid[None, :] & d_valid[:, None],
                other=0.0,
            )  # [D, N]
            s = tl.dot(q, kt.to(q.dtype), input_precision="ieee")
            if PE_DIM > 0:
                kpe = tl.load(
                    K_new + k_rows[None, :] * stride_knt + kvh * stride_knh + offs_pe[:, None],
                    mask=n_valid[None, :] & pe_valid[:, None],
                    other=0.0,
                )  # [PE, N]
                s += tl.dot(q_pe, kpe.to(q.dtype), input_precision="ieee")
            s = s * scale_log2
            if TREE:
                seen = tl.load(
                    mask_base + offs_m[:, None] * ext + offs_n[None, :],
                    mask=m_valid[:, None] & n_valid[None, :],
                    other=0,
                )  # [M, N]
                k_pos = tl.load(Positions + k_rows, mask=n_valid, other=0)  # [N]
                in_window = k_pos[None, :] > q_pos[:, None] - window
                allowed = (seen != 0) & ((window <= 0) | in_window)
            else:
                in_window = offs_n[None, :] > offs_m[:, None] - window
                allowed = (
                    n_valid[None, :]
                    & (offs_n[None, :] <= offs_m[:, None])
                    & ((window <= 0) | in_window)
                )
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if V_IN_K:
                v = tl.trans(kt)
            else:
                v = tl.load(
                    V_new + k_rows[:, None] * stride_vnt + kvh * stride_vnh + offs_dv[None, :],
                    mask=n_valid[:, None] & dv_valid[None, :],
                    other=0.0,
                )
            acc = acc * alpha[:, None] + tl.dot(
                p.to(Q.dtype.element_ty).to(q.dtype), v.to(q.dtype), input_precision="ieee"
            )
            m_i = m_new

        l_i = tl.where(l_i > 0, l_i, 1.0)
        out = acc / l_i[:, None]
        tl.store(
            Out + q_rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
            out.to(Out.dtype.element_ty),
            mask=m_valid[:, None] & dv_valid[None, :],
        )


@triton.jit(do_not_specialize=["window", "min_split"])
def decode_stage1_kernel(
    Q,
    K_buf,
    V_buf,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Num_splits,
    Mid_o,
    Mid_lse,
    scale_log2,
    window,
    min_split,
    stride_qb,
    stride_qh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    stride_r2t,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PE_DIM: tl.constexpr,
    BLOCK_PE: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    V_IN_K: tl.constexpr,
):
    """One program: one KV split of one request for up to BLOCK_H query heads sharing a KV head.

    grid = (batch, num_kv_heads * cdiv(GROUP, BLOCK_H), max_splits). Each K/V tile is read
    once for the whole query group (a [BLOCK_H, D] x [D, N] product). Writes the split's
    normalised partial output and its log2-sum-exp; empty splits write nothing.
    """
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    HEAD_BLOCKS: tl.constexpr = (GROUP + BLOCK_H - 1) // BLOCK_H
    kvh = hb // HEAD_BLOCKS
    in_group = (hb % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)  # [H] index in the group
    h_valid = in_group < GROUP
    heads = kvh * GROUP + in_group

    seq_len = tl.load(Seq_lens + b)
    num_splits = tl.load(Num_splits + b)
    # KV split ``split`` covers positions [lo, hi): the attended span cut into equal pieces.
    # Inlined, and no tl.cdiv: the interpreter re-patches triton.language on every call of a
    # jit function (tl.cdiv, tl.max and tl.sum are ones), which is slow.
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    span = seq_len - start
    # A window shortens the span: no split below min_split tokens (at least one split).
    num_splits = tl.maximum(tl.minimum(num_splits, (span + min_split - 1) // min_split), 1)
    split_len = (span + num_splits - 1) // num_splits
    lo = start + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    if (split < num_splits) & (lo < hi):
        row = tl.load(Req_pool_indices + b).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < HEAD_DIM
        offs_pe = HEAD_DIM + tl.arange(0, BLOCK_PE)
        pe_valid = offs_pe < HEAD_DIM + PE_DIM
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_valid = offs_dv < V_DIM
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=h_valid[:, None] & d_valid[None, :],
            other=0.0,
        )  # [H, D]
        if UPCAST:
            q = q.to(tl.float32)
        if PE_DIM > 0:
            q_pe = tl.load(
                Q + b * stride_qb + heads[:, None] * stride_qh + offs_pe[None, :],
                mask=h_valid[:, None] & pe_valid[None, :],
                other=0.0,
            ).to(q.dtype)  # [H, PE]
        m_i = tl.full([BLOCK_H], _NEG_FLOOR, tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            n_valid = pos < hi
            slot = tl.load(Req_to_token + row * stride_r2t + pos, mask=n_valid, other=0).to(
                tl.int64
            )
            kt = tl.load(
                K_buf + slot[None, :] * stride_kbt + kvh * stride_kbh + offs_d[:, None],
                mask=n_valid[None, :] & d_valid[:, None],
                other=0.0,
            )  # [D, N]
            s = tl.dot(q, kt.to(q.dtype), input_precision="ieee")  # [H, N]
            if PE_DIM > 0:
                kpe = tl.load(
                    K_buf + slot[None, :] * stride_kbt + kvh * stride_kbh + offs_pe[:, None],
                    mask=n_valid[None, :] & pe_valid[:, None],
                    other=0.0,
                )  # [PE, N]
                s += tl.dot(q_pe, kpe.to(q.dtype), input_precision="ieee")
            s = tl.where(n_valid[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if V_IN_K:  # MLA: V is the K tile's first V_DIM dims, already loaded
                v = tl.trans(kt)
            else:
                v = tl.load(
                    V_buf + slot[:, None] * stride_vbt + kvh * stride_vbh + offs_dv[None, :],
                    mask=n_valid[:, None] & dv_valid[None, :],
                    other=0.0,
                )  # [N, DV]
            acc = acc * alpha[:, None] + tl.dot(
                p.to(Q.dtype.element_ty).to(q.dtype), v.to(q.dtype), input_precision="ieee"
            )
            m_i = m_new
        mid = (
            Mid_o
            + b * stride_mob
            + heads[:, None] * stride_moh
            + split * stride_mos
            + offs_dv[None, :]
        )
        tl.store(mid, acc / l_i[:, None], mask=h_valid[:, None] & dv_valid[None, :])
        tl.store(
            Mid_lse + b * stride_mlb + heads * stride_mlh + split, m_i + tl.log2(l_i), mask=h_valid
        )


@triton.jit(do_not_specialize=["window", "min_split"])
def decode_stage2_kernel(
    Mid_o,
    Mid_lse,
    Out,
    Seq_lens,
    Num_splits,
    window,
    min_split,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program: one query head of one request; merges its non-empty splits by
    log-sum-exp weights. grid = (batch, num_heads)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(Seq_lens + b)
    num_splits = tl.load(Num_splits + b)
    splits = tl.arange(0, BLOCK_S)
    start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # as in stage 1
    span = seq_len - start
    num_splits = tl.maximum(tl.minimum(num_splits, (span + min_split - 1) // min_split), 1)
    split_len = (span + num_splits - 1) // num_splits
    lo = start + splits * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    s_valid = (splits < num_splits) & (lo < hi)
    lse = tl.load(
        Mid_lse + b * stride_mlb + h * stride_mlh + splits, mask=s_valid, other=float("-inf")
    )  # [S]
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(s_valid, w, 0.0)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    part = tl.load(
        Mid_o + b * stride_mob + h * stride_moh + splits[:, None] * stride_mos + offs_d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [S, D]
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_valid
    )


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(n)

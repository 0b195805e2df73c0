"""DeepGEMM's two grouped layouts and its FP8 block-scale formats, in plain torch.

Nothing here imports ``deep_gemm``: these functions are what the runner does around the
library's kernels, and they run (and are tested) on CPU.

**Dispatched rows** (the MoE runner contract, :mod:`radixserve.layers.moe`):
``x  # [N, H]``, ``topk_ids  # [N, K]`` local expert ids or ``-1``. Each valid (row, choice)
is a *pair*; pair ``p = n * K + k``.

**Contiguous layout** (DeepGEMM ``m_grouped_*_gemm_nt_contiguous``, prefill): the pairs'
rows stacked by expert, ``A  # [M, H]``; expert ``e``'s segment starts at a multiple of
``alignment`` (the library's ``get_mk_alignment_for_contiguous_layout()``) and is padded up
to the next one. ``m_indices  # [M] int32`` (the library's ``grouped_layout``) holds each
row's expert, ``-1`` on padding rows. The library computes
``D[m] = A[m] @ B[m_indices[m]].T`` for every row with ``m_indices[m] >= 0`` and leaves
padding rows unspecified. ``M`` is only known after counting, so building the layout reads
the per-expert counts on the host (one sync).

**Masked layout** (``m_grouped_*_gemm_nt_masked``, decode): ``A  # [E, max_m, H]`` with
expert ``e``'s rows in ``A[e, :masked_m[e]]`` and ``masked_m  # [E] int32``; the library
computes ``D[e, j] = A[e, j] @ B[e].T`` for ``j < masked_m[e]`` and leaves the rest
unspecified. No host sync: ``max_m`` is fixed in advance (see :func:`to_masked`).

**FP8 formats** (DeepGEMM's "1x128 activations, 128x128 weights" recipe): activations are
``float8_e4m3fn`` with one float32 scale per row and 128 consecutive K elements
(``# [..., ceil(K / 128)]``); weights ``[E, N, K]`` with one scale per 128x128 block
(``# [E, ceil(N / 128), ceil(K / 128)]``); ``value = fp8 * scale``. On sm100 the library
wants power-of-two scales (UE8M0), ``round_scale_pow2=True``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128  # DeepGEMM's scale granularity along K (and along N for weights)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------ contiguous layout
@dataclass
class ContiguousLayout:
    """Where each valid (row, choice) pair sits in DeepGEMM's contiguous layout."""

    m_indices: torch.Tensor  # [M] int32: the row's expert, -1 on padding rows
    pair_row: torch.Tensor  # [P] int64: the layout row of each valid pair (in expert order)
    pair_token: torch.Tensor  # [P] int64: the dispatched row the pair came from
    pair_choice: torch.Tensor  # [P] int64: its choice index k
    num_rows: int  # M, a multiple of the alignment


def _valid_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """Valid pairs sorted by expert (stable: by row within an expert) and per-expert counts."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()  # [N*K]
    valid = (flat >= 0) & (flat < num_experts)
    pair = valid.nonzero().squeeze(1)  # [P] flat pair ids, by row then choice
    expert = flat[pair]
    order = torch.sort(expert, stable=True).indices
    pair, expert = pair[order], expert[order]
    counts = torch.bincount(expert, minlength=num_experts)  # [E]
    return pair // k, pair % k, expert, counts


def to_contiguous(topk_ids: torch.Tensor, num_experts: int, alignment: int) -> ContiguousLayout:
    """The contiguous layout of ``topk_ids  # [N, K]`` (ids outside ``[0, num_experts)``
    are dropped). Reads the per-expert counts on the host once."""
    token, choice, expert, counts = _valid_pairs_by_expert(topk_ids, num_experts)
    dev = topk_ids.device
    padded = (counts + alignment - 1) // alignment * alignment  # [E]
    seg_start = torch.cumsum(padded, 0) - padded  # [E] first row of each expert's segment
    num_rows = int(padded.sum())  # the one host sync
    first_pair = torch.cumsum(counts, 0) - counts  # [E] index of each expert's first pair
    rank = torch.arange(expert.numel(), device=dev) - first_pair[expert]  # position within its expert
    pair_row = seg_start[expert] + rank  # [P]
    m_indices = torch.full((num_rows,), -1, dtype=torch.int32, device=dev)
    m_indices[pair_row] = expert.to(torch.int32)
    return ContiguousLayout(m_indices, pair_row, token, choice, num_rows)


def gather_contiguous(x: torch.Tensor, layout: ContiguousLayout) -> torch.Tensor:
    """``x  # [N, H]`` -> ``A  # [M, H]`` in the layout, zeros on padding rows."""
    a = x.new_zeros(layout.num_rows, x.shape[1])
    a[layout.pair_row] = x[layout.pair_token]
    return a


def scatter_contiguous(d: torch.Tensor, layout: ContiguousLayout, topk_weights: torch.Tensor,
                       num_tokens: int) -> torch.Tensor:
    """``D  # [M, H]`` -> ``# [N, H] float32``: each dispatched row's sum over its valid pairs
    of ``topk_weights[n, k] * D[row of (n, k)]``. Padding rows are never read."""
    w = topk_weights[layout.pair_token, layout.pair_choice].float().unsqueeze(1)  # [P, 1]
    out = torch.zeros(num_tokens, d.shape[1], dtype=torch.float32, device=d.device)
    out.index_add_(0, layout.pair_token, d[layout.pair_row].float() * w)
    return out


# ---------------------------------------------------------------------- masked layout
@dataclass
class MaskedLayout:
    """Where each valid (row, choice) pair sits in DeepGEMM's masked layout."""

    masked_m: torch.Tensor  # [E] int32: valid rows per expert
    pair_expert: torch.Tensor  # [P] int64
    pair_slot: torch.Tensor  # [P] int64: the pair's row within its expert
    pair_token: torch.Tensor  # [P] int64
    pair_choice: torch.Tensor  # [P] int64
    num_experts: int
    max_m: int  # rows per expert in the buffer


def to_masked(topk_ids: torch.Tensor, num_experts: int, max_m: int) -> MaskedLayout:
    """The masked layout of ``topk_ids  # [N, K]`` with ``max_m`` rows per expert. No host
    sync. ``max_m`` must bound every expert's count: ``max_m >= N`` does when a row's valid
    choices name distinct experts (as top-k routing gives); a larger count is not detected."""
    token, choice, expert, counts = _valid_pairs_by_expert(topk_ids, num_experts)
    first_pair = torch.cumsum(counts, 0) - counts
    slot = torch.arange(expert.numel(), device=topk_ids.device) - first_pair[expert]
    return MaskedLayout(counts.to(torch.int32), expert, slot, token, choice, num_experts, max_m)


def gather_masked(x: torch.Tensor, layout: MaskedLayout) -> torch.Tensor:
    """``x  # [N, H]`` -> ``A  # [E, max_m, H]``, zeros beyond each ``masked_m``."""
    a = x.new_zeros(layout.num_experts, layout.max_m, x.shape[1])
    a[layout.pair_expert, layout.pair_slot] = x[layout.pair_token]
    return a


def scatter_masked(d: torch.Tensor, layout: MaskedLayout, topk_weights: torch.Tensor,
                   num_tokens: int) -> torch.Tensor:
    """``D  # [E, max_m, H]`` -> ``# [N, H] float32`` weighted sums (rows beyond
    ``masked_m`` are never read)."""
    w = topk_weights[layout.pair_token, layout.pair_choice].float().unsqueeze(1)  # [P, 1]
    out = torch.zeros(num_tokens, d.shape[2], dtype=torch.float32, device=d.device)
    out.index_add_(0, layout.pair_token, d[layout.pair_expert, layout.pair_slot].float() * w)
    return out


def masked_row_mask(layout: MaskedLayout) -> torch.Tensor:
    """``# [E, max_m, 1] bool``: the rows below each expert's ``masked_m``."""
    rows = torch.arange(layout.max_m, device=layout.masked_m.device)
    return (rows.unsqueeze(0) < layout.masked_m.unsqueeze(1)).unsqueeze(2)


# -------------------------------------------------------------------------- FP8 formats
def _scale_of(amax: torch.Tensor, round_scale_pow2: bool) -> torch.Tensor:
    scale = amax.float().clamp(min=1e-4) / FP8_MAX
    if round_scale_pow2:  # UE8M0: the next power of two, so the scaled values still fit
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def quantize_per_token_group(x: torch.Tensor, round_scale_pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x  # [..., K]`` -> ``(q  # [..., K] float8_e4m3fn, scale  # [..., ceil(K/128)] float32)``:
    one scale per row and 128 consecutive K elements (a short last group is zero-padded)."""
    k = x.shape[-1]
    groups = ceil_div(k, BLOCK)
    xp = torch.nn.functional.pad(x.float(), (0, groups * BLOCK - k))
    xg = xp.unflatten(-1, (groups, BLOCK))  # [..., G, 128]
    scale = _scale_of(xg.abs().amax(dim=-1), round_scale_pow2)  # [..., G]
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :k].contiguous(), scale.contiguous()


def quantize_per_block(w: torch.Tensor, round_scale_pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``w  # [E, N, K]`` -> ``(q  # [E, N, K] float8_e4m3fn, scale  # [E, ceil(N/128), ceil(K/128)])``:
    one scale per 128x128 block."""
    e, n, k = w.shape
    bn, bk = ceil_div(n, BLOCK), ceil_div(k, BLOCK)
    wp = torch.nn.functional.pad(w.float(), (0, bk * BLOCK - k, 0, bn * BLOCK - n))
    blocks = wp.view(e, bn, BLOCK, bk, BLOCK)
    scale = _scale_of(blocks.abs().amax(dim=(2, 4)), round_scale_pow2)  # [E, bn, bk]
    q = (blocks / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(e, bn * BLOCK, bk * BLOCK)[:, :n, :k].contiguous(), scale.contiguous()


def dequantize_per_token_group(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`quantize_per_token_group`, in float32."""
    k = q.shape[-1]
    return q.float() * scale.repeat_interleave(BLOCK, dim=-1)[..., :k]


def dequantize_per_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`quantize_per_block`, in float32."""
    n, k = q.shape[-2:]
    full = scale.repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)[..., :k]
    return q.float() * full

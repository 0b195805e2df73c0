"""Cascade decode attention for requests that share a cached prefix.

Requests served from one radix-cache prefix read the same KV slots for that prefix. Plain
decode gathers the prefix once per request; here the prefix is gathered once per group and
every query of the group attends to it in one matmul, the requests' own suffixes are
attended separately, and the two partial softmaxes are merged through their log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_SHARED_TOKENS = 64  # shorter shared prefixes are cheaper through the plain path


@dataclass
class PrefixGroup:
    rows: torch.Tensor  # [g] batch rows of the group
    shared: torch.Tensor  # [S] slots of the common prefix
    suffix: torch.Tensor  # [g, Ls] slots after it, padded with slot 0
    suffix_mask: torch.Tensor | None  # [g, 1, 1, Ls] True for real tokens; None if no padding


def find_groups(kv_indices: torch.Tensor, seq_lens: list[int],
                min_shared: int | None = None) -> tuple[list[PrefixGroup], list[int]]:
    """Split the decode batch into groups sharing >= ``min_shared`` leading slots, and the
    remaining rows. ``kv_indices  # [B, Lmax]`` padded past each row's ``seq_lens``."""
    min_shared = MIN_SHARED_TOKENS if min_shared is None else min_shared
    by_first: dict[int, list[int]] = {}
    for row, first in enumerate(kv_indices[:, 0].tolist()):
        by_first.setdefault(first, []).append(row)
    groups, rest = [], []
    for rows in by_first.values():
        shortest = min(seq_lens[r] for r in rows)
        if len(rows) < 2 or shortest <= min_shared:
            rest.extend(rows)
            continue
        block = kv_indices[rows, :shortest]  # [g, Lmin]
        same = (block == block[:1]).all(0).int().cumprod(0)  # 1 while every row agrees
        shared = int(same.sum())
        if shared < min_shared:
            rest.extend(rows)
            continue
        lens = [seq_lens[r] - shared for r in rows]
        width = max(lens)
        suffix = kv_indices[rows, shared:shared + width]
        mask = None
        if min(lens) != width:
            lens_t = torch.tensor(lens, device=suffix.device)
            valid = torch.arange(width, device=suffix.device)[None, :] < lens_t[:, None]
            suffix = suffix.masked_fill(~valid, 0)
            mask = valid[:, None, None, :]
        groups.append(PrefixGroup(torch.tensor(rows, device=kv_indices.device), block[0, :shared], suffix, mask))
    return groups, sorted(rest)


def _partial(scores: torch.Tensor, values: torch.Tensor):
    """Unnormalised attention of ``scores  # [..., L]`` over ``values  # [..., L, D]``:
    (weighted sum, row max, row sum of exp)."""
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - m)
    return torch.matmul(p, values), m, p.sum(-1, keepdim=True)


def group_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, group: PrefixGroup,
                    scaling: float, gather) -> torch.Tensor:
    """Decode attention of ``q  # [g, Hkv, G, D]`` over the group's shared prefix plus each
    request's suffix; returns ``# [g, Hkv, G, D]``."""
    g, hkv, grp, dim = q.shape
    ks = gather(k_buf, group.shared).permute(1, 2, 0)  # [Hkv, D, S]
    vs = gather(v_buf, group.shared).transpose(0, 1)  # [Hkv, S, D]
    qh = q.transpose(0, 1).reshape(hkv, g * grp, dim)  # [Hkv, g*G, D]
    o1, m1, l1 = _partial(torch.matmul(qh, ks) * scaling, vs)  # [Hkv, g*G, D|1]
    o1, m1, l1 = (t.view(hkv, g, grp, -1).transpose(0, 1) for t in (o1, m1, l1))  # [g, Hkv, G, D|1]
    kx = gather(k_buf, group.suffix).permute(0, 2, 3, 1)  # [g, Hkv, D, Ls]
    vx = gather(v_buf, group.suffix).transpose(1, 2)  # [g, Hkv, Ls, D]
    s2 = torch.matmul(q, kx) * scaling  # [g, Hkv, G, Ls]
    if group.suffix_mask is not None:
        s2 = s2.masked_fill(~group.suffix_mask, float("-inf"))
    o2, m2, l2 = _partial(s2, vx)
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)

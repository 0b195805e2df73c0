"""Rotary position embedding (half-split layout) with Llama-3, linear and YaRN scaling.

:class:`RotaryEmbedding` holds the cos/sin tables and, once a step, looks up that step's
rows for every layer (natively) or hands the positions on (the CPU kernel reads the tables
itself); :class:`QKVRotary` splits a fused QKV projection into heads and rotates q and k,
natively or in place on the QKV output with the CPU kernels (Qwen3's per-head q/k norms too)."""

from __future__ import annotations

import math
from typing import Any

import torch

from radixserve.layers.custom_op import CustomOp


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term ``0.1 * mscale * ln(factor) + 1`` (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(head_dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN (NTK-by-parts): frequencies that turn fewer than ``beta_slow`` times over the original
    context are interpolated by ``factor``, those turning more than ``beta_fast`` times kept, a
    linear ramp between."""
    factor, old_ctx = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: interpolated
    inv = _inv_freq(head_dim, theta)
    return inv / factor * (1 - keep) + inv * keep


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = _inv_freq(head_dim, theta)
    kind = rope_kind(scaling)
    if kind == "default":
        return inv
    if kind == "llama3":
        return _llama3_inv_freq(inv, scaling)
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3, yarn")


def rope_kind(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What the cos/sin tables are multiplied by: YaRN's ``attention_factor`` (given, or from
    ``factor`` and the optional ``mscale``/``mscale_all_dim``); 1 otherwise."""
    if rope_kind(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


class RotaryEmbedding(CustomOp):
    """cos/sin tables for RoPE; a call gives one step's handle, shared by every layer:
    ``(cos, sin)`` rows ``# [T, 1, D/2]`` natively, the positions with the CPU kernel.
    ``kernel=False`` keeps the native path."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None, dtype: torch.dtype, kernel: bool = True) -> None:
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(t, inv)  # [P, D/2]
        factor = rope_attention_factor(scaling)
        self.register_buffer("cos", (freqs.cos() * factor).to(dtype), persistent=False)
        self.register_buffer("sin", (freqs.sin() * factor).to(dtype), persistent=False)
        self.kernel = kernel

    def kernel_applies(self) -> bool:
        return self.kernel

    def forward_native(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D/2] each

    def forward_cpu(self, positions: torch.Tensor) -> torch.Tensor:
        return positions


class QKVRotary(CustomOp):
    """A fused ``[T, (H + 2 Hkv) D]`` QKV output -> ``q # [T, H, D]``, ``k``, ``v # [T, Hkv, D]``,
    q and k normed (``q_norm``/``k_norm``, Qwen3) and rotated with the step's handle from
    :class:`RotaryEmbedding` (``tables``, set when the model is placed)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, q_norm=None, k_norm=None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.q_norm, self.k_norm = q_norm, k_norm
        self.tables: RotaryEmbedding | None = None

    def kernel_applies(self) -> bool:
        return self.q_norm is None or (self.q_norm.weight.dtype == self.k_norm.weight.dtype == torch.float32
                                       and self.q_norm.weight.is_contiguous() and self.k_norm.weight.is_contiguous())

    def _split(self, qkv: torch.Tensor):
        t = qkv.shape[0]
        q, k, v = qkv.split(self.sizes, dim=-1)
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))

    def forward_native(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        q, k, v = self._split(qkv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, rope)
        return q, k, v

    def forward_cpu(self, qkv: torch.Tensor, positions: torch.Tensor):
        if self.q_norm is not None:  # per-head norms in place, then RoPE: the order of the native path
            h, d = self.num_heads, self.head_dim
            self.kernels.head_rmsnorm_(qkv, h, d, self.q_norm.weight, self.q_norm.eps)
            self.kernels.head_rmsnorm_(qkv[:, h * d:], self.num_kv_heads, d, self.k_norm.weight, self.k_norm.eps)
        self.kernels.rope_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, self.tables.cos,
                           self.tables.sin, positions)
        t, d = qkv.shape[0], self.head_dim  # the split inline: this runs once per layer and step
        q, k, v = qkv.split(self.sizes, dim=-1)
        return q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
    """RoPE on ``q  # [T, H, D]`` and ``k  # [T, Hkv, D]`` with one step's ``(cos, sin)``."""
    cos, sin = rope
    return rotate(q, cos, sin), rotate(k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

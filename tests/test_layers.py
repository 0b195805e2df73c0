"""Layers that choose their kernels once (radixserve.layers.custom_op): each one's CPU kernel
path against its native path, and which path placement picks."""

from __future__ import annotations

import pytest
import torch
from radixserve.kernels import cpu as cpu_kernels
from radixserve.layers.activation import SiluAndMul
from radixserve.layers.custom_op import place_ops
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.rotary import QKVRotary, RotaryEmbedding

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels.load()
    if k is None:
        pytest.skip(f"radixserve CPU kernels unavailable: {cpu_kernels.status()}")
    return k


def _pair(make, dtype=torch.float32):
    """The same op twice: one placed (the kernel path where it applies), one left native."""
    torch.manual_seed(0)
    placed, native = make(), make()
    native.load_state_dict(placed.state_dict())
    placed.place(CPU, dtype)
    return placed, native


def test_placement_picks_once(kernels):
    norm = RMSNorm(16, 1e-5)
    assert norm.forward == norm.forward_native  # not placed yet
    norm.place(CPU, torch.float32)
    assert norm.forward == norm.forward_cpu and norm.kernels is kernels
    norm.place(CPU, torch.bfloat16)
    assert norm.forward == norm.forward_native and norm.kernels is None
    per_head = RMSNorm(16, 1e-5, kernel=False)
    per_head.place(CPU, torch.float32)
    assert per_head.forward == per_head.forward_native
    with_norms = QKVRotary(2, 1, 8, RMSNorm(8, 1e-5, kernel=False), RMSNorm(8, 1e-5, kernel=False))
    place_ops(with_norms, CPU, torch.float32)
    assert with_norms.forward == with_norms.forward_cpu  # per-head norms, then RoPE, in place (Qwen3)


def test_qkv_rotary_with_norms_paths_agree(kernels):
    """Qwen3's per-head q/k norms and RoPE in place on the QKV output equal the native path."""
    from radixserve.layers.rotary import RotaryEmbedding

    placed, native = _pair(lambda: QKVRotary(2, 1, 8, RMSNorm(8, 1e-5, kernel=False), RMSNorm(8, 1e-5, kernel=False)))
    tables = RotaryEmbedding(8, 64, 10000.0, None, torch.float32)
    for m in (placed, native):
        m.tables = tables
        with torch.no_grad():
            m.q_norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
            m.k_norm.weight.copy_(torch.linspace(1.5, 0.5, 8))
    qkv, pos = torch.randn(3, 4 * 8), torch.tensor([0, 5, 17])
    got = placed.forward_cpu(qkv.clone(), pos)
    want = native.forward_native(qkv.clone(), tables.forward_native(pos))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_rmsnorm_paths_agree(kernels):
    placed, native = _pair(lambda: RMSNorm(64, 1e-5))
    with torch.no_grad():
        placed.weight.uniform_(0.5, 1.5)
        native.weight.copy_(placed.weight)
    x, res = torch.randn(5, 64), torch.randn(5, 64)
    torch.testing.assert_close(placed(x), native(x), rtol=1e-5, atol=1e-5)
    got, got_res = placed(x, res.clone())
    want, want_res = native(x, res.clone())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_res, want_res)


def test_silu_and_mul_paths_agree(kernels):
    placed, native = _pair(SiluAndMul)
    gate_up = torch.randn(7, 2 * 48)
    torch.testing.assert_close(placed(gate_up), native(gate_up), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3)])
def test_qkv_rotary_paths_agree(kernels, heads, kv_heads):
    d, t = 16, 6
    tables = RotaryEmbedding(d, 64, 10000.0, None, torch.float32)
    placed_tables, native_tables = _pair(lambda: RotaryEmbedding(d, 64, 10000.0, None, torch.float32))
    placed, native = QKVRotary(heads, kv_heads, d), QKVRotary(heads, kv_heads, d)
    placed.tables = native.tables = tables
    placed.place(CPU, torch.float32)
    assert placed.forward == placed.forward_cpu and native.forward == native.forward_native
    positions = torch.tensor([0, 3, 5, 9, 33, 63])
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    got = placed(qkv.clone(), placed_tables(positions))  # the kernel's handle is the positions
    want = native(qkv.clone(), native_tables(positions))  # the native one is the (cos, sin) rows
    assert torch.equal(placed_tables(positions), positions)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)

"""The backend's compiled paged-decode kernel (decode_attention.c) against SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from radixserve.kernels import cpu as cpu_kernels
from radixserve_attention_torch import kernel as decode_kernel


@pytest.fixture(scope="module")
def kernels():
    k = decode_kernel.load()
    if k is None:
        pytest.skip(f"CPU kernels unavailable (the core's: {cpu_kernels.status()})")
    return k


def test_the_kernel_builds_where_the_core_kernels_do():
    """A silent fallback would hide a broken build: where the core's kernels load, so does this."""
    if cpu_kernels.load() is None:
        pytest.skip(f"the core's kernels are unavailable: {cpu_kernels.status()}")
    assert decode_kernel.load() is not None


@pytest.mark.parametrize("h,hkv,d,lens", [
    (9, 3, 64, [1, 17, 64, 80]), (4, 4, 64, [1, 17, 64, 80]), (8, 1, 64, [1, 17, 64, 80]),
    (4, 2, 36, [1, 17, 64, 80]),
    (9, 3, 64, [700]),  # one request, few KV heads: its keys split across threads and merged
    (4, 2, 36, [300, 5]),  # several blocks of the online softmax, a head-size tail
    (8, 1, 128, [1000]),
])
def test_decode_attention_matches_sdpa(kernels, h, hkv, d, lens):
    slots, width = 1200, 1024
    g = torch.Generator().manual_seed(h * 10 + hkv + d)
    k_buf, v_buf = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    table = torch.zeros(6, width, dtype=torch.int64)
    rows = torch.tensor([4, 0, 2, 5][:len(lens)])
    for r, n in zip(rows.tolist(), lens):
        table[r, :n] = torch.randperm(slots - 1, generator=g)[:n] + 1
    loc = torch.stack([table[r, n - 1] for r, n in zip(rows.tolist(), lens)])
    b = len(lens)
    qkv = torch.randn(b, (h + 2 * hkv) * d, generator=g)  # q, v as row views of one tensor,
    q = qkv[:, :h * d].view(b, h, d)  # k a tensor of its own (as after a q/k norm)
    k = qkv[:, h * d:(h + hkv) * d].reshape(b, hkv, d).clone()
    v = qkv[:, (h + hkv) * d:].view(b, hkv, d)
    ref_k, ref_v = k_buf.clone(), v_buf.clone()
    ref_k[loc], ref_v[loc] = k, v
    assert kernels.rows_fit(q, k, v, k_buf, v_buf)
    out = kernels.decode_attention(q, k, v, k_buf, v_buf, loc, table, rows, torch.tensor(lens), 0.125)
    torch.testing.assert_close(k_buf, ref_k, rtol=0, atol=0)
    torch.testing.assert_close(v_buf, ref_v, rtol=0, atol=0)
    for i, (r, n) in enumerate(zip(rows.tolist(), lens)):
        keys, values = ref_k[table[r, :n]].transpose(0, 1), ref_v[table[r, :n]].transpose(0, 1)  # [Hkv, n, D]
        ref = F.scaled_dot_product_attention(q[i].view(hkv, h // hkv, d), keys, values, scale=0.125)
        torch.testing.assert_close(out[i], ref.reshape(h, d), rtol=1e-5, atol=1e-5)

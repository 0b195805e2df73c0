"""The GGUF-quantized kernels (radixserve.kernels.gguf) against gguf's own numpy dequantiser.

``linear`` must equal ``x @ dequantize(data).T (+ bias)`` computed in float64 within
RTOL relative to the magnitude scale ``|x| @ |w|.T + |bias|`` (the kernels' dequantised
weights are exact; only float32 accumulation differs); ``dequant_rows`` must equal
``dequantize`` bit for bit. gguf quantizes Q4_0..Q8_0 for us; for the K-quants, which it
cannot quantize, the blocks are random bytes with finite, sane float16 scale fields.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402
from radixserve.kernels import cpu as cpu_kernels  # noqa: E402
from radixserve.kernels import gguf as gguf_kernels  # noqa: E402
from radixserve.kernels.gguf import KERNEL_TYPES, GGUFMatrix, dequant_rows, pack_reference  # noqa: E402

T = gguf.GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
RTOL = 1e-5  # observed <= ~4e-7 at K <= 576; float32 sums of K products


@pytest.fixture(scope="module")
def kernels():
    """The kernels, run on one thread (a busy machine stalls every OpenMP region on a
    descheduled worker); test_linear_on_threads covers the parallel split."""
    k = cpu_kernels.load()
    if k is None:
        pytest.skip(f"radixserve CPU kernels unavailable: {cpu_kernels.status()}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield k
    torch.set_num_threads(threads)


def blocks(qtype, n: int, k: int, seed: int) -> np.ndarray:
    """Raw GGUF rows uint8 [N, row_bytes] of type qtype."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        bs, ts = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n, k // bs, ts), dtype=np.uint8)
        # d (and dmin) as finite positive float16s; Q6_K keeps d last, the others first
        for off in ((208,) if qtype == T.Q6_K else (0, 2)):
            raw[..., off:off + 2] = rng.uniform(1e-3, 3e-2, (n, k // bs, 1)).astype(np.float16).view(np.uint8)
        return raw.reshape(n, -1)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[:, :32] += 0.5  # some blocks off-centre, so Q4_1/Q5_1's minimum matters
    return quantize(w, qtype)


def test_kernel_types_are_the_eight():
    assert KERNEL_TYPES == frozenset(int(t) for t in TYPES)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(33, 256), (577, 512), (40, 576)])
def test_linear_matches_dequantized_reference(kernels, qtype, n, k):
    if qtype in K_QUANTS and k % 256:
        pytest.skip("K-quants need K % 256 == 0")
    raw = blocks(qtype, n, k, seed=n + k + int(qtype))
    w = torch.from_numpy(dequantize(raw, qtype).astype(np.float64))  # [N, K]
    mat = GGUFMatrix.prepare(kernels, int(qtype), torch.from_numpy(raw), k)
    assert (mat.n, mat.k, mat.qtype) == (n, k, int(qtype))
    assert mat.nbytes() > 0
    g = torch.Generator().manual_seed(k)
    # both bias cases for one row (in-register path) and 32 rows (panel path); alternating
    # elsewhere, to keep the test quick on a busy machine (each call is an OpenMP region).
    # Small batches go through the in-register tiles: with 8-float vectors up to 8 rows in
    # tiles of 4, 3, 2 and 1 rows (6 = 4 + 2, 7 = 4 + 3); with AVX-512 up to 16 rows in tiles
    # of up to 8 (12 = 8 + 4, 16 = 8 + 8). Beyond that, and for 12 and 16 rows on AVX2, the panels,
    # in round(M / 64) equal row blocks: 72 rows one block, 100 rows two of 50.
    cases = [(1, False), (1, True), (2, True), (3, False), (6, True), (7, True), (8, False), (12, True),
             (16, False), (32, False), (32, True), (72, False), (100, True)]
    for m, with_bias in cases:
        x = torch.randn(m, k, generator=g)
        for bias in [torch.randn(n, generator=g) if with_bias else None]:
            y = mat.linear(x, bias)
            assert y.shape == (m, n) and y.dtype == torch.float32
            ref = x.double() @ w.T
            scale = x.double().abs() @ w.abs().T
            if bias is not None:
                ref, scale = ref + bias.double(), scale + bias.double().abs()
            err = ((y.double() - ref).abs() / scale.clamp_min(1e-30)).max().item()
            assert err < RTOL, f"M={m} bias={bias is not None}: relative error {err:.2e}"


def c_pack(kernels, qtype, raw: np.ndarray, k: int) -> np.ndarray:
    """rs_gguf_pack's bytes, written over a buffer of junk (so unwritten padding shows)."""
    lib = gguf_kernels._bind(kernels)
    n, nr = raw.shape[0], kernels.panel_width
    fmt, gs = gguf_kernels._FORMAT[int(qtype)]
    out = np.full(-(-n // nr) * lib.rs_gguf_panel_bytes(fmt, gs, k), 0xAB, np.uint8)
    raw = np.ascontiguousarray(raw)
    assert lib.rs_gguf_pack(int(qtype), raw.ctypes.data, raw.shape[1], n, k, out.ctypes.data) == fmt
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_c_pack_matches_numpy_reference(kernels, qtype):
    """The C packer (used by prepare) and the numpy reference give the same bytes, padding
    rows of a partial last panel included."""
    nr = kernels.panel_width
    shapes = [(1, 256), (nr - 1, 512), (nr, 256), (2 * nr + 3, 768), (77, 1024)]
    if qtype not in K_QUANTS:
        shapes += [(5, 32), (nr + 1, 96)]
    for n, k in shapes:
        raw = blocks(qtype, n, k, seed=n * k + int(qtype))
        np.testing.assert_array_equal(c_pack(kernels, qtype, raw, k), pack_reference(int(qtype), raw, k, nr),
                                      err_msg=f"N={n} K={k}")
    mat = GGUFMatrix.prepare(kernels, int(qtype), torch.from_numpy(raw), k)
    np.testing.assert_array_equal(mat._packed.numpy(), pack_reference(int(qtype), raw, k, nr))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0], ids=lambda t: t.name)
def test_c_pack_on_threads(kernels, qtype):
    """A matrix large enough for several work items: split over threads, the same bytes."""
    n, k = 6000, 512
    raw = blocks(qtype, n, k, seed=3)
    torch.set_num_threads(3)
    try:
        got = c_pack(kernels, qtype, raw, k)
    finally:
        torch.set_num_threads(1)
    np.testing.assert_array_equal(got, pack_reference(int(qtype), raw, k, kernels.panel_width))


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_K, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_linear_on_threads(kernels, qtype):
    """Several threads split the panels (and row blocks) among them: same answer."""
    n, k = 1000, 512
    raw = blocks(qtype, n, k, seed=7)
    mat = GGUFMatrix.prepare(kernels, int(qtype), torch.from_numpy(raw), k)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(m, k, generator=g) for m in (1, 5, 70)]
    single = [mat.linear(x) for x in xs]
    torch.set_num_threads(3)
    try:
        for x, y in zip(xs, single):
            torch.testing.assert_close(mat.linear(x), y, rtol=0, atol=0)
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequant_rows_exact(kernels, qtype):
    n, k = 21, 512
    raw = blocks(qtype, n, k, seed=int(qtype))
    ref = dequantize(raw, qtype)
    ids = torch.tensor([0, 20, 7, 7, 3], dtype=torch.int64)
    out = dequant_rows(kernels, int(qtype), torch.from_numpy(raw), ids, k)
    assert out.dtype == torch.float32 and out.shape == (5, k)
    np.testing.assert_array_equal(out.numpy(), ref[ids.numpy()])
    assert dequant_rows(kernels, int(qtype), torch.from_numpy(raw), ids[:0], k).shape == (0, k)


def test_zero_rows_and_bad_input(kernels):
    raw = blocks(T.Q8_0, 5, 64, seed=1)
    mat = GGUFMatrix.prepare(kernels, int(T.Q8_0), torch.from_numpy(raw), 64)
    assert mat.linear(torch.randn(0, 64)).shape == (0, 5)
    with pytest.raises(ValueError):
        mat.linear(torch.randn(2, 32))
    with pytest.raises(ValueError):
        GGUFMatrix.prepare(kernels, int(T.Q8_0), torch.from_numpy(raw), 96)  # row size mismatch
    with pytest.raises(ValueError):
        GGUFMatrix.prepare(kernels, int(T.F16), torch.from_numpy(raw), 64)
    with pytest.raises(IndexError):
        dequant_rows(kernels, int(T.Q8_0), torch.from_numpy(raw), torch.tensor([5]), 64)

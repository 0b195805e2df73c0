"""Weight-only quantised CPU linears (radixserve.kernels.woq): the C kernels and the PyTorch
fallback against ``x @ dequantize().T`` in float64, and dequantize() against the original weight.

Tolerance of ``linear``: ``|y - y_ref| <= 3 * K * u * (|x| @ A.T) + 4 * u * (|x| @ A.T + |bias|)``
with ``u = 2**-24``: the worst-case bound of float32 summation over K terms (``K * u``) times a
small factor, plus the rounding of the bias add and of the result, where ``A = |W|``
(int8, bf16) or, for int4, the absolute maximum of W over each group (the kernel computes
``scale * dot(q, x) + min * sum(x)`` per group, whose rounding scales with ``|min|``, bounded by it).
A wrong element or a misplaced panel is off by about ``1 / K`` of that sum's scale or more, far above.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels.woq import (
    INT4_GROUP_SIZES,
    BF16Matrix,
    F16Matrix,
    Int4Matrix,
    Int8Matrix,
    cpu_has_native_bf16,
)

CLASSES = {"int8": Int8Matrix, "int4": Int4Matrix, "bf16": BF16Matrix, "f16": F16Matrix}
_PREPARED: dict = {}


def _kernels_or_skip():
    k = cpu_kernels.load()
    if k is None:
        pytest.skip(f"radixserve CPU kernels unavailable: {cpu_kernels.status()}")
    return k


@pytest.fixture(params=["c", "torch"])
def path_kernels(request):
    """The kernels (C path, on torch's threads) or None (the PyTorch fallback, run on one thread:
    its many small ops only wait on each other's threads when the machine is busy)."""
    if request.param == "c":
        yield _kernels_or_skip()
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield None
    finally:
        torch.set_num_threads(threads)


def _weight(n: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n * 7919 + k)
    return torch.randn(n, k, generator=g) / k**0.5


def _prepared(fmt: str, kernels, n: int, k: int, **opts):
    key = (fmt, kernels is not None, n, k, tuple(sorted(opts.items())))
    if key not in _PREPARED:
        _PREPARED[key] = CLASSES[fmt].prepare(kernels, _weight(n, k), **opts)
    return _PREPARED[key]


_REFERENCE: dict = {}


def _reference(mat) -> tuple[torch.Tensor, torch.Tensor]:
    """``dequantize()`` in float64 and ``A`` of the tolerance (see the module docstring), ``[N, K]`` each."""
    if id(mat) not in _REFERENCE:
        w = mat.dequantize().double()
        _REFERENCE[id(mat)] = (mat, w, _bound_weight(mat, w.abs()))
    return _REFERENCE[id(mat)][1:]


def _bound_weight(mat, w: torch.Tensor) -> torch.Tensor:
    if isinstance(mat, Int4Matrix):
        gs, k = mat.group_size, mat.k
        groups = -(-k // gs)
        wp = torch.nn.functional.pad(w, (0, groups * gs - k))
        w = wp.view(w.shape[0], groups, gs).amax(dim=2).repeat_interleave(gs, dim=1)[:, :k]
    return w


def _check_linear(mat, m: int, bias: bool, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed + m)
    x = torch.randn(m, mat.k, generator=g)
    b = torch.randn(mat.n, generator=g) if bias else None
    got = mat.linear(x, b)
    assert got.shape == (m, mat.n) and got.dtype == torch.float32
    w, a = _reference(mat)
    ref = x.double() @ w.T
    if b is not None:
        ref += b.double()
    scale = x.double().abs() @ a.T  # [M, N]
    tol = 3 * mat.k * 2.0**-24 * scale + 2.0**-22 * (scale + (0 if b is None else b.double().abs())) + 1e-30
    err = (got.double() - ref).abs()
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"{mat}: M={m} bias={bias}: error {worst:.3g} x tolerance"


@pytest.mark.parametrize("fmt", list(CLASSES))
@pytest.mark.parametrize("n", [33, 577])
@pytest.mark.parametrize("k", [256, 576, 1536])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_dequantized_reference(path_kernels, fmt, n, k, bias):
    mat = _prepared(fmt, path_kernels, n, k)
    assert (mat.n, mat.k) == (n, k)
    for m in (1, 2, 3, 4, 5, 32, 100):
        _check_linear(mat, m, bias, seed=n + k)


@pytest.mark.parametrize("group_size", INT4_GROUP_SIZES)
def test_int4_group_sizes(path_kernels, group_size):
    mat = _prepared("int4", path_kernels, 33, 576, group_size=group_size)  # 576 % 128 != 0: short last group
    for m in (1, 2, 7):
        _check_linear(mat, m, bias=True)
    _check_int4_error(mat, _weight(33, 576))


def test_int4_rejects_other_group_sizes():
    with pytest.raises(ValueError):
        Int4Matrix.prepare(None, torch.zeros(4, 64), group_size=48)


def test_int8_quantization_error():
    w = _weight(577, 576)
    mat = Int8Matrix.prepare(None, w)
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    err = (mat.dequantize() - w).abs()
    assert (err <= scale / 2 * (1 + 1e-5) + 1e-7 * w.abs()).all()
    assert torch.equal(mat.scales[: mat.n], scale[:, 0])


def _check_int4_error(mat, w):
    q, scale, mn = mat.unpacked()
    assert int(q.max()) <= 15
    idx = torch.arange(mat.k) // mat.group_size
    s = scale[:, idx]
    err = (mat.dequantize() - w).abs()
    assert (err <= s / 2 * (1 + 1e-5) + 1e-6 * w.abs()).all()
    # mins are the group minima (of the real columns, also in a short last group)
    for gi in range(scale.shape[1]):
        cols = w[:, gi * mat.group_size:(gi + 1) * mat.group_size]
        assert torch.equal(mn[:, gi], cols.amin(dim=1))


def test_int4_quantization_error():
    w = _weight(577, 1536)
    _check_int4_error(Int4Matrix.prepare(None, w), w)


def test_bf16_rounds_to_nearest_even():
    w = _weight(33, 256)
    w[0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20])  # ties and a near-tie
    mat = BF16Matrix.prepare(None, w)
    d = mat.dequantize()
    assert d[0, :4].tolist() == [1.0, 1 + 4 * 2**-8, -1.0, 1 + 2 * 2**-8]
    assert torch.equal(d, w.to(torch.bfloat16).float())
    assert ((d - w).abs() <= w.abs() * 2**-8).all()


def test_f16_widens_every_float16_exactly(path_kernels):
    """A float16 weight is kept as it is and widened exactly (subnormals, signed zeros, the
    largest finite values): one-hot activations read each weight back through the product."""
    special = torch.tensor([2.0**-24, -(2.0**-24), 2.0**-14 - 2.0**-24, 0.0, -0.0, 65504.0, -65504.0, 1 / 3],
                           dtype=torch.float16)
    w = _weight(40, 64).to(torch.float16)
    w[7, :8] = special
    mat = F16Matrix.prepare(path_kernels, w)
    assert torch.equal(mat.dequantize(), w.float())
    for cols in ([0, 3, 7], list(range(8))):
        x = torch.zeros(len(cols), 64)
        x[torch.arange(len(cols)), torch.tensor(cols)] = 1.0
        assert torch.equal(mat.linear(x), w.float()[:, cols].T)


@pytest.mark.parametrize("fmt", list(CLASSES))
def test_c_and_fallback_store_the_same_values(fmt):
    kernels = _kernels_or_skip()
    assert torch.equal(_prepared(fmt, kernels, 577, 576).dequantize(), _prepared(fmt, None, 577, 576).dequantize())


@pytest.mark.parametrize("fmt", list(CLASSES))
def test_zero_rows_and_constant_groups(path_kernels, fmt):
    w = _weight(40, 256)
    w[3] = 0.0
    w[5] = 0.25  # constant row: int4 scale 0, exact
    mat = CLASSES[fmt].prepare(path_kernels, w)
    d = mat.dequantize()
    assert torch.equal(d[3], torch.zeros(256)) and torch.equal(d[5], torch.full((256,), 0.25))
    for m in (1, 2, 9):
        _check_linear(mat, m, bias=False)


def test_nbytes():
    n, k = 577, 576
    w = _weight(n, k)
    i8, i4, bf = Int8Matrix.prepare(None, w), Int4Matrix.prepare(None, w), BF16Matrix.prepare(None, w)
    rows = -(-n // i8.panel_width) * i8.panel_width  # panels are zero padded
    assert i8.nbytes() == rows * k + rows * 4
    assert i4.nbytes() == rows * k // 2 + 2 * rows * 5 * 4  # 5 groups of 128 (the last short), scale + min
    assert bf.nbytes() == rows * k * 2
    assert F16Matrix.prepare(None, w).nbytes() == rows * k * 2


def test_bad_inputs():
    mat = Int8Matrix.prepare(None, _weight(8, 16))
    with pytest.raises(ValueError):
        mat.linear(torch.zeros(2, 15))
    with pytest.raises(ValueError):
        mat.linear(torch.zeros(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError):
        mat.linear(torch.zeros(16, 2).t())
    with pytest.raises(ValueError):
        mat.linear(torch.zeros(2, 16), torch.zeros(7))


def test_cpu_has_native_bf16():
    ok, reason = cpu_has_native_bf16()
    assert isinstance(ok, bool) and isinstance(reason, str) and reason


def test_avx512_variant_compiles(tmp_path):
    """This machine may lack AVX-512; the source must still compile for it (VW = 16)."""
    cc = cpu_kernels._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    src = Path(cpu_kernels.__file__).parent / "woq_kernels.c"
    flags = ["-O1", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp", "-c"]
    probe = subprocess.run([cc, *flags, "-x", "c", "-", "-o", str(tmp_path / "probe.o")], input="int x;",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"{cc} does not take the AVX-512 flags: {probe.stderr.strip()[-200:]}")
    proc = subprocess.run([cc, *flags, "-Wall", "-Werror", f"-I{src.parent}", str(src), "-o", str(tmp_path / "w.o")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    if shutil.which("nm"):
        symbols = subprocess.run(["nm", str(tmp_path / "w.o")], capture_output=True, text=True).stdout
        assert "rs_woq_int4_linear" in symbols


@pytest.mark.parametrize("fmt", list(CLASSES))
@pytest.mark.parametrize("n,k", [(1, 1), (5, 3), (17, 37), (70, 130)])
def test_tiny_and_ragged_shapes(path_kernels, fmt, n, k):
    """K below a group, below the 4-way unroll, not a multiple of anything; N below a panel."""
    mat = CLASSES[fmt].prepare(path_kernels, _weight(n, k))
    assert mat.linear(torch.zeros(0, k)).shape == (0, n)
    for m in (1, 2, 5, 7, 65):
        _check_linear(mat, m, bias=True)

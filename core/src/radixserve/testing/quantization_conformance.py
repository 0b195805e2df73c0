"""Conformance suite for quantization methods (``--quantization``): ours or a third party's.

A method's test module runs the checks with its registered factory (the
:class:`~radixserve.quantization.QuantizationConfig` subclass) and a way to make checkpoint
weights; each check raises AssertionError saying what went wrong::

    from radixserve.testing import quantization_conformance as qc

    def test_conformance():
        qc.run_all(MyQuantization, rel_tol=0.02)                        # quantizes float checkpoints
        qc.run_all(MyGGUFQuantization, make_weight=qc.gguf_weight(Q8_0),  # reads GGUF blocks
                   checkpoint_format="gguf", rel_tol=1e-4)

``make_weight(rows, cols, generator) -> (checkpoint tensor, float32 reference)`` gives what the
loader would hand the layer (a float tensor, or a :class:`~radixserve.quantization.GGUFTensor`)
and the float weight it stands for (default: :func:`float_weight`, where the two are the
same tensor). ``rel_tol`` bounds ``|y - x @ ref.T|`` by ``rel_tol * (|x| @ |ref|.T)`` per
element (the error a quantized weight may add, relative to the product's own scale; a method
that keeps exact weights passes with 1e-4).

* :func:`check_linear`: a replicated layer, batch sizes 1, 2, 5, 33, with and without bias;
* :func:`check_fused_parts`: a column-parallel fused layer (q/k/v parts of different sizes)
  loaded part by part, in an order other than its layout;
* :func:`check_row_shard`: a row-parallel layer holding a column shard of the checkpoint
  weight (what a tensor-parallel rank loads);
* :func:`check_leading_dims`: ``[B, T, K]`` inputs;
* :func:`check_dtypes`: in a bfloat16 model (placed with ``.to(bfloat16)`` before processing)
  a bfloat16 input gives a bfloat16 output of the same values;
* :func:`check_weight_bytes`: ``weight_nbytes()`` is positive, and below ``max_bits`` bits
  per weight when the method declares a bound;
* :func:`check_exact_layers_stay_float`: a layer built with ``quantize=False`` gets the
  float method whatever the config says.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from radixserve.quantization import (
    GGUFTensor,
    QuantizationConfig,
    QuantizationContext,
    quantization_scope,
)

MakeWeight = Callable[[int, int, torch.Generator], tuple[object, torch.Tensor]]


def float_weight(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A float checkpoint weight with a few large outliers per row (as real weights have)."""
    w = torch.randn(rows, cols, generator=gen) * 0.05
    w[:, :: max(cols // 7, 1)] *= 8
    return w, w


def random_gguf_blocks(qtype: int, rows: int, cols: int, seed: int):
    """Raw GGUF rows ``uint8 [rows, row_bytes]`` of ``qtype``. Types the ``gguf`` package can
    quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are quantized from random weights (some blocks
    off-centre, so an offset matters); the K-quants (Q4_K, Q5_K, Q6_K), which it cannot
    write, are random bytes with finite, sane float16 scales (``d``, and ``dmin`` of
    Q4_K/Q5_K) in their places: every such byte pattern is a valid block."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quantize

    t = GGMLQuantizationType(qtype)
    rng = np.random.default_rng(seed)
    if t in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K):
        per, nbytes = GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
        for off in ((nbytes - 2,) if t == GGMLQuantizationType.Q6_K else (0, 2)):  # Q6_K keeps d last
            raw[..., off:off + 2] = rng.uniform(1e-3, 3e-2, (rows, cols // per, 1)).astype(np.float16).view(np.uint8)
        return raw.reshape(rows, -1)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[:, :32] += 0.5
    return np.ascontiguousarray(quantize(w, t))


def gguf_weight(qtype: int) -> MakeWeight:
    """Weights in GGUF blocks of ``qtype`` (:func:`random_gguf_blocks`); the reference is
    their dequantisation by the ``gguf`` package."""
    def make(rows: int, cols: int, gen: torch.Generator):
        seed = int(torch.randint(0, 2 ** 31, (1,), generator=gen))
        t = GGUFTensor(qtype, torch.from_numpy(random_gguf_blocks(qtype, rows, cols, seed)), cols)
        return t, t.dequantize()
    return make


def _config(factory, checkpoint_format: str) -> QuantizationConfig:
    return factory(QuantizationContext(device=torch.device("cpu"), dtype=torch.float32,
                                       checkpoint_format=checkpoint_format))


def _assert_close(y: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, bias, rel_tol: float, what: str) -> None:
    x64, r64 = x.double(), ref.double()
    want = x64 @ r64.T + (0 if bias is None else bias.double())
    scale = x64.abs() @ r64.abs().T + 1e-12
    err = ((y.double() - want).abs() / scale).max().item()
    assert y.shape == want.shape, f"{what}: output shape {tuple(y.shape)}, expected {tuple(want.shape)}"
    assert torch.isfinite(y).all(), f"{what}: non-finite output"
    assert err <= rel_tol, f"{what}: relative error {err:.3g} > {rel_tol:g}"


def check_linear(factory, make_weight: MakeWeight = float_weight, checkpoint_format: str = "hf",
                 rel_tol: float = 1e-4, k: int = 256, n: int = 96) -> None:
    gen = torch.Generator().manual_seed(0)
    for bias in (False, True):
        with torch.device("meta"), quantization_scope(_config(factory, checkpoint_format)):
            layer = Linear(k, n, bias=bias)
        layer = layer.to_empty(device="cpu")
        w, ref = make_weight(n, k, gen)
        layer.load("weight", w)
        b = torch.randn(n, generator=gen) if bias else None
        if bias:
            layer.load("bias", b)
        layer.pack()
        for m in (1, 2, 5, 33):
            x = torch.randn(m, k, generator=gen)
            _assert_close(layer(x), x, ref, b, rel_tol, f"Linear({k}, {n}, bias={bias}) at batch {m} [{layer.path}]")


def check_fused_parts(factory, make_weight: MakeWeight = float_weight, checkpoint_format: str = "hf",
                      rel_tol: float = 1e-4, k: int = 256) -> None:
    gen = torch.Generator().manual_seed(1)
    sizes = {"q_proj": 128, "k_proj": 32, "v_proj": 64}
    with torch.device("meta"), quantization_scope(_config(factory, checkpoint_format)):
        layer = ColumnParallelLinear(k, {p: (s, 0, s) for p, s in sizes.items()})
    layer = layer.to_empty(device="cpu")
    refs = {}
    for part in ("v_proj", "q_proj", "k_proj"):  # not in layout order
        w, refs[part] = make_weight(sizes[part], k, gen)
        layer.load("weight", w, part)
    layer.pack()
    ref = torch.cat([refs[p] for p in sizes])
    x = torch.randn(4, k, generator=gen)
    _assert_close(layer(x), x, ref, None, rel_tol, f"fused q/k/v layer [{layer.path}]")


def check_row_shard(factory, make_weight: MakeWeight = float_weight, checkpoint_format: str = "hf",
                    rel_tol: float = 1e-4, k: int = 512, n: int = 64) -> None:
    gen = torch.Generator().manual_seed(2)
    w, ref = make_weight(n, k, gen)
    start, size = 256, 256  # the second half of the input columns (block-aligned for every GGUF type)
    with torch.device("meta"), quantization_scope(_config(factory, checkpoint_format)):
        layer = RowParallelLinear(k, n, shard=(k, start, size))
    layer = layer.to_empty(device="cpu")
    layer.load("weight", w)
    layer.pack()
    x = torch.randn(3, size, generator=gen)
    _assert_close(layer(x), x, ref[:, start:start + size], None, rel_tol, f"row-parallel shard [{layer.path}]")


def _built(factory, make_weight, checkpoint_format, k=256, n=64, seed=3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"), quantization_scope(_config(factory, checkpoint_format)):
        layer = Linear(k, n)
    layer = layer.to_empty(device="cpu")
    w, ref = make_weight(n, k, gen)
    layer.load("weight", w)
    layer = layer.to(dtype)  # as the model runner places the model before processing
    layer.pack()
    return layer, ref, gen


def check_leading_dims(factory, make_weight: MakeWeight = float_weight, checkpoint_format: str = "hf",
                       rel_tol: float = 1e-4) -> None:
    layer, ref, gen = _built(factory, make_weight, checkpoint_format)
    x = torch.randn(2, 3, 256, generator=gen)
    y = layer(x)
    assert y.shape == (2, 3, 64), f"[B, T, K] input gave shape {tuple(y.shape)}"
    _assert_close(y.reshape(6, 64), x.reshape(6, 256), ref, None, rel_tol, "[B, T, K] input")


def check_dtypes(factory, make_weight: MakeWeight = float_weight, checkpoint_format: str = "hf",
                 rel_tol: float = 1e-4) -> None:
    layer, ref, gen = _built(factory, make_weight, checkpoint_format, dtype=torch.bfloat16)
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16, f"a bfloat16 input gave a {y.dtype} output"
    # bf16 output rounding (2^-8) on top of the method's own error
    _assert_close(y.float(), x.float(), ref, None, rel_tol + 2 ** -7, "bfloat16 input")


def check_weight_bytes(factory, make_weight: MakeWeight = float_weight, checkpoint_format: str = "hf",
                       max_bits: float | None = None) -> None:
    layer, _, _ = _built(factory, make_weight, checkpoint_format)
    nbytes = layer.weight_nbytes()
    assert nbytes > 0, "weight_nbytes() is not positive"
    if max_bits is not None:
        bits = nbytes * 8 / (256 * 64)
        assert bits <= max_bits, f"{bits:.2f} bits per weight resident, more than the declared {max_bits}"


def check_exact_layers_stay_float(factory, checkpoint_format: str = "hf") -> None:
    with torch.device("meta"), quantization_scope(_config(factory, checkpoint_format)):
        layer = Linear(64, 8, quantize=False)
    assert layer.method.name == "none", f"a quantize=False layer got method {layer.method.name!r}"


def run_all(factory, make_weight: MakeWeight = float_weight, checkpoint_format: str = "hf",
            rel_tol: float = 1e-4, max_bits: float | None = None) -> None:
    """Every check above (:func:`check_weight_bytes` with ``max_bits``)."""
    kw = dict(make_weight=make_weight, checkpoint_format=checkpoint_format)
    check_linear(factory, rel_tol=rel_tol, **kw)
    check_fused_parts(factory, rel_tol=rel_tol, **kw)
    check_row_shard(factory, rel_tol=rel_tol, **kw)
    check_leading_dims(factory, rel_tol=rel_tol, **kw)
    check_dtypes(factory, rel_tol=rel_tol, **kw)
    check_weight_bytes(factory, max_bits=max_bits, **kw)
    check_exact_layers_stay_float(factory, checkpoint_format)

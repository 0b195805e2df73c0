"""Fake ``flash_attn`` (FlashAttention-2) and ``flash_attn_interface`` (FlashAttention-3)
modules for CPU tests only.

Each fake function has the real library function's signature: parameter names, order and
defaults (not the annotations) copied from Dao-AILab/flash-attention at the tag or commit
named on its build class below (the signatures only; the bodies are ours). A call is bound to
that signature (a wrong name raises ``TypeError`` as the real function does) and recorded
(:class:`Call`: the raw arguments, and shape, dtype and strides of every tensor by parameter
name), then checked as the real kernels check their inputs (``csrc/flash_attn/flash_api.cpp``
for FA2, ``hopper/flash_api.cpp`` for FA3: fp16/bf16 only, contiguous last dimensions, int32
index tensors, the shapes, FA2's 256-token pages) and answered by ``fa_reference``'s torch
computation.

``install_fa2(monkeypatch)`` / ``install_fa3(monkeypatch)`` put a fake in ``sys.modules``, so
``import flash_attn`` / ``import flash_attn_interface`` give it, as they give the factories
and the probes their library on a GPU machine.

Builds (``build=``):

* :class:`FA2_v2_8_3`: what ``fa2`` targets (every tag from 2.5.7 on takes what it passes);
* :class:`FA2_v2_5_9`: ``block_table`` in ``flash_attn_varlen_func`` (since 2.5.7) but the log-sum-exp
  still ``[batch, heads, max_seqlen_q]``;
* :class:`FA2_v2_5_6`: no ``block_table`` in ``flash_attn_varlen_func``;
* :class:`FA3_main`: what ``fa3`` targets (every build since commit 203b9b3d, 2025-08-29);
* :class:`FA3_2025_08`: no ``return_attn_probs`` in ``flash_attn_varlen_func``;
* :class:`FA3_2025_01`: that, and ``flash_attn_varlen_func``'s positional parameters in another order;
* :class:`FA3_2024_11`: no ``page_table`` / ``cu_seqlens_q`` / ``max_seqlen_q`` in ``flash_attn_with_kvcache``.

Only the targeted builds compute; an old build's functions raise ``NotImplementedError`` when
called (the probes must refuse them before any call).
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from dataclasses import dataclass, field

import fa_reference
import torch

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    is_contiguous: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorInfo:
        return cls(tuple(t.shape), t.dtype, t.stride(), t.is_contiguous())

    @property
    def last_dim_contiguous(self) -> bool:
        return not self.stride or self.stride[-1] == 1


@dataclass
class Call:
    """One call of a fake function, as the backend made it."""

    function: str
    args: tuple
    kwargs: dict
    tensors: dict[str, TensorInfo] = field(default_factory=dict)  # by parameter name, at call time

    @classmethod
    def record(cls, function: str, signature: inspect.Signature, args: tuple, kwargs: dict) -> Call:
        """The call, bound to ``signature``: a ``TypeError`` where the real function raises one."""
        bound = signature.bind(*args, **kwargs)
        return cls(function, args, dict(kwargs), {n: TensorInfo.of(t) for n, t in bound.arguments.items()
                                                   if isinstance(t, torch.Tensor)})


# ------------------------------------------------------------------ the builds' signatures
class FA2_v2_8_3:  # noqa: N801
    """``flash_attn/flash_attn_interface.py`` at tag v2.8.3 (060c9188, 2025-08-14); main's 2.8.4
    (00756db9, 2026-07-24) has the same two signatures."""

    version = "2.8.3"

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None): ...

    @staticmethod
    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False): ...


class FA2_v2_5_9:  # noqa: N801
    """Tag v2.5.9.post1 (e2e4333c, 2024-05-26)."""

    version = "2.5.9.post1"

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None): ...

    @staticmethod
    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, block_table=None, softmax_scale=None,
                                causal=False, window_size=(-1, -1), rotary_interleaved=True, alibi_slopes=None,
                                num_splits=0): ...


class FA2_v2_5_6:  # noqa: N801
    """Tag v2.5.6 (6c9e60de, 2024-03-01); its ``flash_attn_with_kvcache`` is v2.5.9's."""

    version = "2.5.6"

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                               deterministic=False, return_attn_probs=False): ...

    flash_attn_with_kvcache = FA2_v2_5_9.flash_attn_with_kvcache


class FA3_main:  # noqa: N801
    """``hopper/flash_attn_interface.py`` at 0251105a (main, 2026-08-15), unchanged in these two
    signatures since 203b9b3d (2025-08-29)."""

    version = None  # the module has none; the flash_attn_3 distribution says 3.0.0b1 or 3.0.0

    @staticmethod
    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                                scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                                return_softmax_lse=False): ...

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                               k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                               num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                               return_attn_probs=False): ...


class FA3_2025_08:  # noqa: N801
    """At 199401d3 (2025-08-21), the last change before 203b9b3d; its ``flash_attn_with_kvcache``
    is main's."""

    version = "3.0.0b1"

    flash_attn_with_kvcache = FA3_main.flash_attn_with_kvcache

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                               k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                               num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0): ...


class FA3_2025_01:  # noqa: N801
    """At 7a802796 (2025-01-07): page_table and ragged queries in ``flash_attn_with_kvcache``,
    but ``flash_attn_varlen_func`` took ``seqused_q, seqused_k`` before ``max_seqlen_q`` (until
    a09abcd3, 2025-02-15) and no ``return_attn_probs``."""

    version = "3.0.0b1"

    @staticmethod
    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, q_descale=None,
                                k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                                window_size=(-1, -1), sink_token_length=0, softcap=0.0, rotary_interleaved=True,
                                num_splits=0, pack_gqa=None, sm_margin=0, return_softmax_lse=False): ...

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                               max_seqlen_k, softmax_scale=None, causal=False, q_descale=None, k_descale=None,
                               v_descale=None, window_size=(-1, -1), sink_token_length=0, softcap=0.0, num_splits=1,
                               pack_gqa=None, deterministic=False, sm_margin=0): ...


class FA3_2024_11:  # noqa: N801
    """At 284e2c6e (2024-11-12), the last change before 7a802796 (2025-01-07)."""

    version = "3.0.0b1"

    @staticmethod
    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, cache_batch_idx=None, softmax_scale=None,
                                causal=False, window_size=(-1, -1), num_splits=0, return_softmax_lse=False,
                                gqa_parallel=None, max_seqlen_k_hint=None, descale_q=None, descale_k=None,
                                descale_v=None): ...

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               causal=False, window_size=(-1, -1), deterministic=False, seqused_q=None,
                               seqused_k=None, block_table=None): ...


# ------------------------------------------------------------------ the kernels' input checks
def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)  # what a failed TORCH_CHECK raises


def _half(q, k, v) -> None:
    _require(q.dtype in HALF, f"FlashAttention only supports fp16 and bf16 data type, got {q.dtype}")
    _require(k.dtype == q.dtype and v.dtype == q.dtype, "query and key/value must have the same dtype")
    for t in (q, k, v):
        _require(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")


def _index(name: str, t, *, shape=None, contiguous: bool = True) -> None:
    """An index tensor: int32, contiguous (or, for page tables, a contiguous last dimension)."""
    if t is None:
        return
    _require(isinstance(t, torch.Tensor), f"{name} must be a tensor, got {type(t).__name__}")
    _require(t.dtype == torch.int32, f"{name} must have dtype torch.int32, got {t.dtype}")
    _require(t.is_contiguous() if contiguous else t.stride(-1) == 1,
             f"{name} must be contiguous" if contiguous else f"{name} must have contiguous last dimension")
    if shape is not None:
        _require(tuple(t.shape) == tuple(shape), f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _heads(head_dim: int, heads: int, kv_heads: int) -> None:
    _require(head_dim <= 256, "FlashAttention forward only supports head dimension at most 256")
    _require(head_dim % 8 == 0, "head_size should be a multiple of 8")
    _require(heads % kv_heads == 0, "Number of heads in key/value must divide number of heads in query")


def _ints(a: dict, *names: str) -> None:
    for n in names:
        _require(type(a[n]) is int, f"{n} must be a Python int, got {type(a[n]).__name__}")


def _paged(k, table, batch: int, table_name: str, page_multiple: int) -> None:
    _require(k.dim() == 4, f"a paged k_cache is [num_pages, page_size, Hkv, D], got {tuple(k.shape)}")
    _require(k.shape[1] % page_multiple == 0,
             f"Paged KV cache block size must be divisible by {page_multiple}")
    _index(table_name, table, contiguous=False)
    _require(table.dim() == 2 and table.shape[0] == batch,
             f"{table_name} must be [batch={batch}, max_pages], got {tuple(table.shape)}")


def check_fa2_varlen(a: dict) -> None:
    """``mha_varlen_fwd`` of v2.8.3's ``csrc/flash_attn/flash_api.cpp``."""
    q, k, v, table = a["q"], a["k"], a["v"], a["block_table"]
    _half(q, k, v)
    batch = a["cu_seqlens_q"].numel() - 1
    _index("cu_seqlens_q", a["cu_seqlens_q"], shape=(batch + 1,))
    _index("cu_seqlens_k", a["cu_seqlens_k"], shape=(batch + 1,))
    _ints(a, "max_seqlen_q", "max_seqlen_k")
    _require(q.dim() == 3, f"q must be [total_q, H, D], got {tuple(q.shape)}")
    if table is not None:
        _paged(k, table, batch, "block_table", 256)
    else:
        _require(k.dim() == 3 and v.shape == k.shape, f"k, v must be [total_k, Hkv, D], got {tuple(k.shape)}")
    _heads(q.shape[-1], q.shape[1], k.shape[-2])


def check_fa2_kvcache(a: dict) -> None:
    """``flash_attn_with_kvcache`` and ``mha_fwd_kvcache`` of v2.8.3."""
    q, k, v, table = a["q"], a["k_cache"], a["v_cache"], a["block_table"]
    _half(q, k, v)
    _require(q.dim() == 4, f"q must be [batch, seqlen_q, H, D], got {tuple(q.shape)}")
    if table is not None:
        _paged(k, table, q.shape[0], "block_table", 256)
    _index("seqlens_k", a["cache_seqlens"], shape=(q.shape[0],))
    _heads(q.shape[-1], q.shape[2], k.shape[-2])


def check_fa3_kvcache(a: dict) -> None:
    """``flash_attn_with_kvcache`` and ``mha_fwd`` of main's ``hopper/``."""
    q, k, v, table, cu_q = a["q"], a["k_cache"], a["v_cache"], a["page_table"], a["cu_seqlens_q"]
    _half(q, k, v)
    if cu_q is not None:
        _require(a["max_seqlen_q"] is not None, "max_seqlen_q must be provided if cu_seqlens_q is provided")
        _ints(a, "max_seqlen_q")
        batch = cu_q.numel() - 1
        _index("cu_seqlens_q", cu_q, shape=(batch + 1,))
        _require(q.dim() == 3, f"q must be [total_q, H, D] with cu_seqlens_q, got {tuple(q.shape)}")
    else:
        batch = q.shape[0]
        _require(q.dim() == 4, f"q must be [batch, seqlen_q, H, D], got {tuple(q.shape)}")
    if table is not None:
        _paged(k, table, batch, "page_table", 1)
    _index("seqused_k", a["cache_seqlens"], shape=(batch,))
    _heads(q.shape[-1], q.shape[-2], k.shape[-2])


def check_fa3_varlen(a: dict) -> None:
    """``mha_fwd`` of main's ``hopper/`` with ``cu_seqlens_q`` and ``cu_seqlens_k``."""
    q, k, v = a["q"], a["k"], a["v"]
    _half(q, k, v)
    batch = a["cu_seqlens_q"].numel() - 1
    _index("cu_seqlens_q", a["cu_seqlens_q"], shape=(batch + 1,))
    _index("cu_seqlens_k", a["cu_seqlens_k"], shape=(batch + 1,))
    _ints(a, "max_seqlen_q", "max_seqlen_k")
    _require(q.dim() == 3 and k.dim() == 3, "q, k must be [total, heads, D] with cu_seqlens")
    _heads(q.shape[-1], q.shape[1], k.shape[1])


# ------------------------------------------------------------------ the modules
COMPUTE = {
    (FA2_v2_8_3, "flash_attn_varlen_func"): (check_fa2_varlen, fa_reference.fa2_flash_attn_varlen_func),
    (FA2_v2_8_3, "flash_attn_with_kvcache"): (check_fa2_kvcache, fa_reference.fa2_flash_attn_with_kvcache),
    (FA3_main, "flash_attn_with_kvcache"): (check_fa3_kvcache, fa_reference.fa3_flash_attn_with_kvcache),
    (FA3_main, "flash_attn_varlen_func"): (check_fa3_varlen, fa_reference.fa3_flash_attn_varlen_func),
}


def _old_build(**_):
    raise NotImplementedError("only this old build's signature is modelled: the probe must refuse it")


def _recording(module: types.ModuleType, build: type, name: str):
    stub = getattr(build, name)
    sig = inspect.signature(stub)
    check, compute = COMPUTE.get((build, name), (None, _old_build))

    @functools.wraps(stub)  # inspect.signature of the fake is the real function's
    def fake(*args, **kwargs):
        module.calls.append(Call.record(name, sig, args, kwargs))  # TypeError as the real one
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        if check is not None:
            check(bound.arguments)
        return compute(**bound.arguments)

    return fake


def make_module(name: str, build: type, version: str | None) -> types.ModuleType:
    """A module ``name`` with ``build``'s two functions (recording into ``module.calls``) and,
    unless ``version`` is None, ``__version__``."""
    module = types.ModuleType(name)
    module.calls = []
    module.build = build
    if version is not None:
        module.__version__ = version
    for fn in ("flash_attn_varlen_func", "flash_attn_with_kvcache"):
        setattr(module, fn, _recording(module, build, fn))
    return module


OWN_VERSION = object()  # install_fa2: the build's own __version__


def install_fa2(monkeypatch, build: type = FA2_v2_8_3, version=OWN_VERSION) -> types.ModuleType:
    """``import flash_attn`` gives a fake of ``build`` (``version``: its ``__version__``, by
    default the build's own; None: no attribute)."""
    module = make_module("flash_attn", build, build.version if version is OWN_VERSION else version)
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return module


def install_fa3(monkeypatch, build: type = FA3_main, version: str | None = None) -> types.ModuleType:
    """``import flash_attn_interface`` gives a fake of ``build`` (no ``__version__`` unless
    given, like the real module)."""
    module = make_module("flash_attn_interface", build, version)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", module)
    return module


def real_signature(module: types.ModuleType, function: str) -> inspect.Signature:
    """The signature a recorded call must bind to: the build's, not the fake's wrapper."""
    return inspect.signature(getattr(module.build, function))

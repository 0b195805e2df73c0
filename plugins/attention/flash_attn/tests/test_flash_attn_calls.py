"""The backend's calls into flash-attn, on CPU, through fake library modules that have the real
functions' signatures (``fake_flash.py``): for extend, decode, mixed and target-verify steps
of fa3 (paged), fa2 (paged at 256-token pages, gathered K/V below) and the gather path of a
narrow (fp8) pool, each step calls the function it should, and every call binds to the real
signature with the expected positional order and keyword names, passes int32 index tensors,
bfloat16 activations with contiguous last dimensions, the page table / lengths / cumulative
lengths of a plain reference built here, and the step's output matches the torch reference.

What this does not test: the kernels themselves (``test_flash_attn_gpu.py``, on a GPU).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math

import fa_reference
import pytest
import radixserve_attention_flash_attn as plugin
import torch
from fake_flash import Call, FA2_v2_8_3, FA3_main, install_fa2, install_fa3, real_signature
from radixserve.layers.attention import AttentionContext
from radixserve.mem.kv_pool import to_storage
from radixserve.testing.attention_conformance import Case, build_case, reference
from radixserve_attention_flash_attn.backend import FlashAttention

BF16 = torch.bfloat16
TOL = 2e-2  # bfloat16 output against a float32 reference over the same inputs
VARLEN = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
KVCACHE = ("q", "k_cache", "v_cache")
INDEX = {"cache_seqlens", "page_table", "block_table", "cu_seqlens_q", "cu_seqlens_k"}
ACTIVATIONS = {"q", "k", "v", "k_cache", "v_cache"}


@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    version: int
    page_size: int
    kv_dtype: torch.dtype | None = None

    @property
    def paged(self) -> bool:
        return self.kv_dtype is None and (self.version == 3 or self.page_size % 256 == 0)

    def __str__(self) -> str:
        return self.name


SETUPS = [Setup("fa3-paged-p16", 3, 16), Setup("fa3-paged-p1", 3, 1), Setup("fa2-paged-p256", 2, 256),
          Setup("fa2-gather-p16", 2, 16), Setup("fa3-gather-fp8", 3, 16, torch.float8_e4m3fn)]
CHAIN, TREE, ROOT = (-1, 0, 1, 2, 3), (-1, 0, 0, 1, 1, 2, 4, 6), (-1,)
MODES = ["extend", "extend-window", "decode", "decode-window", "mixed", "verify", "verify-window"]


def case_of(setup: Setup, mode: str) -> Case:
    """Prefixes that span several pages (of 256 tokens too) and end mid-page."""
    big = 300 if setup.page_size >= 256 else 40
    kw = dict(dtype=BF16, kv_dtype=setup.kv_dtype)
    page = setup.page_size
    return {
        "extend": Case("extend", page, 8, 2, 64, (big, 0, 7), (9, 17, 1), **kw),
        "extend-window": Case("extend", page, 8, 2, 64, (big, 3), (12, 5), sliding_window=8, **kw),
        "decode": Case("decode", page, 8, 2, 64, (0, big, 2 * big + 5), (1, 1, 1), **kw),
        "decode-window": Case("decode", page, 8, 2, 64, (big, 3), (1, 1), sliding_window=8, **kw),
        "mixed": Case("mixed", page, 8, 2, 64, (0, 20, big), (9, 1, 1), **kw),
        "verify": Case("verify", page, 8, 2, 64, (13, big, 0), (5, 8, 1), trees=(CHAIN, TREE, ROOT), **kw),
        "verify-window": Case("verify", page, 8, 2, 64, (big, 3), (8, 5), sliding_window=4, trees=(TREE, CHAIN),
                              **kw),
    }[mode]


def run_step(monkeypatch, setup: Setup, case: Case):
    """One layer of one step through the fake library; the output checked against the torch
    reference. Returns the built case, the fake module and its recorded calls."""
    lib = install_fa3(monkeypatch) if setup.version == 3 else install_fa2(monkeypatch)
    built = build_case(case)
    # the module as the factory imports it (the factory itself refuses a CPU context)
    module = importlib.import_module("flash_attn_interface" if setup.version == 3 else "flash_attn")
    backend = FlashAttention(built.ctx, version=setup.version, lib=module)
    assert backend.paged == setup.paged
    backend.init_forward_metadata(built.batch)
    out = backend.forward(built.q, built.k_new, built.v_new, built.layer, built.batch)
    assert out.dtype == BF16 and out.shape == built.q.shape

    def stored(x):  # K/V as the pool holds them
        return to_storage(x, case.pool_dtype).to(BF16) if case.kv_dtype else x

    trees = case.trees or (None,) * len(case.prefix_lens)
    ref = torch.cat([reference(qi, stored(ki), stored(vi), p, built.layer.scaling, case.sliding_window, t)
                     for qi, ki, vi, p, t in zip(built.q_list, built.all_k, built.all_v, case.prefix_lens, trees)])
    torch.testing.assert_close(out.float(), ref, atol=TOL, rtol=TOL)
    return built, lib, lib.calls


# ------------------------------------------------------------------ plain references
def cumsum0(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def int32(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


def pool_pages(buffer: torch.Tensor, page: int):
    """The kernel's paged K or V: layer 0's pool buffer itself, viewed as pages."""
    def check(t):
        assert t.data_ptr() == buffer.data_ptr(), "not a view of the pool"
        assert tuple(t.shape) == (buffer.shape[0] // page, page, *buffer.shape[1:]), tuple(t.shape)
        assert t.dtype == buffer.dtype and t.is_contiguous()
    return check


def page_table(batch, page: int, lens, width_len: int):
    """Request i's first ceil(lens[i] / page) pages, in order; any valid page after them."""
    num_pages = batch.kv_pool.k_buffers[0].shape[0] // page

    def check(t):
        assert t.dtype == torch.int32 and t.stride(-1) == 1
        assert tuple(t.shape) == (len(lens), math.ceil(width_len / page)), tuple(t.shape)
        for i, n in enumerate(lens):
            row = int(batch.req_pool_indices[i])
            want = [int(batch.req_to_token[row, j * page]) // page for j in range(math.ceil(n / page))]
            assert t[i, :len(want)].tolist() == want, (i, t[i].tolist(), want)
        assert bool(((t >= 0) & (t < num_pages)).all())
    return check


def gathered(buffer: torch.Tensor, batch, lens) -> torch.Tensor:
    """Each request's first lens[i] tokens' K (or V), request by request, widened to bfloat16."""
    slots = [int(batch.req_to_token[int(row), j]) for row, n in zip(batch.req_pool_indices, lens)
             for j in range(n)]
    return buffer[torch.tensor(slots, dtype=torch.int64)].to(BF16)


def expected_calls(setup: Setup, case: Case, built) -> list[tuple[str, tuple[str, ...], dict]]:
    """(function, positional names, every argument it must be passed) of each call of the step."""
    b, layer, page = built.batch, built.layer, setup.page_size
    k_buf, v_buf = b.kv_pool.k_buffers[0], b.kv_pool.v_buffers[0]
    seq, ext, pre = b.seq_lens_cpu, b.extend_lens_cpu, b.prefix_lens_cpu
    window = (-1, -1) if case.sliding_window is None else (case.sliding_window - 1, 0)
    common = dict(softmax_scale=layer.scaling, causal=True, window_size=window)
    verify = case.mode == "verify"
    if verify:
        if case.sliding_window is not None or max(pre) == 0:
            return []  # the prefix part runs in torch under a window
        lens, common = pre, dict(common, causal=False, window_size=(-1, -1))
    else:
        lens = seq
    if setup.paged:
        pages = dict(k_cache=pool_pages(k_buf, page), v_cache=pool_pages(v_buf, page))
        table = page_table(b, page, lens, max(seq))
        if case.mode == "decode":
            table_name = "page_table" if setup.version == 3 else "block_table"
            return [("flash_attn_with_kvcache", KVCACHE, dict(
                q=built.q.unsqueeze(1), **pages, cache_seqlens=int32(seq), **{table_name: table}, **common))]
        if setup.version == 3:
            return [("flash_attn_with_kvcache", KVCACHE, dict(
                q=built.q, **pages, cache_seqlens=int32(lens), page_table=table, cu_seqlens_q=cumsum0(ext),
                max_seqlen_q=max(ext), return_softmax_lse=verify, **common))]
        return [("flash_attn_varlen_func", VARLEN, dict(
            q=built.q, k=pages["k_cache"], v=pages["v_cache"], cu_seqlens_q=cumsum0(ext),
            cu_seqlens_k=cumsum0(lens), max_seqlen_q=max(ext), max_seqlen_k=max(lens),
            return_attn_probs=verify, block_table=table, **common))]
    decode = case.mode == "decode"
    return [("flash_attn_varlen_func", VARLEN, dict(
        q=built.q, k=gathered(k_buf, b, lens), v=gathered(v_buf, b, lens),
        cu_seqlens_q=int32(range(len(seq) + 1)) if decode else cumsum0(ext), cu_seqlens_k=cumsum0(lens),
        max_seqlen_q=1 if decode else max(ext), max_seqlen_k=max(lens), return_attn_probs=verify, **common))]


def check_call(module, call: Call, function: str, positional: tuple[str, ...], expect: dict) -> None:
    """``call`` binds to the real signature with ``positional`` by position and the rest by
    name, passes exactly ``expect``'s arguments with its values, and keeps the kernels' rules
    (int32 index tensors, bfloat16 activations, contiguous last dimensions, int lengths)."""
    assert call.function == function, f"called {call.function}, expected {function}"
    sig = real_signature(module, function)
    bound = sig.bind(*call.args, **call.kwargs)  # TypeError: a name or order the library does not take
    assert list(sig.parameters)[:len(call.args)] == list(positional), (
        f"{function}: passed {len(call.args)} arguments by position, expected ({', '.join(positional)})")
    assert set(bound.arguments) == set(expect), (
        f"{function}: passed {sorted(bound.arguments)}, expected {sorted(expect)}")
    for name, info in call.tensors.items():
        assert info.last_dim_contiguous, f"{name}: the kernels need a contiguous last dimension"
        if name in INDEX:
            assert info.dtype == torch.int32, f"{name} is {info.dtype}, the kernels need torch.int32"
        if name in ACTIVATIONS:
            assert info.dtype == BF16, f"{name} is {info.dtype}, expected the activations' bfloat16"
    for name in ("max_seqlen_q", "max_seqlen_k"):
        if name in bound.arguments:
            assert type(bound.arguments[name]) is int, f"{name} must be a Python int"
    for name, want in expect.items():
        got = bound.arguments[name]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, f"{name}: {got!r}"
            assert got.shape == want.shape and torch.equal(got, want), f"{name}: {got} != {want}"
        elif callable(want):
            want(got)
        else:
            assert got == want, f"{name}: {got!r} != {want!r}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setup", SETUPS, ids=str)
def test_step_calls_the_library_as_it_takes_them(monkeypatch, setup, mode):
    case = case_of(setup, mode)
    built, lib, calls = run_step(monkeypatch, setup, case)
    expected = expected_calls(setup, case, built)
    assert [c.function for c in calls] == [e[0] for e in expected]
    for call, (function, positional, expect) in zip(calls, expected):
        check_call(lib, call, function, positional, expect)


def test_the_checks_catch_a_renamed_reordered_or_retyped_argument(monkeypatch):
    """What the test above stands on: a call that differs from the right one by a name, the
    order of two positional arguments, the dtype of an index tensor or one more positional
    argument fails check_call, and the fakes refuse the first and third as the library does."""
    for setup, rename in ((SETUPS[0], ("page_table", "block_table")), (SETUPS[2], ("block_table", "page_table"))):
        case = case_of(setup, "extend")
        built, lib, calls = run_step(monkeypatch, setup, case)
        [(function, positional, expect)] = expected_calls(setup, case, built)
        good = calls[0]
        check_call(lib, good, function, positional, expect)
        sig = real_signature(lib, function)
        kwargs = dict(good.kwargs)
        kwargs[rename[1]] = kwargs.pop(rename[0])
        with pytest.raises(TypeError):
            check_call(lib, Call.record(function, sig, good.args, kwargs), function, positional, expect)
        with pytest.raises(TypeError):
            getattr(lib, function)(*good.args, **kwargs)
        # swapped positional arguments (fa2: cu_seqlens_q and cu_seqlens_k; fa3: k_cache and v_cache)
        args = list(good.args)
        i, j = (3, 4) if len(args) > 3 else (1, 2)
        args[i], args[j] = args[j], args[i]
        with pytest.raises(AssertionError):
            check_call(lib, Call.record(function, sig, tuple(args), good.kwargs), function, positional, expect)
        # an index tensor as int64
        name = "cache_seqlens" if setup.version == 3 else "cu_seqlens_k"
        bound = sig.bind(*good.args, **good.kwargs)
        bound.arguments[name] = bound.arguments[name].long()
        retyped = Call.record(function, sig, bound.args, bound.kwargs)
        with pytest.raises(AssertionError, match="int32"):
            check_call(lib, retyped, function, positional, expect)
        with pytest.raises(RuntimeError, match="int32"):
            getattr(lib, function)(*bound.args, **bound.kwargs)
        # softmax_scale by position: for fa2 it would bind to dropout_p
        kwargs = dict(good.kwargs)
        extra = sig.parameters[list(sig.parameters)[len(good.args)]].name
        moved = Call.record(function, sig, good.args + (kwargs.pop(extra, None),), kwargs)
        with pytest.raises(AssertionError):
            check_call(lib, moved, function, positional, expect)


def test_declared_calls_are_the_ones_made(monkeypatch):
    """probes.FA2_CALLS / FA3_CALLS (what the probes require of a library) list exactly the
    positional and keyword arguments the backend passes, over steps that use every one."""
    made: dict[int, dict[str, tuple[int, set]]] = {2: {}, 3: {}}
    steps = [(SETUPS[0], "extend"), (SETUPS[0], "decode"), (SETUPS[4], "verify"), (SETUPS[2], "verify"),
             (SETUPS[2], "decode")]
    for setup, mode in steps:
        _, _, calls = run_step(monkeypatch, setup, case_of(setup, mode))
        for call in calls:
            count, names = made[setup.version].setdefault(call.function, (len(call.args), set()))
            assert len(call.args) == count
            names.update(call.kwargs)
    for version, declared in ((2, plugin.FA2_CALLS), (3, plugin.FA3_CALLS)):
        assert made[version] == {fn: (len(pos), set(kw)) for fn, (pos, kw) in declared.items()}
        for fn, (pos, _) in declared.items():
            lib = FA2_v2_8_3 if version == 2 else FA3_main
            assert list(inspect.signature(getattr(lib, fn)).parameters)[:len(pos)] == list(pos)


def _params(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_torch_doubles_keep_the_real_signatures():
    """fa_reference (the doubles of test_flash_attn_backend.py) takes what the targeted
    builds take, in the same order with the same defaults."""
    for build, prefix in ((FA2_v2_8_3, "fa2_"), (FA3_main, "fa3_")):
        for fn in ("flash_attn_varlen_func", "flash_attn_with_kvcache"):
            assert _params(getattr(fa_reference, prefix + fn)) == _params(getattr(build, fn)), (build, fn)


def test_factories_build_on_the_installed_library(monkeypatch):
    """make_fa2 / make_fa3 hand the backend the module ``import flash_attn`` /
    ``import flash_attn_interface`` gives (here the fakes), with a CUDA bfloat16 context."""
    fa2, fa3 = install_fa2(monkeypatch), install_fa3(monkeypatch)
    ctx = AttentionContext(num_heads=8, num_kv_heads=2, head_dim=64, num_layers=1, dtype=BF16,
                           device=torch.device("cuda"), page_size=256, max_context_len=1024, max_batch_size=4,
                           kv_dtype=BF16)
    assert plugin.make_fa2(ctx).api.lib is fa2 and plugin.make_fa3(ctx).api.lib is fa3
    assert not fa2.calls and not fa3.calls

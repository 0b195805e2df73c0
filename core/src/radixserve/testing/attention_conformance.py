"""Conformance suite for attention backends: any backend, ours or a third party's, is run
on random paged inputs and compared with a dense reference written in plain torch.

Usage from a plugin's tests::

    from radixserve.testing.attention_conformance import CASES, run_case

    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_conforms(case):
        run_case(MyBackend, case)  # raises AssertionError with the max error on mismatch

    @pytest.mark.parametrize("case", KV_DTYPE_CASES, ids=str)
    def test_kv_dtypes(case):  # pools narrower than the activations (--kv-cache-dtype)
        run_case(MyBackend, case)

    @pytest.mark.parametrize("case", MLA_CASES, ids=str)
    def test_mla(case):  # only for a backend with supports_mla
        run_case(MyBackend, case)

A case with ``kv_dtype`` stores K/V in that dtype: the backend's output must match the
reference computed from the same K/V rounded to it (the usual tolerance) and stay within
``KV_DTYPE_ATOL[kv_dtype]`` of the reference over the unrounded K/V (what a float32 pool
gives); a backend that does not list the dtype in ``supported_kv_dtypes`` is refused.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

import torch

from radixserve.layers.attention import AttentionContext, AttentionLayer, ForwardBatch, ForwardMode
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool, to_storage
from radixserve.speculative.tree import ancestor_mask, depths


@dataclass(frozen=True)
class Case:
    mode: str  # "extend", "decode", "verify" (target verify over a draft tree) or "mixed"
    # (extends, then decode rows: the trailing requests with one new token after a prefix)
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    prefix_lens: tuple[int, ...]  # cached tokens per request before this step
    extend_lens: tuple[int, ...]  # new tokens per request (all 1 for decode)
    sliding_window: int | None = None
    dtype: torch.dtype = torch.float32
    # Requests whose prefix is at least this long share its first ``shared_prefix`` tokens:
    # same slots, same K/V, as requests served from one cached prefix do (page aligned).
    shared_prefix: int = 0
    # verify: per request, the parent of each new token (-1 for the root, node 0); the
    # extend length is the number of nodes
    trees: tuple[tuple[int, ...], ...] | None = None
    # the KV pool's storage dtype (--kv-cache-dtype); None: ``dtype``
    kv_dtype: torch.dtype | None = None

    # MLA: V is the first v_head_dim dims of K (one latent KV head; the pool stores K only) and
    # the output is v_head_dim wide; with mode "mla_prefill", the expanded form's prefill
    # (forward_mla_prefill: per-head K and V of their own, new tokens only, nothing stored)
    v_head_dim: int | None = None

    @property
    def v_in_k(self) -> bool:
        return self.v_head_dim is not None and self.mode != "mla_prefill"

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def pool_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    def __str__(self) -> str:
        w = f"-w{self.sliding_window}" if self.sliding_window else ""
        w += f"-kv_{str(self.kv_dtype).removeprefix('torch.')}" if self.kv_dtype else ""
        w += f"-shared{self.shared_prefix}" if self.shared_prefix else ""
        w += f"-mla_v{self.v_head_dim}" if self.v_head_dim else ""
        if self.trees is not None:
            w += "-tree" + "_".join("".join("r" if p < 0 else str(p) for p in t) for t in self.trees)
        return (f"{self.mode}-p{self.page_size}-h{self.num_heads}/{self.num_kv_heads}-d{self.head_dim}"
                f"-pre{'_'.join(map(str, self.prefix_lens))}-ext{'_'.join(map(str, self.extend_lens))}{w}")


def _cases() -> list[Case]:
    out = []
    for page in (1, 16):
        for heads, kv in ((4, 4), (6, 2), (8, 1)):
            for dim in (64, 128):
                out.append(Case("extend", page, heads, kv, dim, (0, 0), (5, 17)))
                out.append(Case("extend", page, heads, kv, dim, (7, 16, 0), (9, 1, 3)))  # mid-page prefix
                out.append(Case("decode", page, heads, kv, dim, (0, 15, 33), (1, 1, 1)))
    for page in (1, 16):  # decode (and extend) over a prefix shared by several requests
        out.append(Case("decode", page, 6, 2, 64, (96, 130, 100, 7), (1, 1, 1, 1), shared_prefix=96))
        out.append(Case("decode", page, 4, 4, 64, (160, 161), (1, 1), shared_prefix=160))
        out.append(Case("extend", page, 6, 2, 64, (96, 112), (5, 9), shared_prefix=96))
    out.append(Case("extend", 16, 4, 2, 64, (20, 0), (12, 30), sliding_window=8))
    out.append(Case("decode", 16, 4, 2, 64, (40, 3), (1, 1), sliding_window=8))
    # target verify: a chain, a tree with branches, a lone root (a request with no draft)
    chain, tree, root = (-1, 0, 1, 2, 3), (-1, 0, 0, 1, 1, 2, 4, 6), (-1,)
    for page in (1, 16):
        for heads, kv in ((4, 4), (6, 2)):
            out.append(Case("verify", page, heads, kv, 64, (13, 40, 5), (5, 8, 1), trees=(chain, tree, root)))
    out.append(Case("verify", 16, 8, 1, 128, (0, 17), (8, 5), trees=(tree, chain)))
    out.append(Case("verify", 16, 4, 2, 64, (20, 3), (8, 5), sliding_window=4, trees=(tree, chain)))
    out.append(Case("verify", 16, 6, 2, 64, (96, 130), (8, 5), shared_prefix=96, trees=(tree, chain)))
    # mixed (--enable-mixed-chunk): prefill chunks (fresh, over a prefix) then decode rows
    for page in (1, 16):
        out.append(Case("mixed", page, 6, 2, 64, (0, 20, 15, 33, 1), (9, 7, 1, 1, 1)))
        out.append(Case("mixed", page, 4, 4, 128, (0, 96, 130, 100), (12, 1, 1, 1), shared_prefix=96))
    out.append(Case("mixed", 16, 8, 1, 64, (5, 40), (30, 1)))  # one decode row
    out.append(Case("mixed", 16, 4, 2, 64, (0, 3), (1, 1)))  # a one-token prompt, then a decode row
    out.append(Case("mixed", 16, 4, 2, 64, (20, 40, 3), (12, 1, 1), sliding_window=8))
    return out


CASES: list[Case] = _cases()

# Max abs error allowed against the reference over *unrounded* K/V (a float32 pool), for
# q, k, v ~ N(0, 1): the rounding of K/V alone, measured with margin (bf16 keeps 8 mantissa
# bits, fp16 11, fp8 e4m3 4 and e5m2 3; scale 1.0).
KV_DTYPE_ATOL = {torch.bfloat16: 0.05, torch.float16: 0.01, torch.float8_e4m3fn: 0.4, torch.float8_e5m2: 0.8}


def _kv_dtype_cases() -> list[Case]:
    out = []
    tree, chain = (-1, 0, 0, 1, 1, 2, 4, 6), (-1, 0, 1, 2, 3)
    for kv in KV_DTYPE_ATOL:
        out.append(Case("extend", 16, 6, 2, 64, (7, 16, 0), (9, 1, 3), kv_dtype=kv))  # mid-page prefix
        out.append(Case("extend", 1, 4, 4, 128, (0, 0), (5, 17), kv_dtype=kv))
        out.append(Case("decode", 16, 8, 1, 64, (0, 15, 33), (1, 1, 1), kv_dtype=kv))
        out.append(Case("decode", 1, 6, 2, 64, (96, 130, 100, 7), (1, 1, 1, 1), shared_prefix=96, kv_dtype=kv))
        out.append(Case("decode", 16, 4, 2, 64, (40, 3), (1, 1), sliding_window=8, kv_dtype=kv))
        out.append(Case("verify", 16, 6, 2, 64, (13, 40), (8, 5), trees=(tree, chain), kv_dtype=kv))
    return out


KV_DTYPE_CASES: list[Case] = _kv_dtype_cases()


def _mla_cases() -> list[Case]:
    """MLA, for backends that declare ``supports_mla``: the absorbed form (16 heads over one
    latent head of 32 + 8 dims, V its first 32; DeepSeek-V3's 512 + 64 once) in every mode, and
    the expanded prefill."""
    out = []
    tree, chain = (-1, 0, 0, 1, 1, 2, 4, 6), (-1, 0, 1, 2, 3)
    for page in (1, 16):
        out.append(Case("extend", page, 16, 1, 40, (0, 0), (5, 17), v_head_dim=32))
        out.append(Case("extend", page, 16, 1, 40, (7, 16, 0), (9, 1, 3), v_head_dim=32))
        out.append(Case("decode", page, 16, 1, 40, (0, 15, 33), (1, 1, 1), v_head_dim=32))
        out.append(Case("decode", page, 16, 1, 40, (96, 130, 100), (1, 1, 1), shared_prefix=96, v_head_dim=32))
        out.append(Case("mixed", page, 16, 1, 40, (0, 20, 15, 33), (9, 7, 1, 1), v_head_dim=32))
        out.append(Case("verify", page, 16, 1, 40, (13, 40), (8, 5), trees=(tree, chain), v_head_dim=32))
        out.append(Case("mla_prefill", page, 8, 8, 24, (0, 0, 0), (5, 17, 1), v_head_dim=16))
    out.append(Case("decode", 16, 16, 1, 576, (0, 40), (1, 1), v_head_dim=512))
    out.append(Case("extend", 16, 16, 1, 576, (20, 0), (12, 30), v_head_dim=512))
    out.append(Case("decode", 16, 16, 1, 40, (0, 15, 33), (1, 1, 1), v_head_dim=32, kv_dtype=torch.bfloat16))
    return out


MLA_CASES: list[Case] = _mla_cases()


def reference(q, k, v, prefix_len: int, scaling: float, window: int | None,
              tree: tuple[int, ...] | None = None) -> torch.Tensor:
    """Dense attention of ``q  # [E, H, D]`` over ``k, v  # [prefix + E, Hkv, D]``; with
    ``tree`` (parents of the new tokens) each new token sees the prefix and its ancestors."""
    ext, heads, _ = q.shape
    total, kv_heads, _ = k.shape
    group = heads // kv_heads
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("ehd,thd->het", q.float(), k) * scaling  # [H, E, T]
    if tree is None:
        qpos = torch.arange(prefix_len, prefix_len + ext)[:, None]
        kpos = torch.arange(total)[None, :]
        allowed = kpos <= qpos
    else:
        node_pos = torch.tensor(depths(tree)) + prefix_len
        qpos = node_pos[:, None]
        kpos = torch.cat([torch.arange(prefix_len), node_pos])[None, :]
        allowed = torch.cat([torch.ones(ext, prefix_len, dtype=torch.bool), ancestor_mask(tree)], dim=1)
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("het,thd->ehd", scores.softmax(-1), v)  # [E, H, D]


@dataclass
class BuiltCase:
    """A case's inputs on a device: one layer's paged pool with the prefixes stored, the
    step's batch, and the new tokens' q/k/v (per request too, for the reference)."""

    case: Case
    batch: ForwardBatch
    ctx: AttentionContext
    layer: AttentionLayer
    q: torch.Tensor  # [T, H, D]
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor
    q_list: list[torch.Tensor]  # per request, on CPU
    all_k: list[torch.Tensor]  # per request: prefix + new keys, on CPU
    all_v: list[torch.Tensor]


def build_case(case: Case, *, device: str = "cpu", seed: int = 0) -> BuiltCase:
    """Random paged inputs for ``case`` (page order shuffled, shared prefixes sharing slots)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    n = len(case.prefix_lens)
    page = case.page_size
    totals = [p + e for p, e in zip(case.prefix_lens, case.extend_lens)]
    num_pages = sum(math.ceil(t / page) for t in totals) + math.ceil(case.shared_prefix / page) + 4
    pool = KVPool(num_layers=1, num_pages=num_pages, page_size=page, num_kv_heads=case.num_kv_heads,
                  head_dim=case.head_dim, dtype=case.pool_dtype, device=device,
                  v_head_dim=case.v_head_dim if case.v_in_k else None)
    # Shuffle the page order so requests' pages are not contiguous.
    pool.allocator._free = rnd.sample(pool.allocator._free, len(pool.allocator._free))
    max_ctx = max(totals) + page
    r2t = ReqToTokenPool(n + 1, max_ctx, device)
    rows, all_k, all_v = [], [], []
    slots_new, q_list = [], []
    shared = case.shared_prefix
    if shared % page:
        raise ValueError(f"{case}: shared_prefix must be a multiple of the page size")
    shared_pages = pool.allocator.allocate(shared // page) if shared else []
    shared_k = torch.randn(shared, case.num_kv_heads, case.head_dim, generator=gen).to(case.dtype)
    shared_v = torch.randn(shared, case.num_kv_heads, case.v_dim, generator=gen).to(case.dtype)
    for i in range(n):
        row = r2t.alloc()
        rows.append(row)
        sharing = shared and case.prefix_lens[i] >= shared
        own = pool.allocator.allocate(math.ceil(totals[i] / page) - (len(shared_pages) if sharing else 0))
        pages = (shared_pages + own) if sharing else own
        slots = torch.tensor([pages[p // page] * page + p % page for p in range(totals[i])])
        r2t.req_to_token[row, :totals[i]] = slots.to(device)
        k = torch.randn(totals[i], case.num_kv_heads, case.head_dim, generator=gen).to(case.dtype)
        v = torch.randn(totals[i], case.num_kv_heads, case.v_dim, generator=gen).to(case.dtype)
        if sharing:
            k[:shared], v[:shared] = shared_k, shared_v
        if case.v_in_k:  # MLA's latent: V is the first v_head_dim dims of K
            v = k[..., :case.v_head_dim].clone()
        pre = case.prefix_lens[i]
        pool.k_buffers[0][slots[:pre].to(device)] = to_storage(k[:pre], case.pool_dtype).to(device)
        if not case.v_in_k and case.mode != "mla_prefill":
            pool.v_buffers[0][slots[:pre].to(device)] = to_storage(v[:pre], case.pool_dtype).to(device)
        all_k.append(k)
        all_v.append(v)
        slots_new.append(slots[pre:])
        q_list.append(torch.randn(case.extend_lens[i], case.num_heads, case.head_dim, generator=gen).to(case.dtype))
    mode = {"decode": ForwardMode.DECODE, "extend": ForwardMode.EXTEND, "mla_prefill": ForwardMode.EXTEND,
            "verify": ForwardMode.TARGET_VERIFY, "mixed": ForwardMode.MIXED}[case.mode]
    if case.trees is not None:
        if [len(t) for t in case.trees] != list(case.extend_lens):
            raise ValueError(f"{case}: each tree must have one parent per new token")
        positions = torch.cat([torch.tensor(depths(t)) + p for t, p in zip(case.trees, case.prefix_lens)])
    else:
        positions = torch.cat([torch.arange(p, p + e) for p, e in zip(case.prefix_lens, case.extend_lens)])
    batch = ForwardBatch(
        mode=mode, batch_size=n,
        input_ids=torch.zeros(sum(case.extend_lens), dtype=torch.int64, device=device),
        positions=positions.to(device),
        req_pool_indices=torch.tensor(rows, device=device),
        seq_lens=torch.tensor(totals, device=device),
        out_cache_loc=torch.cat(slots_new).to(device),
        seq_lens_cpu=totals, prefix_lens_cpu=list(case.prefix_lens), extend_lens_cpu=list(case.extend_lens),
        req_to_token=r2t.req_to_token, kv_pool=pool,
        logits_indices=torch.tensor(case.extend_lens).cumsum(0).to(device) - 1,
    )
    if case.mode == "mixed":
        for p, e in zip(reversed(case.prefix_lens), reversed(case.extend_lens)):
            if e != 1 or p == 0:
                break
            batch.num_decode += 1
    if case.trees is not None:
        masks = [ancestor_mask(t).reshape(-1) for t in case.trees]
        batch.tree_mask = torch.cat(masks).to(device)
        batch.tree_mask_offsets_cpu = [0] + list(itertools.accumulate(m.numel() for m in masks))[:-1]
    ctx = AttentionContext(num_heads=case.num_heads, num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                           num_layers=1, dtype=case.dtype, device=torch.device(device), page_size=page,
                           max_context_len=max_ctx, max_batch_size=n, kv_dtype=case.pool_dtype,
                           v_head_dim=case.v_head_dim)
    layer = AttentionLayer(0, case.num_heads, case.num_kv_heads, case.head_dim, case.head_dim ** -0.5,
                           case.sliding_window, v_head_dim=case.v_head_dim)
    q = torch.cat(q_list).to(device)
    k_new = torch.cat([k[p:] for k, p in zip(all_k, case.prefix_lens)]).to(device)
    v_new = torch.cat([v[p:] for v, p in zip(all_v, case.prefix_lens)]).to(device)
    return BuiltCase(case, batch, ctx, layer, q, k_new, v_new, q_list, all_k, all_v)


def run_case(factory, case: Case, *, device: str = "cpu", seed: int = 0, atol: float = 2e-5,
             rtol: float = 1e-4) -> float:
    """Build a random paged pool for ``case``, run the backend for one layer and compare.

    Returns the max abs error; raises AssertionError if any element is outside
    ``atol + rtol * |reference|``.
    """
    built = build_case(case, device=device, seed=seed)
    batch, ctx, layer, pool = built.batch, built.ctx, built.layer, built.batch.kv_pool
    q_list, all_k, all_v, k_new = built.q_list, built.all_k, built.all_v, built.k_new
    trees = case.trees or (None,) * len(case.prefix_lens)
    backend = factory(ctx)
    if case.trees is not None and not getattr(backend, "supports_target_verify", False):
        raise ValueError(f"{case}: the backend does not declare supports_target_verify")
    if case.pool_dtype != case.dtype and case.pool_dtype not in getattr(backend, "supported_kv_dtypes", ()):
        raise ValueError(f"{case}: the backend does not list {case.pool_dtype} in supported_kv_dtypes")
    if case.v_head_dim is not None and not getattr(backend, "supports_mla", False):
        raise ValueError(f"{case}: the backend does not declare supports_mla")
    backend.init_forward_metadata(batch)
    if case.mode == "mla_prefill":
        if any(case.prefix_lens):
            raise ValueError(f"{case}: the expanded MLA prefill has no cached prefix")
        out = backend.forward_mla_prefill(built.q, k_new, built.v_new, layer, batch).float().cpu()
    else:
        out = backend.forward(built.q, k_new, built.v_new, layer, batch).float().cpu()
    # The reference reads K/V as the pool holds them: rounded to its storage dtype.
    narrow = case.pool_dtype != case.dtype

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return to_storage(x, case.pool_dtype).to(case.dtype) if narrow else x

    ref = torch.cat([reference(qi, rounded(ki), rounded(vi), p, layer.scaling, case.sliding_window, t)
                     for qi, ki, vi, p, t in zip(q_list, all_k, all_v, case.prefix_lens, trees)])
    if out.shape != ref.shape:
        raise AssertionError(f"{case}: output shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    err = (out - ref).abs()
    bad = ~(err <= atol + rtol * ref.abs())  # NaN outputs are wrong too
    if bad.any():
        raise AssertionError(f"{case}: {int(bad.sum())} elements off, max abs error {err.max().item():.3g}")
    if narrow:  # and near what a pool in the activation dtype gives
        wide = torch.cat([reference(qi, ki, vi, p, layer.scaling, case.sliding_window, t)
                          for qi, ki, vi, p, t in zip(q_list, all_k, all_v, case.prefix_lens, trees)])
        off = (out - wide).abs().max().item()
        limit = KV_DTYPE_ATOL.get(case.pool_dtype, 0.0)
        if off > limit:
            raise AssertionError(f"{case}: max abs error {off:.3g} against unrounded K/V, over {limit}")
    if case.mode == "mla_prefill":
        return err.max().item()  # (the layer stores the latent itself)
    # The new K/V must have been written to the pool.
    stored = pool.k_buffers[0][batch.out_cache_loc].float().cpu()
    if not torch.allclose(stored, rounded(k_new.cpu()).float()):
        raise AssertionError(f"{case}: the backend did not store the new keys in the KV pool")
    return err.max().item()

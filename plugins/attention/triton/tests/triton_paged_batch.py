"""Random paged batches for comparing the triton backend with torch_native (CPU and GPU tests).

Verify specs (target verify) give each request a draft tree by its parent list; the
parents need not come before their children, and the tree mask is each node's ancestors
and itself.

The pool's unused slots hold NaN and the token-slot table points past each request's
length at such a slot, so a kernel that reads a slot it should not turns its output NaN.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from radixserve.layers.attention import AttentionContext, AttentionLayer, ForwardBatch, ForwardMode
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve_attention_torch import TorchNativeAttention

# Bounded relative error, max |triton - torch_native| / max |torch_native|, by dtype. fp32
# kernels use full-precision products (observed up to 2e-7); bf16 rounds the softmax
# weights to bf16 before the P @ V product, as flash attention does (observed up to 5.5e-3).
REL_ERROR_BOUND = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class Spec:
    mode: str  # "extend", "decode" or "verify"
    page_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]  # all 1 for decode
    sliding_window: int | None = None
    dtype: torch.dtype = torch.float32
    # verify: per request, the parent of each new token (-1: the root); one per new token
    trees: tuple[tuple[int, ...], ...] | None = None

    def __str__(self) -> str:
        w = f"-w{self.sliding_window}" if self.sliding_window else ""
        if self.trees is not None:
            w += "-tree" + "_".join(_tree_name(t) for t in self.trees)
        dt = "" if self.dtype == torch.float32 else f"-{str(self.dtype).removeprefix('torch.')}"
        pre, ext = "_".join(map(str, self.prefix_lens)), "_".join(map(str, self.extend_lens))
        return (
            f"{self.mode}-p{self.page_size}-h{self.num_heads}/{self.num_kv_heads}-d{self.head_dim}"
            f"-pre{pre}-ext{ext}{w}{dt}"
        )


def decode(page, heads, kv, dim, seq_lens, **kw) -> Spec:
    return Spec(
        "decode", page, heads, kv, dim, tuple(n - 1 for n in seq_lens), (1,) * len(seq_lens), **kw
    )


def extend(page, heads, kv, dim, prefix_lens, extend_lens, **kw) -> Spec:
    return Spec("extend", page, heads, kv, dim, tuple(prefix_lens), tuple(extend_lens), **kw)


def verify(page, heads, kv, dim, prefix_lens, trees, **kw) -> Spec:
    trees = tuple(tuple(t) for t in trees)
    lens = tuple(len(t) for t in trees)
    return Spec("verify", page, heads, kv, dim, tuple(prefix_lens), lens, trees=trees, **kw)


def random_tree(num_nodes: int, seed: int, *, shuffled: bool = False) -> tuple[int, ...]:
    """Parents of a random tree rooted at node 0; ``shuffled`` renumbers nodes 1.. at random,
    so parents may come after their children."""
    rnd = random.Random(seed)
    parents = [-1] + [rnd.randrange(a) for a in range(1, num_nodes)]
    if not shuffled:
        return tuple(parents)
    order = [0] + rnd.sample(range(1, num_nodes), num_nodes - 1)  # order[new] = old
    new_of = {old: new for new, old in enumerate(order)}
    return tuple(-1 if parents[old] < 0 else new_of[parents[old]] for old in order)


def ancestor_mask(parents: tuple[int, ...]) -> torch.Tensor:
    """``[E, E]`` bool: row ``a`` marks ``a`` and its ancestors (any node order)."""
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for a in range(len(parents)):
        node = a
        while node >= 0:
            mask[a, node] = True
            node = parents[node]
    return mask


def _tree_name(parents: tuple[int, ...]) -> str:
    """Small trees by their parents; larger ones by size, depth and a checksum (test ids)."""
    if len(parents) <= 10:
        return "".join("r" if p < 0 else str(p) for p in parents)
    depth = int(ancestor_mask(parents).sum(1).max()) - 1
    return f"{len(parents)}n{depth}d{sum(parents) % 1000}"


@dataclass
class Built:
    batch: ForwardBatch
    ctx: AttentionContext
    layer: AttentionLayer
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D] new tokens
    v: torch.Tensor


def build(spec: Spec, *, device: str = "cpu", seed: int = 0, strided_qkv: bool = False) -> Built:
    """A one-layer pool holding each request's prefix, and the new tokens' q, k, v.

    ``strided_qkv``: q, k, v are views into one fused ``[T, (H + 2 Hkv) D]`` tensor, as a
    model's qkv projection produces them.
    """
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    page, n = spec.page_size, len(spec.prefix_lens)
    hkv, dim, dt = spec.num_kv_heads, spec.head_dim, spec.dtype
    totals = [p + e for p, e in zip(spec.prefix_lens, spec.extend_lens)]
    num_pages = sum(math.ceil(t / page) for t in totals) + 4
    pool = KVPool(
        num_layers=1,
        num_pages=num_pages,
        page_size=page,
        num_kv_heads=hkv,
        head_dim=dim,
        dtype=dt,
        device=device,
    )
    for buf in (pool.k_buffers[0], pool.v_buffers[0]):
        buf[page:] = float("nan")  # every slot but the scratch page: written below or never read
    pool.allocator._free = rnd.sample(pool.allocator._free, len(pool.allocator._free))
    nan_slot = pool.num_slots - 1  # a page nobody gets (4 spare pages)
    max_ctx = max(totals) + 2 * page
    r2t = ReqToTokenPool(n + 2, max_ctx, device)
    r2t.req_to_token.fill_(nan_slot)
    rows = [r2t.alloc() for _ in range(n + 2)][:1:-1]  # rows n+1 .. 2: row != batch index
    new_slots = []
    for i, row in enumerate(rows):
        pages = pool.allocator.allocate(math.ceil(totals[i] / page))
        slots = torch.tensor([pages[p // page] * page + p % page for p in range(totals[i])])
        r2t.req_to_token[row, : totals[i]] = slots.to(device)
        pre = spec.prefix_lens[i]
        shape = (pre, hkv, dim)
        pool.k_buffers[0][slots[:pre].to(device)] = torch.randn(shape, generator=gen).to(device, dt)
        pool.v_buffers[0][slots[:pre].to(device)] = torch.randn(shape, generator=gen).to(device, dt)
        new_slots.append(slots[pre:])
    num_tokens = sum(spec.extend_lens)
    q_size, kv_size = spec.num_heads * dim, hkv * dim
    fused = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(device, dt)
    q, k, v = fused.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = q.view(-1, spec.num_heads, dim), k.view(-1, hkv, dim), v.view(-1, hkv, dim)
    if not strided_qkv:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    masks = [ancestor_mask(t) for t in spec.trees or ()]
    if spec.trees is not None:  # prefix + depth
        positions = torch.cat([m.sum(1) - 1 + p for m, p in zip(masks, spec.prefix_lens)])
    else:
        positions = torch.cat(
            [torch.arange(p, p + e) for p, e in zip(spec.prefix_lens, spec.extend_lens)]
        )
    modes = {"decode": ForwardMode.DECODE, "extend": ForwardMode.EXTEND}
    batch = ForwardBatch(
        mode=modes.get(spec.mode, ForwardMode.TARGET_VERIFY),
        batch_size=n,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=positions.to(device),
        req_pool_indices=torch.tensor(rows, device=device),
        seq_lens=torch.tensor(totals, device=device),
        out_cache_loc=torch.cat(new_slots).to(device),
        seq_lens_cpu=totals,
        prefix_lens_cpu=list(spec.prefix_lens),
        extend_lens_cpu=list(spec.extend_lens),
        req_to_token=r2t.req_to_token,
        kv_pool=pool,
        logits_indices=torch.tensor(spec.extend_lens).cumsum(0).to(device) - 1,
    )
    if spec.trees is not None:
        batch.tree_mask = torch.cat([m.reshape(-1) for m in masks]).to(device)
        starts = [0]
        for m in masks[:-1]:
            starts.append(starts[-1] + m.numel())
        batch.tree_mask_offsets_cpu = starts
    ctx = AttentionContext(
        num_heads=spec.num_heads,
        num_kv_heads=hkv,
        head_dim=dim,
        num_layers=1,
        dtype=dt,
        device=torch.device(device),
        page_size=page,
        max_context_len=max_ctx,
        max_batch_size=n,
    )
    layer = AttentionLayer(0, spec.num_heads, hkv, dim, dim**-0.5, spec.sliding_window)
    return Built(batch, ctx, layer, q, k, v)


def run(backend, built: Built) -> torch.Tensor:
    built.batch.attn_metadata = None
    backend.init_forward_metadata(built.batch)
    return backend.forward(built.q, built.k, built.v, built.layer, built.batch)


def compare(
    make_triton,
    spec: Spec,
    *,
    device: str = "cpu",
    seed: int = 0,
    strided_qkv: bool = False,
    bound: float | None = None,
) -> float:
    """Run torch_native and the triton backend on one random batch; return the relative
    error and raise AssertionError past ``bound`` (default :data:`REL_ERROR_BOUND`)."""
    built = build(spec, device=device, seed=seed, strided_qkv=strided_qkv)
    ref = run(TorchNativeAttention(built.ctx), built).float()
    out = run(make_triton(built.ctx), built)
    if out.shape != ref.shape or out.dtype != built.q.dtype:
        raise AssertionError(
            f"{spec}: got {tuple(out.shape)} {out.dtype}, expected {tuple(ref.shape)} "
            f"{built.q.dtype}"
        )
    if not torch.isfinite(out).all():
        raise AssertionError(f"{spec}: non-finite output (a kernel read a slot it should not)")
    rel = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    bound = REL_ERROR_BOUND[spec.dtype] if bound is None else bound
    if rel > bound:
        raise AssertionError(f"{spec}: relative error {rel:.3g} exceeds {bound:g}")
    stored = built.batch.kv_pool.k_buffers[0][built.batch.out_cache_loc]
    if not torch.equal(stored, built.k):
        raise AssertionError(f"{spec}: the new keys were not stored in the KV pool")
    return rel

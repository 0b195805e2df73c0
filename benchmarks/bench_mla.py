"""MLA decode attention: the absorbed form over the latent cache against the expanded form.

One decode step of one attention layer at DeepSeek-V3's attention shape (``--heads`` query
heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128), for a
batch of ``--batch`` requests of ``--context`` cached tokens each, in float32:

* **absorbed** (what radixserve runs for decode): ``W_UK`` folded into the query, each
  attention backend with MLA (``supports_mla``) attending over the latent pool (one head of
  576, V its first 512), ``W_UV`` applied to the output;
* **expanded**: every cached latent expanded by ``kv_b_proj`` into per-head K (192) and V (128)
  at every step, then ordinary multi-head attention (SDPA); and, for the attention alone, the
  same multi-head attention over K/V already expanded (what a per-head cache would hold).

Both give the same output (checked); prints milliseconds per step, the ratio, and the KV bytes
per token and layer each form keeps (the expanded form would otherwise cache K and V per head).

    python benchmarks/bench_mla.py [--batch 16] [--context 1024 4096] [--heads 16] [--repeat 5] [--device cuda]

A backend that cannot run on the device (triton on CPU without ``TRITON_INTERPRET=1``) gets a
row saying why; under the interpreter its time is the interpreter's, not the kernel's.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from radixserve.layers.attention import AttentionContext, AttentionLayer, ForwardBatch, ForwardMode
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.registry import get_registry

RANK, ROPE, NOPE, V = 512, 64, 128, 128


def best_ms(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def setup(batch: int, context: int, heads: int, device: str, page: int = 16):
    """Everything on CPU, then moved to ``device`` (the same random numbers on every device)."""
    g = torch.Generator().manual_seed(0)
    num_pages = batch * (-(-(context + 1) // page)) + 2
    pool = KVPool(num_layers=1, num_pages=num_pages, page_size=page, num_kv_heads=1, head_dim=RANK + ROPE,
                  dtype=torch.float32, device="cpu", v_head_dim=RANK)
    r2t = ReqToTokenPool(batch + 1, context + page + 1, "cpu")
    rows, slots_new = [], []
    for _ in range(batch):
        row = r2t.alloc()
        pages = pool.allocator.allocate(-(-(context + 1) // page))
        slots = torch.tensor([pages[p // page] * page + p % page for p in range(context + 1)])
        r2t.req_to_token[row, :context + 1] = slots
        pool.k_buffers[0][slots[:context]] = torch.randn(context, 1, RANK + ROPE, generator=g)
        rows.append(row)
        slots_new.append(int(slots[context]))
    lens = [context + 1] * batch
    b = ForwardBatch(mode=ForwardMode.DECODE, batch_size=batch, input_ids=torch.zeros(batch, dtype=torch.int64),
                     positions=torch.tensor([context] * batch), req_pool_indices=torch.tensor(rows),
                     seq_lens=torch.tensor(lens), out_cache_loc=torch.tensor(slots_new), seq_lens_cpu=lens,
                     prefix_lens_cpu=[context] * batch, extend_lens_cpu=[1] * batch, req_to_token=r2t.req_to_token,
                     kv_pool=pool, logits_indices=torch.arange(batch))
    w = torch.randn(heads, NOPE + V, RANK, generator=g) / RANK ** 0.5  # kv_b_proj, per head
    q_nope = torch.randn(batch, heads, NOPE, generator=g)
    q_pe = torch.randn(batch, heads, ROPE, generator=g)
    latent = torch.randn(batch, 1, RANK + ROPE, generator=g)  # the new tokens' rows
    if device != "cpu":
        pool.buffer = pool.buffer.to(device)
        pool.k_buffers = [pool.buffer[0, 0]]
        pool.v_buffers = [pool.k_buffers[0][..., :RANK]]
        for name in ("positions", "req_pool_indices", "seq_lens", "out_cache_loc", "req_to_token",
                     "logits_indices", "input_ids"):
            setattr(b, name, getattr(b, name).to(device))
        w, q_nope, q_pe, latent = (t.to(device) for t in (w, q_nope, q_pe, latent))
    ctx = AttentionContext(num_heads=heads, num_kv_heads=1, head_dim=RANK + ROPE, num_layers=1, dtype=torch.float32,
                           device=torch.device(device), page_size=page, max_context_len=context + page + 1,
                           max_batch_size=batch, v_head_dim=RANK)
    return pool, b, w, q_nope, q_pe, latent, ctx


def bench_context(args, context: int, backends: dict) -> None:
    """One table block: the expanded form, then each MLA backend's absorbed form, at ``context``."""
    pool, batch, w, q_nope, q_pe, latent, ctx = setup(args.batch, context, args.heads, args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    w_uk, w_uv = w[:, :NOPE], w[:, NOPE:]
    scaling = (NOPE + ROPE) ** -0.5
    layer = AttentionLayer(0, args.heads, 1, RANK + ROPE, scaling, v_head_dim=RANK)

    def expanded():
        idx = batch.req_to_token[batch.req_pool_indices, :context + 1]  # [B, L]
        rows = pool.k_buffers[0][idx]  # [B, L, 1, 576]
        rows[:, -1] = latent
        kv = torch.einsum("blr,hdr->bhld", rows[:, :, 0, :RANK], w)  # [B, H, L, nope + v]
        k = torch.cat([kv[..., :NOPE], rows[:, :, 0, RANK:].unsqueeze(1).expand(-1, args.heads, -1, -1)], -1)
        q = torch.cat([q_nope, q_pe], dim=-1).unsqueeze(2)  # [B, H, 1, 192]
        out = F.scaled_dot_product_attention(q, k, kv[..., NOPE:], scale=scaling)[:, :, 0]  # [B, H, v]
        sync()
        return out

    ref = expanded()
    t_exp = best_ms(expanded, args.repeat)
    print(f"| {context} | expanded, latents expanded every step | SDPA | {t_exp:.2f} | 1.00x | {(RANK + ROPE) * 2} "
          "(bf16 latent) |")
    idx = batch.req_to_token[batch.req_pool_indices, :context + 1]
    rows = pool.k_buffers[0][idx]
    rows[:, -1] = latent
    kv = torch.einsum("blr,hdr->bhld", rows[:, :, 0, :RANK], w)  # what a per-head cache would hold
    k_cached = torch.cat([kv[..., :NOPE], rows[:, :, 0, RANK:].unsqueeze(1).expand(-1, args.heads, -1, -1)], -1)
    v_cached = kv[..., NOPE:].contiguous()
    q_full = torch.cat([q_nope, q_pe], dim=-1).unsqueeze(2)
    t_mha = best_ms(lambda: (F.scaled_dot_product_attention(q_full, k_cached, v_cached, scale=scaling), sync()),
                    args.repeat)
    print(f"| {context} | expanded, K/V cached per head | SDPA | {t_mha:.2f} | {t_exp / t_mha:.2f}x | "
          f"{args.heads * (NOPE + ROPE + V) * 2} (bf16 K and V per head) |")
    for name, entry in backends.items():
        try:
            backend = entry.factory(ctx)
        except (RuntimeError, ValueError) as e:
            print(f"| {context} | absorbed | {name} | not run: {str(e).splitlines()[0][:90]} | | |")
            continue

        def absorbed(backend=backend):
            backend.init_forward_metadata(batch)
            q = torch.cat([torch.einsum("bhd,hdr->bhr", q_nope, w_uk), q_pe], dim=-1)
            o = backend.forward(q, latent, latent[..., :RANK], layer, batch)  # [B, H, rank]
            out = torch.einsum("bhr,hvr->bhv", o, w_uv)
            sync()
            return out

        err = (absorbed() - ref).abs().max().item()
        if err > 1e-3:
            raise SystemExit(f"{name}: the absorbed form differs from the expanded one by {err:.3g}")
        t = best_ms(absorbed, args.repeat)
        print(f"| {context} | absorbed | {name} | {t:.2f} | {t_exp / t:.2f}x | {(RANK + ROPE) * 2} (bf16 latent) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    reg = get_registry()
    backends = {name: e for name, e in sorted(reg.kind_entries("attention").items())
                if e.is_available and getattr(e.factory, "supports_mla", False)}
    print(f"batch {args.batch}, {args.heads} heads, {torch.get_num_threads()} threads, float32, {args.device}")
    print("| context | form | backend | ms / step | vs expanded | KV bytes / token / layer |")
    print("|---|---|---|---|---|---|")
    for context in args.context:
        bench_context(args, context, backends)


if __name__ == "__main__":
    main()

"""Decode attention per layer at batch 1 with the default model's shapes (SmolLM2-135M: 9 query
heads, 3 KV heads, head_dim 64), float32 activations, by --kv-cache-dtype: torch_native's C
kernel (float32 pools only) against its PyTorch path (gather, widen, SDPA) on float32, bf16,
fp16 and fp8 pools. Interleaved repetitions, minimum time (the machine is shared).

    python benchmarks/bench_kv_cache_dtype.py [threads]
"""
import sys
import time

import torch
from radixserve.layers.attention import AttentionContext, AttentionLayer, ForwardBatch, ForwardMode
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool, to_storage
from radixserve_attention_torch import TorchNativeAttention

H, HKV, D = 9, 3, 64
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)


def setup(kv_dtype, L, use_kernels):
    pool = KVPool(num_layers=1, num_pages=L + 8, page_size=1, num_kv_heads=HKV, head_dim=D, dtype=kv_dtype,
                  device="cpu")
    pool.buffer.copy_(to_storage(torch.randn(pool.buffer.shape), kv_dtype))
    r2t = ReqToTokenPool(2, L + 8, "cpu")
    r2t.req_to_token[0, :L] = torch.randperm(L + 6)[:L] + 1
    batch = ForwardBatch(mode=ForwardMode.DECODE, batch_size=1, input_ids=torch.zeros(1, dtype=torch.long),
                         positions=torch.tensor([L - 1]), req_pool_indices=torch.tensor([0]),
                         seq_lens=torch.tensor([L]),
                         out_cache_loc=r2t.req_to_token[0, L - 1:L].clone(), seq_lens_cpu=[L], prefix_lens_cpu=[L - 1],
                         extend_lens_cpu=[1], req_to_token=r2t.req_to_token, kv_pool=pool,
                         logits_indices=torch.tensor([0]))
    ctx = AttentionContext(num_heads=H, num_kv_heads=HKV, head_dim=D, num_layers=1, dtype=torch.float32,
                           device=torch.device("cpu"), page_size=1, max_context_len=L + 8, max_batch_size=1,
                           kv_dtype=kv_dtype)
    be = TorchNativeAttention(ctx, use_kernels=use_kernels)
    be.init_forward_metadata(batch)
    layer = AttentionLayer(0, H, HKV, D, D ** -0.5)
    q, k, v = torch.randn(1, H, D), torch.randn(1, HKV, D), torch.randn(1, HKV, D)
    return lambda: be.forward(q, k, v, layer, batch)


for L in (128, 512, 2048):
    fns = {"f32 C kernel": setup(torch.float32, L, True), "f32 torch": setup(torch.float32, L, False),
           "bf16 torch": setup(torch.bfloat16, L, False), "fp16 torch": setup(torch.float16, L, False),
           "fp8e4m3 torch": setup(torch.float8_e4m3fn, L, False), "fp8e5m2 torch": setup(torch.float8_e5m2, L, False)}
    best = {k: 1e9 for k in fns}
    for _ in range(30):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(20):
                f()
            best[k] = min(best[k], (time.perf_counter() - t) / 20)
    print(f"L={L:5d} " + "  ".join(f"{k}: {v*1e6:7.1f}us" for k, v in best.items()), flush=True)

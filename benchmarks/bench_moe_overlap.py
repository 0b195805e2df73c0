"""Single- and two-batch overlap against none, on a DeepSeek-V3-shaped model over EP 2.

A random DeepSeek-V3-shaped model (transformers' ``DeepseekV3Config``; default here: 4 layers,
the first dense, hidden 1024, 16 heads with MLA at kv_lora_rank 512, 64 routed experts of
intermediate 256, top-6 in 8 groups (top 4 groups), 2 shared experts) serves ``--batch``
prompts of ``--input-len`` random tokens and ``--output-len`` greedy tokens each, all at once,
on ``--tp-size 2 --ep-size 2 --moe-a2a-backend torch_distributed`` (one thread per rank: a core
each here), with no overlap, ``--enable-single-batch-overlap``, ``--enable-two-batch-overlap`` and
both, one engine after the other. Prints output tokens/s, the ratio, and whether the tokens are
the same as without overlap.

    python benchmarks/bench_moe_overlap.py [--batch 16 64] [--input-len 64] [--output-len 32]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import radixserve
import torch


def build(path: str, args) -> None:
    from bench_moe import randomize, save_tokenizer  # noqa: E402  (same directory: run as a script)
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden, moe_intermediate_size=256,
        num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
        num_experts_per_tok=6, n_group=8, topk_group=4, n_shared_experts=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=4096, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, args.seed)
    model.save_pretrained(path, safe_serialization=True)
    save_tokenizer(path, args.vocab)


def run(path: str, prompts: list[list[int]], new: int, **kw) -> dict:
    engine = radixserve.Engine(path, num_threads=1, max_total_tokens=32768, tp_size=2, ep_size=2,
                               moe_a2a_backend="torch_distributed", **kw)
    try:
        engine.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": new, "temperature": 0.0,
                                                                   "ignore_eos": True})
        seconds = time.perf_counter() - t0
    finally:
        engine.shutdown()
    return {"tok_s": sum(len(o["output_ids"]) for o in outs) / seconds, "outputs": [o["output_ids"] for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    print(f"DeepSeek-V3-shaped, {args.layers} layers, hidden {args.hidden}; tp 2 x ep 2 torch_distributed, 1 thread "
          f"per rank; prompts of {args.input_len} tokens, {args.output_len} new")
    print("| batch | overlap | output tok/s | vs none | same tokens |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as path:
        build(path, args)
        for batch in args.batch:
            prompts = [[rng.randrange(3, args.vocab) for _ in range(args.input_len)] for _ in range(batch)]
            plain = run(path, prompts, args.output_len)
            print(f"| {batch} | none | {plain['tok_s']:.1f} | 1.00x | - |")
            for name, kw in (("single-batch", dict(enable_single_batch_overlap=True)),
                             ("two-batch", dict(enable_two_batch_overlap=True)),
                             ("two-batch + single-batch", dict(enable_two_batch_overlap=True,
                                                               enable_single_batch_overlap=True))):
                got = run(path, prompts, args.output_len, **kw)
                print(f"| {batch} | {name} | {got['tok_s']:.1f} | {got['tok_s'] / plain['tok_s']:.2f}x | "
                      f"{got['outputs'] == plain['outputs']} |", flush=True)


if __name__ == "__main__":
    main()

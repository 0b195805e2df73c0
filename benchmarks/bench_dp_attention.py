"""DP attention against tensor-parallel attention for a MoE model on two ranks.

A random Qwen3-MoE-shaped model (bench_moe's builder; default here: 4 layers, hidden 1024, 48
experts of intermediate 384, top-8, 16 query / 4 KV heads) serves the same offline workload
(``--num-prompts`` random prompts of ``--input-len / 2`` to ``--input-len`` tokens,
``--output-len`` new tokens each, greedy, all submitted at once) on engines run one after the
other in this process:

* ``one-rank``: one rank with ``--threads`` threads, and ``one-rank-both-cores`` with twice
  the threads (the cores two ranks use);
* ``tp2-ep2``: ``--tp-size 2 --ep-size 2``: attention split by heads over both ranks (an
  all-reduce after it), experts split over both;
* ``dp-attn2-ep2``: ``--tp-size 2 --dp-size 2 --enable-dp-attention --ep-size 2``: each rank
  runs its own half of the requests' attention (whole heads, its own KV pool), the MoE layers
  gather both halves' tokens and split the experts as above.

Prints requests/s, output tokens/s, the ratio to ``tp2-ep2`` and whether the tokens equal one
rank's.

    python benchmarks/bench_dp_attention.py [--num-prompts 32] [--input-len 256] [--output-len 32]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import radixserve
from bench_moe import build_model  # noqa: E402  (same directory: run as a script)


def run(model: str, prompts: list[list[int]], new: int, threads: int, **kw) -> dict:
    engine = radixserve.Engine(model, **{"num_threads": threads, "max_total_tokens": 32768, **kw})
    try:
        engine.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 2})  # warm-up
        params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - t0
    finally:
        engine.shutdown()
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"req_s": len(prompts) / seconds, "tok_s": tokens / seconds, "outputs": [o["output_ids"] for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(rng.randint(args.input_len // 2, args.input_len))]
               for _ in range(args.num_prompts)]
    setups = {
        "one-rank": {},
        "one-rank-both-cores": {"num_threads": 2 * args.threads},
        "tp2-ep2": {"tp_size": 2, "ep_size": 2},
        "dp-attn2-ep2": {"tp_size": 2, "ep_size": 2, "dp_size": 2, "enable_dp_attention": True},
    }
    with tempfile.TemporaryDirectory() as path:
        build_model(args, path)
        results = {name: run(path, prompts, args.output_len, args.threads, **kw) for name, kw in setups.items()}
    ref = results["one-rank"]["outputs"]
    print(f"Qwen3-MoE-shaped, {args.layers} layers, hidden {args.hidden}, {args.experts} experts top-{args.top_k}; "
          f"{args.num_prompts} prompts of {args.input_len // 2}-{args.input_len} tokens, {args.output_len} new, "
          f"{args.threads} thread(s) per rank")
    print("| setup | req/s | output tok/s | vs tp2-ep2 | same tokens as one rank |")
    print("|---|---|---|---|---|")
    tp = results["tp2-ep2"]["tok_s"]
    for name, r in results.items():
        print(f"| {name} | {r['req_s']:.3f} | {r['tok_s']:.1f} | {r['tok_s'] / tp:.2f}x | {r['outputs'] == ref} |")


if __name__ == "__main__":
    main()

"""Pipeline parallelism: what micro-batches buy over stages that take a step's batch whole.

Runs the same offline workload (``--num-prompts`` random prompts of ``--input-len`` tokens,
``--output-len`` new tokens each, greedy, all submitted at once) on engines that differ only in
how a step crosses the stages, one after the other in this process:

* ``pp1``: one rank (the reference), and ``pp1-both-cores`` with twice the threads (the cores
  two stages use);
* ``pp2-whole``: ``--pp-size 2`` with ``--pp-max-micro-batch-size`` as large as the batch
  (every step one micro-batch: stage 1 waits while stage 0 computes, and the other way round);
* ``pp2-micro``: ``--pp-size 2`` with the default micro-batches (the batch in two), so stage 0
  computes the second half while stage 1 computes the first;
* ``pp2-micro1``: ``--pp-size 2`` with one request per micro-batch.

Each rank uses ``--threads`` torch threads (default 1: on a 2-core machine each stage gets a
core). Prints requests/s, output tokens/s and micro-batches per step.

    python benchmarks/bench_pipeline.py [--model PATH] [--num-prompts 32] [--input-len 256] [--output-len 64]
"""

from __future__ import annotations

import argparse
import random
import time

import radixserve


def run(model: str | None, prompts: list[list[int]], new: int, threads: int, **kw) -> dict:
    engine = radixserve.Engine(model, **{"num_threads": threads, "max_total_tokens": 32768, **kw})
    try:
        engine.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 2})  # warm-up
        params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
        steps0 = engine.scheduler.stats.num_forward_steps
        micro0 = engine.runner.pipeline.num_micro_batches if engine.runner.pipeline else 0
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        seconds = time.perf_counter() - t0
        steps = engine.scheduler.stats.num_forward_steps - steps0
        micro = (engine.runner.pipeline.num_micro_batches - micro0) if engine.runner.pipeline else steps
    finally:
        engine.shutdown()
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"seconds": seconds, "req_s": len(prompts) / seconds, "tok_s": tokens / seconds,
            "micro_per_step": micro / max(steps, 1), "outputs": [o["output_ids"] for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randint(args.input_len // 2, args.input_len))]
               for _ in range(args.num_prompts)]
    setups = {
        "pp1": {},
        "pp1-both-cores": {"num_threads": 2 * args.threads},  # one rank with the threads of two
        "pp2-whole": {"pp_size": 2, "pp_max_micro_batch_size": args.num_prompts},
        "pp2-micro": {"pp_size": 2},
        "pp2-micro1": {"pp_size": 2, "pp_max_micro_batch_size": 1},
    }
    results = {name: run(args.model, prompts, args.output_len, args.threads, **kw) for name, kw in setups.items()}
    ref = results["pp1"]["outputs"]
    print(f"{args.num_prompts} prompts of {args.input_len // 2}-{args.input_len} tokens, {args.output_len} new, "
          f"{args.threads} thread(s) per rank")
    print("| setup | req/s | output tok/s | micro-batches per step | vs pp2-whole | same tokens as pp1 |")
    print("|---|---|---|---|---|---|")
    whole = results["pp2-whole"]["tok_s"]
    for name, r in results.items():
        print(f"| {name} | {r['req_s']:.3f} | {r['tok_s']:.1f} | {r['micro_per_step']:.2f} | "
              f"{r['tok_s'] / whole:.2f}x | {r['outputs'] == ref} |")


if __name__ == "__main__":
    main()

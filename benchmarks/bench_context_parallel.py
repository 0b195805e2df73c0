"""Context parallelism: the prefill time of one long prompt on one rank against two.

One random prompt of ``--tokens`` tokens (default 8000; the default model's context is 8192),
one new token (the time to the first token is the prefill), each setup run ``--repeat`` times
on a fresh engine, in this process, one after the other:

* ``cp1``: one rank, ``--threads`` torch threads (default 1);
* ``cp1-both-cores``: one rank with twice the threads (the cores two ranks use);
* ``cp2``: ``--attn-cp-size 2``, ``--threads`` per rank (on a 2-core machine a core each).

The prompt is prefilled in one step (``--chunked-prefill-size`` as long as the prompt) unless
``--chunk`` is given. Prints seconds and tokens/s per setup and the ratio to ``cp1``.

    python benchmarks/bench_context_parallel.py [--model PATH] [--tokens 8000] [--threads 1] [--repeat 2]
"""

from __future__ import annotations

import argparse
import random
import time

import radixserve


def prefill_seconds(model: str | None, prompt: list[int], chunk: int, **kw) -> float:
    engine = radixserve.Engine(model, max_total_tokens=len(prompt) + 1024, chunked_prefill_size=chunk,
                               disable_radix_cache=True, **kw)
    try:
        engine.generate(input_ids=prompt[:32], sampling_params={"max_new_tokens": 1})  # warm-up
        t0 = time.perf_counter()
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
        return time.perf_counter() - t0
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--chunk", type=int, default=None, help="--chunked-prefill-size (default: the whole prompt)")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    rng = random.Random(0)
    prompt = [rng.randrange(100, 20000) for _ in range(args.tokens)]
    chunk = args.chunk or args.tokens
    setups = {"cp1": {"num_threads": args.threads}, "cp1-both-cores": {"num_threads": 2 * args.threads},
              "cp2": {"num_threads": args.threads, "attn_cp_size": 2}}
    times = {name: [prefill_seconds(args.model, prompt, chunk, **kw) for _ in range(args.repeat)]
             for name, kw in setups.items()}
    print(f"one prompt of {args.tokens} tokens, chunk {chunk}, {args.threads} thread(s) per rank")
    print("| setup | prefill seconds (each run) | tokens/s (best) | vs cp1 |")
    print("|---|---|---|---|")
    base = min(times["cp1"])
    for name, ts in times.items():
        print(f"| {name} | {' / '.join(f'{t:.2f}' for t in ts)} | {args.tokens / min(ts):.0f} | "
              f"{base / min(ts):.2f}x |")


if __name__ == "__main__":
    main()

"""What ordering the waiting queue costs per scheduler step under ``lpm``, by queue length, with
and without the fall-back to arrival order above ``--lpm-max-queue``.

    python benchmarks/bench_lpm_queue.py [--queues 16,128,512,2048] [--prompt-tokens 1000]

One engine on the default model; 32 prompts of ``--prompt-tokens`` tokens (8 shared system
prompts of half that length, each with its own tail) run first so the radix cache holds
their prefixes. Then the waiting queue is filled with ``N`` such requests (not run) and
``planner.order()`` is timed (best of 5): once with the fall-back off (``lpm_max_queue``
above N) and once at the default (128). A step orders the queue once, so this is added to
every step's time while that many requests wait.
"""

from __future__ import annotations

import argparse
import random
import time

import radixserve
from radixserve.config import ServerArgs
from radixserve.engine.request import Req
from radixserve.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queues", default="16,128,512,2048")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    args = ap.parse_args()
    rng = random.Random(0)
    engine = radixserve.Engine(max_total_tokens=65536)
    vocab = engine.model_config.vocab_size
    half = args.prompt_tokens // 2
    systems = [[rng.randrange(100, vocab) for _ in range(half)] for _ in range(8)]

    def prompt() -> list[int]:
        return rng.choice(systems) + [rng.randrange(100, vocab) for _ in range(args.prompt_tokens - half)]

    try:
        engine.generate(input_ids=[prompt() for _ in range(32)], sampling_params={"max_new_tokens": 1})
        planner = engine.scheduler.planner
        default = ServerArgs().lpm_max_queue
        print(f"| waiting requests | lpm, no fall-back (ms/step) | default --lpm-max-queue {default} (ms/step) |")
        print("|---|---|---|")
        for n in (int(x) for x in args.queues.split(",")):
            waiting = planner.queues.waiting
            waiting.extend(Req(f"q{i}", prompt(), SamplingParams(max_new_tokens=1), 1) for i in range(n))
            row = []
            for limit in (n + 1, default):
                planner.args.lpm_max_queue = limit
                best = float("inf")
                for _ in range(5):
                    t = time.perf_counter()
                    planner.order()
                    best = min(best, time.perf_counter() - t)
                row.append(best * 1e3)
            waiting.clear()
            print(f"| {n} | {row[0]:.2f} | {row[1]:.2f} |")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()

"""Cost of a decode step's penalty tensors: rebuilt from every row's full history against
running per-request statistics (``PenaltyState``), at a few batch sizes and history lengths.

    python benchmarks/bench_penalties.py [--vocab 49152] [--batch-sizes 1,16,64] [--histories 256,4096]

Each row times ``SamplingBatchInfo.build`` for a batch whose requests all set repetition,
frequency and presence penalties, after one new output token per request (what a decode step
does), best of ``--repeats`` steps. Both ways build identical tensors (tests/test_sampler.py).
"""

from __future__ import annotations

import argparse
import random
import time

from radixserve.sampling import PenaltyState, SamplingBatchInfo, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--histories", default="256,4096", help="prompt + output tokens per request")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    rng = random.Random(0)
    params = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2)
    params.verify(args.vocab)
    print(f"vocab {args.vocab}; ms per step (best of {args.repeats})")
    print(f"{'batch':>5} {'history':>7} {'full history':>13} {'running stats':>14} {'ratio':>6}")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for n in (int(x) for x in args.histories.split(",")):
            prompts = [[rng.randrange(args.vocab) for _ in range(n // 2)] for _ in range(b)]
            outputs = [[rng.randrange(args.vocab) for _ in range(n - n // 2)] for _ in range(b)]
            states = [PenaltyState(params, p, args.vocab) for p in prompts]
            for s, o in zip(states, outputs):
                s.advance(o)
            full, kept = [], []
            for _ in range(args.repeats):
                for o in outputs:
                    o.append(rng.randrange(args.vocab))
                common = ([params] * b, [None] * b, list(zip(prompts, outputs)), [len(o) for o in outputs],
                          {0}, args.vocab, "cpu")
                t = time.perf_counter()
                SamplingBatchInfo.build(*common)
                full.append(time.perf_counter() - t)
                t = time.perf_counter()
                for s, o in zip(states, outputs):
                    s.advance(o)
                SamplingBatchInfo.build(*common, penalty_states=states)
                kept.append(time.perf_counter() - t)
            f, k = min(full) * 1e3, min(kept) * 1e3
            print(f"{b:>5} {n:>7} {f:>13.2f} {k:>14.2f} {f / k:>5.1f}x")


if __name__ == "__main__":
    main()

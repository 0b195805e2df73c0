"""What a decode batch size costs the first time it is needed on CPU: the step that records
its kernel tape against the steps that replay it.

    python benchmarks/bench_tape_record.py [--model PATH] [--max-bs 16] [--steps 3] [--rounds 2]

One ``Engine`` (radix cache off) gets ``--max-bs`` prompts of 64 random tokens at once, the
i-th with ``i * --steps`` new tokens (greedy, ``ignore_eos``), so the decode batch shrinks
from ``--max-bs`` to 1, ``--steps`` steps at each size. Every forward is timed; a decode step
during which ``radixserve.kernels.tape.records`` grew is the one that recorded its size.
Printed per size: the recording step and the median of the replayed ones (ms), and over all
sizes the median and mean extra cost of a first step (recording minus replay; the mean
also carries any full garbage collection that happened to run in a recording step). ``--rounds`` repeats it
with a fresh engine.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch


def run(model: str | None, max_bs: int, steps: int) -> dict[int, tuple[float, list[float]]]:
    from radixserve import Engine
    from radixserve.kernels import tape

    engine = Engine(model=model, disable_radix_cache=True, max_running_requests=max(max_bs, 1))
    runner = engine.runner
    inner = runner.forward
    first: dict[int, float] = {}
    replays: dict[int, list[float]] = {}

    def timed(batch):
        records = tape.records
        t = time.perf_counter()
        out = inner(batch)
        dt = time.perf_counter() - t
        if batch.is_decode:
            if tape.records != records:
                first[batch.batch_size] = dt
            else:
                replays.setdefault(batch.batch_size, []).append(dt)
        return out

    runner.forward = timed
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(64)] for _ in range(max_bs)]
    params = [{"max_new_tokens": (i + 1) * steps + 1, "temperature": 0.0, "ignore_eos": True}
              for i in range(max_bs)]
    engine.generate(input_ids=prompts, sampling_params=params)
    runner.forward = inner
    engine.shutdown()
    return {bs: (first[bs], replays.get(bs, [])) for bs in sorted(first)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-bs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for r in range(args.rounds):
        res = run(args.model, args.max_bs, args.steps)
        extra = []
        print(f"round {r + 1}: size, recording step ms, replayed step ms (median)")
        for bs, (rec, reps) in res.items():
            rep = statistics.median(reps) if reps else float("nan")
            if reps:
                extra.append(rec - rep)
            print(f"  {bs:3d}  {rec * 1e3:7.1f}  {rep * 1e3:7.1f}")
        if extra:
            print(f"  a first step costs {statistics.median(extra) * 1e3:.1f} ms (median; mean "
                  f"{statistics.mean(extra) * 1e3:.1f} ms) more than a replay, over {len(extra)} sizes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

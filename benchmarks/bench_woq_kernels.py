"""Weight-only quantised CPU linears (radixserve.kernels.woq) against the float32 panel kernel.

For the default model's layer shapes, at M = 1 (decode) and M = 32, times ``Matrix.linear`` of
Int8Matrix, Int4Matrix (group 128) and BF16Matrix against ``kernels.linear(x, kernels.pack(w))``
and prints float32 time / format time (> 1: the format is faster). Two cache states:

- hot: one weight, called again and again; the smaller shapes then sit in L2/L3, so this
  measures the kernels' compute more than their memory traffic;
- cold: a rotation over enough copies of the weight that float32 copies exceed ``--cold-mb``
  (default 160 MB, a few times a server L3), as in a decode step that walks every layer once.

    python benchmarks/bench_woq_kernels.py [--threads 2] [--max-load 1.5] [--clock wall|cpu]

Waits (up to --wait s) for the 1-minute load average to fall below --max-load first, since
other jobs share the machine. Each time is the best of 5 runs. On a machine busier than its
cores, two OpenMP threads wait whole scheduler slices at each barrier (milliseconds per call):
then only ``--threads 1 --clock cpu`` gives usable numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from radixserve.kernels import cpu
from radixserve.kernels.woq import BF16Matrix, Int4Matrix, Int8Matrix

SHAPES = [(1536, 576), (576, 1536), (576, 576), (49152, 576)]
ROWS = [1, 32]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def _time(fn, calls: int, repeats: int) -> float:
    """Seconds per call, the best of ``repeats`` runs of ``calls`` calls (on a shared machine the
    best run is the one least disturbed by other jobs)."""
    fn(0)
    runs = []
    for _ in range(repeats):
        t0 = _clock()
        for i in range(calls):
            fn(i)
        runs.append((_clock() - t0) / calls)
    return min(runs)


def _wait_for_quiet(max_load: float, wait_s: float) -> float:
    deadline = time.time() + wait_s
    while True:
        load = os.getloadavg()[0]
        if load < max_load or time.time() >= deadline:
            return load
        print(f"# load {load:.2f} >= {max_load}, waiting", file=sys.stderr)
        time.sleep(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-load", type=float, default=1.5)
    ap.add_argument("--wait", type=float, default=300)
    ap.add_argument("--cold-mb", type=float, default=160)
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="cpu: process CPU time, steadier on a busy machine (meaningful with --threads 1)")
    ap.add_argument("--budget-s", type=float, default=0.25, help="target seconds per measurement run")
    args = ap.parse_args()
    global _clock
    _clock = CLOCKS[args.clock]
    kernels = cpu.load()
    if kernels is None:
        sys.exit(f"CPU kernels unavailable: {cpu.status()}")
    torch.set_num_threads(args.threads)
    load = _wait_for_quiet(args.max_load, args.wait)
    print(f"# threads={args.threads} clock={args.clock} load={load:.2f} panel_width={kernels.panel_width} "
          f"cold set >= {args.cold_mb:.0f} MB of float32 weights")
    print(f"{'N x K':>12} {'M':>3} {'cache':>5} {'f32 us':>9} {'int8 us':>9} {'x':>5} {'int4 us':>9} {'x':>5}"
          f" {'bf16 us':>9} {'x':>5}")
    formats = [("int8", Int8Matrix.prepare, {}), ("int4", Int4Matrix.prepare, {"group_size": 128}),
               ("bf16", BF16Matrix.prepare, {})]
    for n, k in SHAPES:
        g = torch.Generator().manual_seed(n + k)
        w = torch.randn(n, k, generator=g) / k**0.5
        copies = max(2, int(args.cold_mb * 2**20 // (n * k * 4)) + 1)
        mats = {"f32": [kernels.pack(w + 0.0) for _ in range(copies)]}
        for name, prep, opts in formats:
            mats[name] = [prep(kernels, w, **opts) for _ in range(copies)]
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            fns = {"f32": lambda pk, x=x, n=n: (lambda: kernels.linear(x, pk, None, n))}
            for name, _, _ in formats:
                fns[name] = lambda mat, x=x: (lambda: mat.linear(x))
            for cache in ("hot", "cold"):
                times = {}
                for name, objs in mats.items():
                    calls_ = [fns[name](o) for o in objs]
                    if cache == "hot":
                        calls_ = calls_[:1]
                    def run(i, calls_=calls_):
                        return calls_[i % len(calls_)]()
                    per = _time(run, len(calls_), 1)
                    calls = max(len(calls_), int(args.budget_s / max(per, 1e-7)) // len(calls_) * len(calls_))
                    times[name] = _time(run, calls, 5)
                f = times["f32"]
                cols = "".join(f" {times[nm] * 1e6:9.1f} {f / times[nm]:5.2f}" for nm, _, _ in formats)
                print(f"{n:>6} x {k:<4} {m:>3} {cache:>5} {f * 1e6:9.1f}{cols}", flush=True)
        del mats


if __name__ == "__main__":
    main()

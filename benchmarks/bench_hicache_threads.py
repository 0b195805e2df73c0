"""HiCache's io thread and the engine's OpenMP pool: multi-turn rounds over a small device
pool, with the io thread giving its OpenMP workers back after each copy (the default) or keeping
them (``--keep-workers``, the behaviour before), alternated in fresh processes.

    python benchmarks/bench_hicache_threads.py [--rounds 2] [--conversations 8] [--turns 5]

Each run: one engine on the default model (``--max-total-tokens 1024``, HiCache with a host
pool of 8x), ``--conversations`` prompts of 200 random tokens submitted together with
``generate`` (the scheduler steps in this thread, as the server's engine process steps it in
the thread that loaded the model), 16 greedy tokens each; every later turn appends the answer
and 40 new tokens. The device pool is too small for the histories, so every turn demotes pages
to the host tier and loads them back, on the io thread. Prints the seconds of each turn.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time


def run(args) -> None:
    import radixserve
    import torch
    from radixserve.kernels import cpu as cpu_kernels
    from radixserve.model_loader.loader import default_model_path

    if args.keep_workers:
        cpu_kernels.run_and_release = lambda fn: fn()
    g = torch.Generator().manual_seed(0)
    convs = [torch.randint(100, 40000, (200,), generator=g).tolist() for _ in range(args.conversations)]
    engine = radixserve.Engine(default_model_path(), max_total_tokens=1024, enable_hierarchical_cache=True,
                               hicache_ratio=8)
    times = []
    for _ in range(args.turns):
        t = time.perf_counter()
        outs = engine.generate(input_ids=convs, sampling_params={"max_new_tokens": 16, "temperature": 0.0,
                                                                 "ignore_eos": True})
        times.append(time.perf_counter() - t)
        convs = [c + o["output_ids"] + torch.randint(100, 40000, (40,), generator=g).tolist()
                 for c, o in zip(convs, outs)]
    stats = engine.get_stats()
    engine.shutdown()
    label = "keep workers" if args.keep_workers else "release workers"
    print(f"{label}: turns {[round(x, 2) for x in times]} s, total {sum(times):.2f} s, "
          f"host hit tokens {stats['hicache_host_hit_tokens']}, demoted pages {stats['hicache_demoted_pages']}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--keep-workers", action="store_true", help=argparse.SUPPRESS)  # one run, in this process
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        run(args)
        return
    common = [f"--conversations={args.conversations}", f"--turns={args.turns}", "--one"]
    for _ in range(args.rounds):
        for extra in (["--keep-workers"], []):
            subprocess.run([sys.executable, __file__, *common, *extra], check=True)


if __name__ == "__main__":
    main()

"""Overlapped scheduling on vs off (issue 19): decode step time at a few batch sizes.

    python benchmarks/bench_overlap.py [--model PATH] [--batch-sizes 1,16] [--decode-steps 64]
        [--prompt-len 64] [--repeats 5]

Two engines on the same weights, one with overlap (``enable_overlap_schedule``), one
without (``disable_overlap_schedule``), measured alternately in the same run so that load
drift hits both alike. Decode ms/step is (generate N+1 tokens - generate 1 token) / N, best
of ``--repeats`` (noise on a shared machine only ever slows a run down); the greedy tokens
of both engines are compared too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import torch
    from radixserve import Engine

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    steps = args.decode_steps
    tokens = max(batch_sizes) * (args.prompt_len + steps + 8) + 64
    engines = {
        "off": Engine(model=args.model, disable_radix_cache=True, max_total_tokens=tokens,
                      disable_overlap_schedule=True),
        "on": Engine(model=args.model, disable_radix_cache=True, max_total_tokens=tokens,
                     enable_overlap_schedule=True),
    }
    assert engines["on"].scheduler.overlap is not None and engines["off"].scheduler.overlap is None
    g = torch.Generator().manual_seed(0)
    vocab = engines["on"].runner.model_config.vocab_size
    prompts = [torch.randint(100, vocab - 100, (args.prompt_len,), generator=g).tolist()
               for _ in range(max(batch_sizes))]

    def run(name, bs, n):
        t = time.perf_counter()
        out = engines[name].generate(input_ids=prompts[:bs], sampling_params={
            "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
        return time.perf_counter() - t, [o["output_ids"] for o in out]

    for name in engines:  # warm-up
        run(name, 1, 4)
    results = {}
    for bs in batch_sizes:
        best = {name: [float("inf"), float("inf")] for name in engines}
        ids = {}
        for _ in range(args.repeats):
            for name in engines:
                t1, _ = run(name, bs, 1)
                tn, ids[name] = run(name, bs, steps + 1)
                best[name][0] = min(best[name][0], t1)
                best[name][1] = min(best[name][1], tn)
        row = {}
        for name in engines:
            ms = (best[name][1] - best[name][0]) / steps * 1e3
            row[name] = {"ms_per_step": round(ms, 2), "tok_s": round(bs * 1e3 / ms, 1)}
        row["speedup_on_vs_off"] = round(row["off"]["ms_per_step"] / row["on"]["ms_per_step"], 3)
        row["same_tokens"] = ids["on"] == ids["off"]
        results[f"bs{bs}"] = row
        print(f"batch {bs}: off {row['off']['ms_per_step']} ms/step, on {row['on']['ms_per_step']} ms/step, "
              f"on/off speed-up {row['speedup_on_vs_off']}x, same tokens: {row['same_tokens']}", flush=True)
    for e in engines.values():
        e.shutdown()
    print(json.dumps({"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                  "torch": torch.__version__, "threads": torch.get_num_threads(),
                                  "load": os.getloadavg()},
                      "decode_steps": steps, "prompt_len": args.prompt_len, "repeats": args.repeats,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()

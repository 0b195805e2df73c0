"""Resident memory and decode step time of one engine configuration (one process each, so
RSS is this configuration's alone): the check behind "16-bit checkpoints keep 16-bit weights
on CPU" (issue 36, item 5).

    python benchmarks/bench_half_weights.py --model PATH [--dtype auto|float32] [--quantization Q]
        [--batch-sizes 1,16] [--decode-steps 32] [--repeats 3]

    python benchmarks/bench_half_weights.py --lm-head 49152,576 [--batch-sizes 1,16]

Prints one JSON line: RSS after start-up and after the runs (VmRSS, VmHWM), the weight bytes
the engine keeps (all, the embedding's), the linear paths, decode ms per step for each batch
size (generate N+1 tokens minus generate 1 token, best of --repeats), and the greedy tokens
of one prompt (to check that configurations agree). ``--lm-head V,H`` instead times the parts
a 16-bit tied head changes, on a random ``[V, H]`` table, interleaved and best of many: the
head's product from float32 panels vs float16 panels, and the embedding lookup from a float16
table vs from the head's panels (``take_rows``), in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def bench_lm_head(vocab: int, hidden: int, batch_sizes: list[int], repeats: int) -> dict:
    import time

    import torch
    import torch.nn.functional as F
    from radixserve.kernels import cpu as cpu_kernels
    from radixserve.kernels import woq
    from radixserve.quantization.methods import FloatMatrix

    table = torch.randn(vocab, hidden).half()
    f32, f16 = FloatMatrix(table.float()), woq.F16Matrix.prepare(cpu_kernels.load(), table)

    def best_us(fn) -> float:
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return round(best * 1e6, 1)

    res = {"lm_head": [vocab, hidden], "float32_path": f32.path}
    for bs in batch_sizes:
        x, ids = torch.randn(bs, hidden), torch.randint(0, vocab, (bs,))
        parts = {"head_f32": lambda x=x: f32.linear(x), "head_f16": lambda x=x: f16.linear(x),
                 "lookup_table": lambda ids=ids: F.embedding(ids, table).float(),
                 "lookup_panels": lambda ids=ids: f16.take_rows(ids).float()}
        for _ in range(2):  # interleaved: a burst of load slows every part alike
            for name, fn in parts.items():
                key = f"{name}_bs{bs}_us"
                res[key] = min(res.get(key, float("inf")), best_us(fn))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--lm-head", default=None, help="V,H: time the 16-bit tied head's parts instead")
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from bench_offline import best_of
    from radixserve import Engine

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.lm_head:
        vocab, hidden = (int(v) for v in args.lm_head.split(","))
        print(json.dumps(bench_lm_head(vocab, hidden, batch_sizes, max(args.repeats, 50))))
        return
    if args.model is None:
        ap.error("--model is required (or --lm-head)")
    prompt = list(range(100, 132))
    engine = Engine(model=args.model, tokenizer_path=args.tokenizer_path, dtype=args.dtype,
                    quantization=args.quantization, disable_radix_cache=True,
                    max_total_tokens=max(batch_sizes) * (len(prompt) + args.decode_steps + 8) + 64)
    model = engine.runner.model
    res = {"model": os.path.basename(args.model.rstrip("/")), "dtype": args.dtype, "quantization": args.quantization,
           "rss_mb_loaded": round(_status_mb("VmRSS")), "weight_mb": round(engine.runner.weight_bytes / 2**20, 1),
           "embed_mb": round(model.embed_tokens.weight_nbytes() / 2**20, 1),
           "linear_paths": sorted({m.path for m in model.modules() if hasattr(m, "method")})}

    def gen(bs, n):
        return lambda: engine.generate(input_ids=[prompt] * bs, sampling_params={
            "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})

    res["tokens"] = engine.generate(input_ids=prompt, sampling_params={
        "max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True})["output_ids"]
    for bs in batch_sizes:
        full = best_of(gen(bs, args.decode_steps + 1), args.repeats)
        first = best_of(gen(bs, 1), args.repeats)
        res[f"decode_bs{bs}_ms_step"] = round((full - first) / args.decode_steps * 1000, 2)
    res["rss_mb_end"], res["hwm_mb"] = round(_status_mb("VmRSS")), round(_status_mb("VmHWM"))
    engine.shutdown()
    print(json.dumps(res))


if __name__ == "__main__":
    main()

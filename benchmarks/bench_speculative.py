"""Decode speed with vs without speculative decoding, measured in one run on this machine.

For each method and batch size the same prompts (each workload's prompts, in batches of
that size) run through a plain engine and a speculative one, taking turns batch by batch (greedy, so
both produce the same tokens); decode tok/s is (time to generate N tokens - time to
generate 1 token) / (tokens after the first), so prefill and start-up cancel. Reports the
ratio and the mean accepted length: tokens per request-step (a step whose request got no
draft decodes one token and counts as 1) and tokens per request-step that verified a draft.

Workloads:

* ``repetitive``: chat prompts that ask to quote back or lightly edit a given code block
  (what NGRAM is for);
* ``chat``: ordinary chat questions (what a trained draft model is for).

    python benchmarks/bench_speculative.py --methods ngram
    python benchmarks/bench_speculative.py --methods eagle3 --eagle3-path /tmp/eagle3-smollm2
    python benchmarks/bench_speculative.py --methods standalone --standalone-path /tmp/draft-6l
    python benchmarks/bench_speculative.py --methods eagle3 --eagle3-path DIR --draft-quantizations none,w8a16_int8

Results are appended to ``benchmarks/results/speculative.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, x in enumerate(values):
        total += x
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''

CODE2 = '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None
'''

REPETITIVE = [
    f"Repeat this code exactly, with no changes:\n```python\n{CODE}```",
    f"Rename the function to `rolling_mean` and return the code:\n```python\n{CODE}```",
    f"Copy this class exactly:\n```python\n{CODE2}```",
    f"Add a method `size` that returns the number of items, then show the whole class:\n```python\n{CODE2}```",
]

CHAT = [
    "What is the boiling point of water in Celsius?",
    "Give me three tips for better sleep.",
    "Explain what a hash table is in two sentences.",
    "Write a short poem about the sea.",
    "What are the primary colors?",
    "How do I make a cup of tea?",
    "Name three planets in the solar system.",
    "Why do leaves change color in autumn?",
]


def chat_prompts(tokenizer, texts):
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                          add_generation_prompt=True) for t in texts]


def timed(engine, prompts, n):
    t = time.perf_counter()
    outs = engine.generate(prompts, {"temperature": 0.0, "max_new_tokens": n})
    return time.perf_counter() - t, outs


def decode_rates(engines, groups, n, repeats):
    """Decode tok/s of each engine over the batches in ``groups`` (each run as one batch;
    best of ``repeats`` per batch and engine) and each engine's outputs. The engines take
    turns batch by batch and repeat by repeat, so a machine that slows down or speeds up
    mid-run moves both sides of a ratio alike."""
    tokens = [0] * len(engines)
    times = [0.0] * len(engines)
    outs_all: list[list] = [[] for _ in engines]
    for prompts in groups:
        best = [float("inf")] * len(engines)
        outs = [None] * len(engines)
        for _ in range(repeats):
            for i, engine in enumerate(engines):
                t1, _ = timed(engine, prompts, 1)
                tn, outs[i] = timed(engine, prompts, n)
                best[i] = min(best[i], tn - t1)
        for i in range(len(engines)):
            tokens[i] += sum(len(o["output_ids"]) - 1 for o in outs[i])
            times[i] += max(best[i], 1e-9)
            outs_all[i].extend(outs[i])
    return [(tokens[i] / times[i], outs_all[i]) for i in range(len(engines))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--methods", default="ngram", help="comma list of ngram, eagle3, standalone")
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--eagle3-path", default=None)
    ap.add_argument("--standalone-path", default=None)
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--num-steps", type=int, default=None)
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--draft-quantizations", default=None,
                    help="comma list of --speculative-draft-model-quantization values to compare (model drafts; "
                         "default: the method's own)")
    ap.add_argument("--spec-arg", action="append", default=[], metavar="NAME=VALUE",
                    help="any other engine argument of the speculative engine, e.g. "
                         "speculative_ngram_min_match_window_size=2 (repeatable; VALUE read as JSON where it parses)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "speculative.jsonl"))
    args = ap.parse_args()

    import torch
    from radixserve import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    common = {"model": args.model, "disable_radix_cache": True, "max_total_tokens": 65536}
    plain = Engine(**common)
    tok = plain.tokenizer.hf
    workloads = {"repetitive": chat_prompts(tok, REPETITIVE), "chat": chat_prompts(tok, CHAT)}
    method_workloads = {"ngram": ["repetitive", "chat"], "eagle3": ["chat", "repetitive"],
                        "standalone": ["chat", "repetitive"]}
    rows = []
    runs = [(m, q) for m in args.methods.split(",")
            for q in ((args.draft_quantizations or "").split(",") if m != "ngram" and args.draft_quantizations
                      else [None])]
    for method, quant in runs:
        kw = {"speculative_algorithm": method, "speculative_disable_by_batch_size": 1 << 20}
        if quant is not None:
            kw["speculative_draft_model_quantization"] = quant
        if method == "eagle3":
            kw["speculative_draft_model_path"] = args.eagle3_path
        if method == "standalone":
            kw["speculative_draft_model_path"] = args.standalone_path
        for item in args.spec_arg:
            name, _, value = item.partition("=")
            try:
                kw[name] = json.loads(value)
            except ValueError:
                kw[name] = value
        for flag, value in (("speculative_num_draft_tokens", args.num_draft_tokens),
                            ("speculative_num_steps", args.num_steps), ("speculative_eagle_topk", args.topk)):
            if value is not None:
                kw[flag] = value
        spec = Engine(**common, **kw)
        for wl in method_workloads[method]:
            for bs in batch_sizes:
                texts = workloads[wl]
                prompts = [texts[i % len(texts)] for i in range(max(bs, len(texts)))]
                groups = [prompts[i:i + bs] for i in range(0, len(prompts) - bs + 1, bs)]
                before = spec.get_stats()
                (base, base_outs), (rate, outs) = decode_rates([plain, spec], groups, args.max_new_tokens,
                                                               args.repeats)
                after = spec.get_stats()
                steps = sum(after["spec_accept_length_hist"].values()) - sum(before["spec_accept_length_hist"].values())
                emitted = (sum(k * v for k, v in after["spec_accept_length_hist"].items())
                           - sum(k * v for k, v in before["spec_accept_length_hist"].items()))
                same = [o["output_ids"] for o in outs] == [o["output_ids"] for o in base_outs]
                # request-steps that verified a draft, and the tokens they emitted
                drafted = after["spec_num_drafted_steps"] - before["spec_num_drafted_steps"]
                drafted_emitted = after["spec_num_drafted_emitted"] - before["spec_num_drafted_emitted"]
                row = {"method": method, "draft_quantization": quant or "default", "workload": wl,
                       "batch_size": bs, "plain_tok_s": round(base, 1),
                       "spec_tok_s": round(rate, 1), "speedup": round(rate / base, 2),
                       "accept_length": round(emitted / steps, 2) if steps else 0.0,
                       "drafted_accept_length": round(drafted_emitted / drafted, 2) if drafted else 0.0,
                       "drafted_steps": round(drafted / steps, 2) if steps else 0.0,
                       "num_draft_tokens": spec.scheduler.spec.num_draft_tokens,
                       "spec_args": args.spec_arg, "same_tokens": same}
                rows.append(row)
                print(json.dumps(row), flush=True)
        spec.shutdown()
    plain.shutdown()
    meta = {"machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
            "time": time.strftime("%Y-%m-%d %H:%M")}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "a") as f:
        for row in rows:
            f.write(json.dumps({**meta, **row}) + "\n")
    print("\n| method | draft quantization | workload | batch | plain tok/s | spec tok/s | speedup | accept length "
          "| accept length (steps with a draft) | steps with a draft | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['draft_quantization']} | {r['workload']} | {r['batch_size']} | "
              f"{r['plain_tok_s']} | {r['spec_tok_s']} | "
              f"{r['speedup']}x | {r['accept_length']} | {r['drafted_accept_length']} | "
              f"{r['drafted_steps']:.0%} | {r['same_tokens']} |")


if __name__ == "__main__":
    main()

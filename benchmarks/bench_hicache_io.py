"""HiCache copy speed on CPU: device pool <-> host pool, per I/O path.

    python benchmarks/bench_hicache_io.py [--pages 64] [--repeats 20] [--threads 1]

Pools shaped like the default model's KV (30 layers, 3 KV heads, head dim 64, page 16,
float32: 737 KB a page). Rows: ``--hicache-io-backend kernel`` (on CPU one strided block
copy per run of consecutive pages), ``direct`` (a copy per layer and K/V), and ``gather``:
the kernel backend's fused gather/scatter, which is what it runs on CUDA and what it ran
on CPU before block copies. Each is timed for device pages that are consecutive and for
scattered ones (what a pool that has evicted for a while hands out); the host pages are
consecutive. Best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import random

import torch
from bench_offline import best_of  # same directory: run as a script
from radixserve.hicache.host_pool import HostKVPool
from radixserve.mem.kv_pool import KVPool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=64, help="pages per copy (64: a 1,024-token conversation)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device_pages = 4 * args.pages
    kv = KVPool(num_layers=30, num_pages=device_pages + 1, page_size=16, num_kv_heads=3, head_dim=64,
                dtype=torch.float32, device="cpu")
    kv.buffer.normal_()
    host_pages = list(range(1, args.pages + 1))
    layouts = {"consecutive": list(range(1, args.pages + 1)),
               "scattered": random.Random(0).sample(range(1, device_pages + 1), args.pages)}
    print(f"{args.pages} pages per copy, {args.threads} thread(s), best of {args.repeats}")
    print("| path | device pages | MB | backup ms | backup GB/s | load ms | load GB/s |")
    print("|---|---|---|---|---|---|---|")
    for path in ("kernel", "direct", "gather"):
        host = HostKVPool(kv, args.pages, "direct" if path == "direct" else "kernel")
        if path == "gather":
            host._block_copies = lambda: False
        mb = args.pages * host.page_bytes / 1e6
        for name, pages in layouts.items():
            tb = best_of(lambda h=host, p=pages: h.backup(p, host_pages), args.repeats)
            snapshot = host.buffer[1:args.pages + 1].clone()
            tl = best_of(lambda h=host, p=pages: h.load(host_pages, p), args.repeats)
            host.buffer[1:args.pages + 1].zero_()
            host.backup(pages, host_pages)  # the round trip is exact
            assert torch.equal(host.buffer[1:args.pages + 1], snapshot)
            print(f"| {path} | {name} | {mb:.1f} | {tb * 1e3:.1f} | {mb / 1e3 / tb:.2f} | {tl * 1e3:.1f} | "
                  f"{mb / 1e3 / tl:.2f} |")


if __name__ == "__main__":
    main()

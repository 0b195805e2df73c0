"""A/B of the GGUF linear kernels: the C sources of a git revision against the working tree's,
built side by side and run on the same packed weights in one process (so the ratio is measured
in one run, on one machine state).

    python benchmarks/bench_kernel_ab.py --rev HEAD --types Q4_1,Q8_0 --m 1,3,4,8 [--threads 2]

Prints per (type, shape, m): both times, GFLOP/s, new/old (< 1: the working tree is faster)
and the largest relative difference between the two outputs.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_gguf_kernels import SHAPES, random_blocks
from radixserve.kernels import cpu
from radixserve.kernels.gguf import GGUFMatrix

KERNELS = Path(cpu.__file__).parent
REPO = KERNELS.parents[3]


def build(src_dir: Path, out: Path) -> cpu.CpuKernels:
    srcs = sorted(src_dir.glob("*.c"))
    subprocess.run(["cc", *cpu._FLAGS, f"-I{src_dir}", "-o", str(out), *map(str, srcs), "-lm"], check=True)
    return cpu.CpuKernels(out)


def main() -> None:
    import gguf

    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD", help="git revision of the 'old' kernels")
    ap.add_argument("--types", default="Q4_1,Q8_0")
    ap.add_argument("--m", default="1,3,4,8")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="rs-kernel-ab-"))
    rel = KERNELS.relative_to(REPO)
    for f in KERNELS.iterdir():
        if f.suffix in (".c", ".h"):
            blob = subprocess.run(["git", "-C", str(REPO), "show", f"{args.rev}:{rel / f.name}"],
                                  capture_output=True, check=True).stdout
            (tmp / f.name).write_bytes(blob)
    old, new = build(tmp, tmp / "old.so"), build(KERNELS, tmp / "new.so")
    rng = np.random.default_rng(0)
    for tname in args.types.split(","):
        qt = getattr(gguf.GGMLQuantizationType, tname)
        for name, n, k in SHAPES:
            raw = torch.from_numpy(random_blocks(qt, n, k, rng))
            mats = {"old": GGUFMatrix.prepare(old, int(qt), raw, k), "new": GGUFMatrix.prepare(new, int(qt), raw, k)}
            for m in (int(x) for x in args.m.split(",")):
                x = torch.randn(m, k)
                ya, yb = mats["old"].linear(x), mats["new"].linear(x)
                diff = ((ya - yb).abs().max() / ya.abs().max()).item()
                reps = max(3, int(2e8 / (n * k * m)))
                best = dict.fromkeys(mats, float("inf"))
                for _ in range(5):  # interleaved bursts: both see the same machine state
                    for key, mat in mats.items():
                        t = time.perf_counter()
                        for _ in range(reps):
                            mat.linear(x)
                        best[key] = min(best[key], (time.perf_counter() - t) / reps)
                gf = {key: 2 * n * k * m / s / 1e9 for key, s in best.items()}
                print(f"{tname} {name:8s} m={m}: old {best['old'] * 1e6:8.1f} us ({gf['old']:5.1f} GF/s)  "
                      f"new {best['new'] * 1e6:8.1f} us ({gf['new']:5.1f} GF/s)  "
                      f"new/old {best['new'] / best['old']:.2f}  diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()

"""A/B of radixserve's C kernels: the C sources of a git revision against the working tree's,
built side by side and run on the same inputs in one process (so the ratio is measured in one
run, on one machine state).

    python benchmarks/bench_kernel_ab.py --rev HEAD --types Q4_1,Q8_0 --m 1,3,4,8 [--threads 2]
    python benchmarks/bench_kernel_ab.py --rev HEAD --attention 1x300,8x300,1x1000,8x1000

GGUF linears: per (type, shape, m) both times, GFLOP/s, new/old (< 1: the working tree is
faster) and the largest relative difference between the two outputs. ``--attention BxL``:
paged decode attention (the torch_native attention plugin's ``decode_attention.c``; in the core's
sources at revisions before it moved there) of one layer of the default model (9 query heads, 3 KV heads, head
size 64) for B rows over L cached keys each (B > 1: the rows of a verify tree, row i seeing
L + i keys), instead of the linears.
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
ATTENTION_SRC = Path("plugins/attention/torch_native/src/radixserve_attention_torch/decode_attention.c")


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
    ap.add_argument("--attention", default=None, help="comma list of BxL: decode attention instead of linears")
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
    if args.attention:
        from radixserve_attention_torch.kernel import DecodeAttentionKernel

        def attention_lib(core: cpu.CpuKernels, src: Path | None, header_dir: Path, out: Path):
            if src is None:  # the kernel was still in the core's library
                return DecodeAttentionKernel(core.lib)
            subprocess.run(["cc", *cpu._FLAGS, f"-I{header_dir}", "-o", str(out), str(src), "-lm"], check=True)
            import ctypes

            return DecodeAttentionKernel(ctypes.CDLL(str(out)))

        shown = subprocess.run(["git", "-C", str(REPO), "show", f"{args.rev}:{ATTENTION_SRC}"], capture_output=True)
        old_src = None
        if shown.returncode == 0:
            old_src = tmp / "decode_attention.c"
            old_src.write_bytes(shown.stdout)
        old = attention_lib(old, old_src, tmp, tmp / "old_attn.so")
        new = attention_lib(new, REPO / ATTENTION_SRC, KERNELS, tmp / "new_attn.so")
        for case in args.attention.split(","):
            b, length = (int(v) for v in case.split("x"))
            attention_ab(old, new, b, length)
        return
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
                best = interleaved_best({key: (lambda mat=mat, x=x: mat.linear(x)) for key, mat in mats.items()},
                                        max(3, int(2e8 / (n * k * m))))
                gf = {key: 2 * n * k * m / s / 1e9 for key, s in best.items()}
                print(f"{tname} {name:8s} m={m}: old {best['old'] * 1e6:8.1f} us ({gf['old']:5.1f} GF/s)  "
                      f"new {best['new'] * 1e6:8.1f} us ({gf['new']:5.1f} GF/s)  "
                      f"new/old {best['new'] / best['old']:.2f}  diff {diff:.1e}", flush=True)


def interleaved_best(fns: dict, reps: int) -> dict:
    """Seconds per call of each function: the best of five bursts, the functions taking turns."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(5):
        for key, fn in fns.items():
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            best[key] = min(best[key], (time.perf_counter() - t) / reps)
    return best


def attention_ab(old, new, b: int, length: int, h: int = 9, hkv: int = 3, d: int = 64) -> None:
    g = torch.Generator().manual_seed(0)
    k_buf, v_buf = torch.randn(length + b + 1, hkv, d, generator=g), torch.randn(length + b + 1, hkv, d, generator=g)
    table = torch.zeros(b, length + b, dtype=torch.int64)
    for i in range(b):
        table[i, :length + i + 1] = torch.arange(length + i + 1)
    rows, lens = torch.arange(b), torch.tensor([length + i + 1 for i in range(b)])
    loc = lens - 1
    q = torch.randn(b, h, d, generator=g)
    k, v = torch.randn(b, hkv, d, generator=g), torch.randn(b, hkv, d, generator=g)
    libs = {"old": old, "new": new}
    outs = {key: lib.decode_attention(q, k, v, k_buf, v_buf, loc, table, rows, lens, 0.125)
            for key, lib in libs.items()}
    diff = ((outs["old"] - outs["new"]).abs().max() / outs["old"].abs().max()).item()
    best = interleaved_best({key: (lambda lib=lib: lib.decode_attention(q, k, v, k_buf, v_buf, loc, table, rows, lens,
                                                                        0.125)) for key, lib in libs.items()},
                            max(20, int(2e6 / (b * length))))
    print(f"attention b={b} keys={length}: old {best['old'] * 1e6:7.1f} us  new {best['new'] * 1e6:7.1f} us  "
          f"new/old {best['new'] / best['old']:.2f}  diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()

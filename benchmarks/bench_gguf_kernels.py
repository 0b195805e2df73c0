"""GGUF-quantized linear kernels vs the float32 panel path on the same (dequantised) weight.

For the default model's layer shapes (N, K) and batch sizes M, prints the time of
``GGUFMatrix.linear`` per quantization type and the float32 ``kernels.linear`` on
``dequantize(data)`` packed by ``kernels.pack``, and the ratio float32 / GGUF (> 1: the
quantized kernel is faster). Threads: ``torch.set_num_threads(2)`` like the engine.

    python benchmarks/bench_gguf_kernels.py [--types Q4_1,Q8_0] [--m 1,32] [--threads 2]
    python benchmarks/bench_gguf_kernels.py --threads 1 --cpu-time   # on a busy machine

Run it on a quiet machine (``uptime`` load < 1.5): the times are the fastest of short bursts.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

SHAPES = [("gate/up", 1536, 576), ("down", 576, 1536), ("q/o", 576, 576), ("lm_head", 49152, 576)]
ALL_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def random_blocks(qtype, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF rows [N, row_bytes]: quantized normal weights where gguf can quantize, else
    random bytes with sane float16 scales (the K-quants)."""
    import gguf
    from gguf.quants import quantize

    t = gguf.GGMLQuantizationType
    if qtype in (t.Q4_K, t.Q5_K, t.Q6_K):
        bs, ts = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(n, k // bs, ts), dtype=np.uint8)
        for off in ((208,) if qtype == t.Q6_K else (0, 2)):
            raw[..., off:off + 2] = rng.uniform(1e-3, 1e-2, (n, k // bs, 1)).astype(np.float16).view(np.uint8)
        return raw.reshape(n, -1)
    return quantize(rng.standard_normal((n, k)).astype(np.float32) / k**0.5, qtype)


def timeit(fn, budget_s: float = 0.3, clock=time.perf_counter) -> float:
    """Seconds per call: the fastest of ~15 short bursts (robust to a neighbour's load
    spikes; on a busy machine an OpenMP region can still wait out a descheduled thread)."""
    fn()
    t0 = clock()
    fn()
    one = max(clock() - t0, 1e-6)
    reps = max(1, min(200, int(budget_s / 15 / one)))
    samples = []
    for _ in range(15):
        t0 = clock()
        for _ in range(reps):
            fn()
        samples.append((clock() - t0) / reps)
    return min(samples)


def main() -> None:
    import gguf
    from gguf.quants import dequantize
    from radixserve.kernels import cpu
    from radixserve.kernels.gguf import GGUFMatrix

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=",".join(ALL_TYPES))
    ap.add_argument("--m", default="1,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true",
                    help="with --threads 1: time by this thread's CPU time (a busy machine's preemptions excluded)")
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        raise SystemExit("--cpu-time measures one thread: use it with --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    kernels = cpu.load()
    if kernels is None:
        raise SystemExit(f"CPU kernels unavailable: {cpu.status()}")
    rng = np.random.default_rng(0)
    ms = [int(v) for v in args.m.split(",")]
    print(f"threads={args.threads}{' (CPU time)' if args.cpu_time else ''}; time per call in us; "
          "ratio = float32 time / GGUF time")
    print(f"{'type':6} {'layer':8} {'N':>6} {'K':>5} {'M':>4} {'gguf_us':>9} {'f32_us':>9} {'ratio':>6} "
          f"{'MB q/f32':>10}")
    for name in args.types.split(","):
        qtype = gguf.GGMLQuantizationType[name]
        for layer, n, k in SHAPES:
            if k % gguf.GGML_QUANT_SIZES[qtype][0]:
                print(f"{name:6} {layer:8} {n:6} {k:5}    - (K is not a multiple of the type's block)")
                continue
            raw = random_blocks(qtype, n, k, rng)
            mat = GGUFMatrix.prepare(kernels, int(qtype), torch.from_numpy(raw), k)
            w = torch.from_numpy(dequantize(raw, qtype).astype(np.float32))
            packed = kernels.pack(w)
            for m in ms:
                x = torch.randn(m, k)
                tq = timeit(lambda mat=mat, x=x: mat.linear(x), clock=clock)
                tf = timeit(lambda x=x, packed=packed, n=n: kernels.linear(x, packed, None, n), clock=clock)
                print(f"{name:6} {layer:8} {n:6} {k:5} {m:4} {tq * 1e6:9.1f} {tf * 1e6:9.1f} {tf / tq:6.2f} "
                      f"{mat.nbytes() / 2**20:5.1f}/{packed.numel() * 4 / 2**20:.0f}", flush=True)


if __name__ == "__main__":
    main()

"""Compile the LoRA kernels ahead of time for a GPU architecture, without a GPU (the interpreter
forgives what the compiler refuses), and report each one's shared memory::

    TRITON_INTERPRET= python -m radixserve_lora_triton.compile_check --arch 90 --dtype bf16 fp32
"""

from __future__ import annotations

import argparse
import sys

from radixserve.plugin_api.kernels import compile_for_arch, interpreter_enabled

_DTYPES = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


def compile_kernels(arch: int, dtype: str, block_m: int, rank: int) -> dict[str, int]:
    """Shared memory in bytes of each kernel for ``sm_<arch>``, activations and stacks in ``dtype``."""
    from radixserve_lora_triton import kernels
    from radixserve_lora_triton.backend import _pow2_at_least_16

    ptr = f"*{_DTYPES[dtype]}"
    index = {"rows_ptr": "*i32", "blocks_ptr": "*i32"}
    options = dict(num_warps=4, enable_fp_fusion=True)
    jobs = {
        "shrink": (kernels.shrink_kernel,
                   {"x_ptr": ptr, "a_ptr": ptr, "h_ptr": "*fp32", "scaling_ptr": "*fp32", **index},
                   dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64), options),
        "expand": (kernels.expand_kernel,
                   {"h_ptr": "*fp32", "b_ptr": ptr, "out_ptr": ptr, **index},
                   dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_R=_pow2_at_least_16(rank, 64)), options),
    }
    return compile_for_arch(jobs, arch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90], help="sm versions, e.g. 80 90")
    parser.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(_DTYPES))
    parser.add_argument("--block-m", type=int, nargs="+", default=[16, 64], help="rows per block (16, 32, 64)")
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args(argv)
    if interpreter_enabled():
        print("compile_check: unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    for arch in args.arch:
        for dtype in args.dtype:
            for bm in args.block_m:
                shared = compile_kernels(arch, dtype, bm, args.rank)
                print(f"sm_{arch} {dtype} block_m={bm} rank={args.rank}: shared memory "
                      + ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in shared.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

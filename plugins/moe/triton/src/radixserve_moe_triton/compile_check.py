"""Compile the kernels ahead of time for a GPU architecture, without a GPU.

The interpreter runs kernels as Python and forgives what the compiler refuses (globals
that are not constexpr, branches that change a value's type, tiles too large for shared
memory). This builds each kernel, with each block configuration of
:func:`~radixserve_moe_triton.fused_moe.choose_config`, for a target with Triton's own
toolchain (LLVM and the bundled ptxas) and reports the shared memory each needs::

    TRITON_INTERPRET= python -m radixserve_moe_triton.compile_check --arch 80 90
"""

from __future__ import annotations

import argparse
import sys

from radixserve.plugin_api.kernels import compile_for_arch, interpreter_enabled

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: a representative number of pairs per expert for each row of choose_config's table
_LOADS = {"decode": 1, "mid": 32, "prefill": 1024}


def compile_kernels(arch: int, dtype: str, load: int) -> dict[str, int]:
    """Shared memory in bytes of each kernel compiled for ``sm_<arch>``, with the block
    configuration chosen for ``load`` pairs per expert."""
    import torch

    from radixserve_moe_triton import kernels
    from radixserve_moe_triton.fused_moe import choose_config

    if kernels.INTERPRETED:
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    cfg = choose_config(load * 64, 64, getattr(torch, _DTYPES[dtype]))
    ptr = f"*{dtype}"
    align = {"Sorted_pairs": "*i32", "Expert_ids": "*i32", "Num_post_padded": "*i32"}
    gemm_consts = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                       GROUP_M=cfg.group_m, UPCAST=False)
    gemm_options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True)
    jobs = {
        "gate_up": (kernels.gate_up_kernel,
                    {**align, **dict.fromkeys(("X", "W13", "Inter"), ptr)},
                    gemm_consts, gemm_options),
        "down": (kernels.down_kernel,
                 {**align, **dict.fromkeys(("Inter", "W2", "Y"), ptr), "Topk_weights": "*fp32"},
                 gemm_consts, gemm_options),
        "combine": (kernels.combine_kernel,
                    {"Y": ptr, "Out": ptr, "Topk_ids": "*i32"},
                    dict(BLOCK_T=4, BLOCK_H=1024), dict(num_warps=4, enable_fp_fusion=True)),
    }
    return compile_for_arch(jobs, arch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90], help="sm versions, e.g. 80 90")
    parser.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(_DTYPES))
    parser.add_argument("--config", nargs="+", default=sorted(_LOADS), choices=sorted(_LOADS),
                        help="rows of choose_config's table")
    args = parser.parse_args(argv)
    if interpreter_enabled():
        print("compile_check: unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    for arch in args.arch:
        for dtype in args.dtype:
            for name in args.config:
                shared = compile_kernels(arch, dtype, _LOADS[name])
                sizes = "  ".join(f"{k} {v / 1024:.0f} KiB" for k, v in shared.items())
                print(f"sm_{arch} {dtype} {name}: shared memory {sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

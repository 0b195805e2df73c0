"""Compile the kernels ahead of time for a GPU architecture, without a GPU.

The interpreter runs kernels as Python and forgives what the compiler refuses (globals
that are not constexpr, branches that change a value's type, tiles too large for shared
memory). This builds each kernel for a target with Triton's own toolchain (LLVM and the
bundled ptxas) and reports the shared memory each needs::

    TRITON_INTERPRET= python -m radixserve_attention_triton.compile_check --arch 90
"""

from __future__ import annotations

import argparse
import sys

from radixserve.plugin_api.kernels import compile_for_arch, interpreter_enabled

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def compile_kernels(arch: int, dtype: str, head_dim: int, group: int,
                    mla_latent: int | None = None) -> dict[str, int]:
    """Shared memory in bytes of each kernel compiled for ``sm_<arch>``; with ``mla_latent``,
    the MLA (absorbed) variants: one latent KV head of ``head_dim`` dims whose first
    ``mla_latent`` are V."""
    import torch
    from radixserve.plugin_api.attention import AttentionLayer

    from radixserve_attention_triton import kernels
    from radixserve_attention_triton.backend import KernelConfig, _block_d, _Dims

    if kernels.INTERPRETED:
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    dims = _Dims.of(AttentionLayer(0, group, 1, head_dim, 1.0, v_head_dim=mla_latent), v_in_k=True)
    cfg = KernelConfig.for_device(torch.device("cuda"), dims.v, getattr(torch, _DTYPES[dtype]))
    ptr = f"*{dtype}"
    tables = {"Req_to_token": "*i64", "Req_pool_indices": "*i64", "scale_log2": "fp32"}
    extend_types = {
        **tables,
        **dict.fromkeys(("Q", "K_new", "V_new", "Out", "K_buf", "V_buf"), ptr),
        "Prefix_lens": "*i32",
        "Extend_lens": "*i32",
        "Qo_start": "*i32",
        "Mask_offsets": "*i32",
        "Tree_mask": "*i32",  # plain extend: a placeholder, never read
        "Positions": "*i64",
    }
    extend_consts = dict(
        GROUP=group,
        BLOCK_M=cfg.extend_block_m,
        BLOCK_N=cfg.extend_block_n,
        UPCAST=False,
        **dims.constexprs(),
    )
    extend_options = dict(
        num_warps=cfg.extend_warps, num_stages=cfg.extend_stages, enable_fp_fusion=True
    )
    jobs = {
        "extend": (
            kernels.extend_kernel,
            extend_types,
            dict(extend_consts, TREE=False),
            extend_options,
        ),
        "extend_verify": (  # target verify: the tree-mask path
            kernels.extend_kernel,
            dict(extend_types, Tree_mask="*u8"),
            dict(extend_consts, TREE=True),
            extend_options,
        ),
        "decode_stage1": (
            kernels.decode_stage1_kernel,
            {
                **tables,
                **dict.fromkeys(("Q", "K_buf", "V_buf"), ptr),
                "Seq_lens": "*i64",
                "Num_splits": "*i32",
                "Mid_o": "*fp32",
                "Mid_lse": "*fp32",
            },
            dict(
                GROUP=group,
                BLOCK_H=cfg.decode_block_h,
                BLOCK_N=cfg.decode_block_n,
                UPCAST=False,
                **dims.constexprs(),
            ),
            dict(num_warps=cfg.decode_warps, num_stages=cfg.decode_stages, enable_fp_fusion=True),
        ),
        "decode_stage2": (
            kernels.decode_stage2_kernel,
            {
                "Mid_o": "*fp32",
                "Mid_lse": "*fp32",
                "Out": ptr,
                "Seq_lens": "*i64",
                "Num_splits": "*i32",
            },
            dict(HEAD_DIM=dims.v, BLOCK_D=_block_d(dims.v), BLOCK_S=16),
            dict(num_warps=4, enable_fp_fusion=True),
        ),
    }
    return compile_for_arch(jobs, arch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90], help="sm versions, e.g. 80 90")
    parser.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(_DTYPES))
    parser.add_argument("--head-dim", type=int, nargs="+", default=[128])
    parser.add_argument("--group", type=int, nargs="+", default=[8], help="query heads per KV head")
    parser.add_argument("--mla-latent", type=int, default=None,
                        help="MLA: V is the first N of head_dim dims (DeepSeek: --head-dim 576 --mla-latent 512)")
    args = parser.parse_args(argv)
    if interpreter_enabled():
        print("compile_check: unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    for arch in args.arch:
        for dtype in args.dtype:
            for dim in args.head_dim:
                for group in args.group:
                    shared = compile_kernels(arch, dtype, dim, group, args.mla_latent)
                    sizes = "  ".join(f"{k} {v / 1024:.0f} KiB" for k, v in shared.items())
                    mla = f" mla_latent={args.mla_latent}" if args.mla_latent else ""
                    print(f"sm_{arch} {dtype} head_dim={dim}{mla} group={group}: shared memory {sizes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

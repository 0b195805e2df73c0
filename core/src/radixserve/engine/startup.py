"""Start-up checks of the flags an Engine cannot honour or must resolve itself."""

from __future__ import annotations

from radixserve.config import ConfigError, ServerArgs
from radixserve.registry import KINDS, Registry


def check_optional_backends(args: ServerArgs, registry: Registry) -> None:
    """Backends of kinds the engine does not use yet must still name something installed."""
    for kind in KINDS.values():
        for flag in kind.flags:
            if kind.name in ("attention", "grammar", "speculative", "lora"):  # resolved by the engine itself
                continue
            value = getattr(args, flag[2:].replace("-", "_"))
            if value is not None:
                registry.resolve(kind.name, value, flag=flag)


def check_parallel_supported(args: ServerArgs) -> None:
    """Parallel flags the engine cannot honour yet fail at start-up, naming the flag (and the
    flags LoRA adapters cannot run with yet)."""
    from radixserve.engine.lora import check_lora_supported

    check_lora_supported(args)
    if args.enable_dp_attention and args.dp_size > 1:
        other = {"--pp-size": args.pp_size > 1, "--attn-cp-size": args.attn_cp_size > 1,
                 "--disaggregation-mode": args.disaggregation_mode != "null",
                 "--speculative-algorithm": args.speculative_algorithm is not None,
                 "--enable-hierarchical-cache": args.enable_hierarchical_cache}
        for flag, on in other.items():
            if on:
                raise ConfigError(f"{flag} with --enable-dp-attention: not with DP attention yet (its requests' KV "
                                  "lives in one attention group's pools); drop one of the two")
    elif args.dp_size != 1:
        raise ConfigError(f"--dp-size {args.dp_size}: an Engine runs one replica of the model; data parallelism "
                          f"is a server feature: run `radixserve serve --dp-size {args.dp_size}` (replicas behind "
                          "a cache-aware router)")
    if args.node_rank != 0:
        raise ConfigError(f"--node-rank {args.node_rank}: only node 0 runs the engine; start the other nodes with "
                          f"`radixserve serve --nnodes {args.nnodes} --node-rank R --dist-init-addr HOST:PORT`")
    if args.pp_size > 1:
        not_yet = {"--ep-size": args.ep_size > 1, "--disaggregation-mode": args.disaggregation_mode != "null",
                   "--speculative-algorithm EAGLE3": (args.speculative_algorithm or "").upper() in ("EAGLE3", "EAGLE")}
        for flag, on in not_yet.items():
            if on:
                raise ConfigError(f"{flag} with --pp-size {args.pp_size}: not with pipeline parallelism yet (expert "
                                  "groups, KV transfer and EAGLE's hidden-state capture span one stage); use "
                                  "--tp-size instead of --pp-size, or drop the flag")
    if args.enable_two_batch_overlap:
        other = {"--enable-dp-attention": args.enable_dp_attention and args.dp_size > 1, "--pp-size": args.pp_size > 1,
                 "--attn-cp-size": args.attn_cp_size > 1}
        for flag, on in other.items():
            if on:
                raise ConfigError(f"--enable-two-batch-overlap with {flag}: not yet (its micro-batches split one "
                                  "tensor-parallel step); drop one of the two")
    if args.attn_cp_size > 1:
        other = {"--tp-size": args.tp_size > 1, "--pp-size": args.pp_size > 1, "--ep-size": args.ep_size > 1,
                 "--disaggregation-mode": args.disaggregation_mode != "null"}
        for flag, on in other.items():
            if on:
                raise ConfigError(f"{flag} with --attn-cp-size {args.attn_cp_size}: context parallelism runs over "
                                  "whole-model ranks only so far; use one of the two")


def check_mla_supported(args: ServerArgs, architecture: str) -> None:
    """Flags an MLA model (DeepSeek's latent KV cache) cannot run with yet fail at start-up, naming them."""
    not_yet = {"--attn-cp-size": args.attn_cp_size > 1, "--disaggregation-mode": args.disaggregation_mode != "null"}
    for flag, on in not_yet.items():
        if on:
            raise ConfigError(f"{flag} with {architecture}: not with MLA's latent KV cache yet (the ring and the KV "
                              "transfer move separate K and V heads); drop the flag")

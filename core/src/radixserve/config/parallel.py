"""Engine flags: tensor, expert and data parallelism, nodes, the MoE runner and transport,
expert placement and load recording."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config.common import Checks, flag
from radixserve.flags import ConfigError

EXPERT_DISTRIBUTION_MODES = ("stat", "per_pass")


@dataclass
class ParallelArgs(Checks):
    tp_size: int = flag(
        1,
        "tensor-parallel ranks of one model replica (weights and KV heads split; one all-reduce per "
        "attention and MLP block)",
    )
    ep_size: int = flag(
        1,
        "expert-parallel groups inside the tensor-parallel ranks: experts split over ep_size, each "
        "expert over tp_size / ep_size (divides --tp-size)",
    )
    pp_size: int = flag(
        1,
        "pipeline-parallel stages of one replica: the layers split into contiguous stages of --tp-size ranks "
        "each (evenly, or as SGLANG_PP_LAYER_PARTITION=n0,n1,... says), activations passed stage to stage",
    )
    pp_max_micro_batch_size: int | None = flag(
        None,
        "pipeline parallel: most requests in one micro-batch (a step's batch is split into micro-batches that "
        "follow each other through the stages, so the stages overlap); default: the batch split in --pp-size",
    )
    attn_cp_size: int = flag(
        1,
        "context-parallel ranks: each holds the whole model, a long prefill's tokens are split over them "
        "and attention passes K/V around the ring; decode runs on every rank as on one",
    )
    dp_size: int = flag(
        1,
        "data-parallel replicas of the whole model behind a cache-aware router; with --enable-dp-attention, "
        "attention groups inside one replica of --tp-size ranks instead",
    )
    enable_dp_attention: bool = flag(
        False,
        "DP attention for MoE models: the --tp-size ranks form --dp-size attention groups, each holding its own "
        "requests' KV and running their attention (split over tp_size / dp_size ranks), while MoE layers run "
        "expert-parallel over all ranks on every group's tokens",
    )
    nnodes: int = flag(1, "machines one replica's ranks span (ranks split evenly over the nodes)")
    node_rank: int = flag(0, "this machine's index among --nnodes (0 runs the scheduler and the server)")
    dist_init_addr: str | None = flag(
        None,
        "HOST:PORT of the torch.distributed rendezvous (node 0), served on HOST's interface only; "
        "default: a free port on 127.0.0.1",
    )
    dist_timeout: float = flag(60.0, "seconds a collective may wait for a peer before the ranks give up")
    ep_num_redundant_experts: int = flag(
        0,
        "extra physical copies of the hottest experts (EPLB), placed from --init-expert-location",
    )
    init_expert_location: str | None = flag(
        None,
        "expert distribution record (a JSON file from the expert distribution recorder) that places "
        "experts and their redundant copies",
    )
    moe_runner_backend: str | None = flag(None, "MoE runner backend")
    moe_a2a_backend: str | None = flag(None, "MoE all-to-all transport")
    enable_two_batch_overlap: bool = flag(
        False,
        "two-batch overlap: a MoE model's step (two requests or more) runs as two micro-batches whose layers "
        "interleave, so one's dispatch and combine travel while the other computes; needs MoE layers on several "
        "ranks (--tp-size/--ep-size), not with DP attention, PP or CP; the same tokens",
    )
    enable_single_batch_overlap: bool = flag(
        False,
        "single-batch overlap: a MoE block with shared experts (DeepSeek, Qwen2-MoE) computes them while its "
        "routed tokens are dispatched (the transport's asynchronous dispatch; torch_distributed's rows travel "
        "meanwhile); the same tokens",
    )
    expert_distribution_recorder_mode: str | None = flag(
        None,
        "record the MoE expert load from launch: per layer and expert over the run (stat) or also per"
        " forward pass (per_pass); written as JSON on /dump_expert_distribution_record and at "
        "shutdown",
    )
    expert_distribution_recorder_dir: str | None = flag(
        None,
        "directory of the expert distribution files (default: the working directory)",
    )
    expert_distribution_recorder_buffer_size: int = flag(
        1000,
        "per_pass: most forward passes kept (the oldest dropped first)",
    )

    @property
    def attn_dp_size(self) -> int:
        """DP attention's groups inside the replica (1 without --enable-dp-attention)."""
        return self.dp_size if self.enable_dp_attention else 1

    @property
    def world_size(self) -> int:
        """Ranks of one replica: --tp-size ranks in each of --pp-size stages (or --attn-cp-size slices)."""
        return self.tp_size * self.pp_size * self.attn_cp_size

    def check_parallel(self) -> None:
        for name in ("tp_size", "pp_size", "attn_cp_size", "ep_size", "dp_size", "nnodes"):
            self._check_int(name, minimum=1)
        if self.pp_max_micro_batch_size is not None:
            self._check_int("pp_max_micro_batch_size", minimum=1)
        self._check_int("node_rank", minimum=0)
        self._check_int("ep_num_redundant_experts", minimum=0)
        if self.tp_size % self.ep_size:
            raise ConfigError(f"--ep-size {self.ep_size} must divide --tp-size {self.tp_size} (experts are "
                              "split inside the tensor-parallel ranks)")
        if self.enable_dp_attention and self.tp_size % self.dp_size:
            raise ConfigError(f"--dp-size {self.dp_size} must divide --tp-size {self.tp_size} with "
                              "--enable-dp-attention (each attention group has tp_size / dp_size ranks)")
        if self.node_rank >= self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be < --nnodes {self.nnodes}")
        if self.world_size % self.nnodes:
            raise ConfigError(f"--nnodes {self.nnodes} must divide --tp-size {self.tp_size} x --pp-size "
                              f"{self.pp_size} (each node runs the same number of ranks)")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, reachable "
                              "from every node)")
        self._check_seconds("dist_timeout")
        if self.ep_num_redundant_experts and not self.init_expert_location:
            raise ConfigError("--ep-num-redundant-experts needs --init-expert-location (a recorded expert "
                              "distribution that says which experts are hottest)")
        mode = self.expert_distribution_recorder_mode
        if mode is not None and mode not in EXPERT_DISTRIBUTION_MODES:
            raise ConfigError(f"--expert-distribution-recorder-mode: invalid value {mode!r}; choose from: "
                              f"{', '.join(EXPERT_DISTRIBUTION_MODES)}")
        self._check_int("expert_distribution_recorder_buffer_size", minimum=1)

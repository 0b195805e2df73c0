"""Target-verify steps of speculative decoding replayed as kernel tapes on CPU.

A verify step computes the nodes of each request's draft tree (:mod:`radixserve.speculative`).
An attention backend that runs it as decode rows (torch_native's kernel: every tree node
attends over its request's prefix and its own ancestors) makes the rows independent, so
a recorded verify forward depends only on how many nodes it computes: one tape per node
count (1 to ``VERIFY_MAX_NODES``), recorded when a step first has that many, whatever the
requests and trees. Per step the runner copies the nodes' token ids, positions and slots
into its static buffers, and the backend rewrites its node table in place
(``init_forward_metadata_replay_cuda_graph`` on a TARGET_VERIFY batch); then the tape
replays. Steps that keep hidden states (EAGLE3), steps with more nodes and backends
without graph support run eagerly.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

import torch

from radixserve.kernels import tape as kernel_tape
from radixserve.layers.attention import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

VERIFY_MAX_NODES = 32


class VerifyTapeRunner:
    """Kernel tapes of verify forwards, one per node count, recorded when first needed."""

    def __init__(self, runner, capturer, max_nodes: int = VERIFY_MAX_NODES) -> None:
        self.runner, self.capturer, self.max_nodes = runner, capturer, max_nodes
        self.backend = runner.attn_backend
        dev = runner.device
        self.input_ids = torch.zeros(max_nodes, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_nodes, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(max_nodes, dtype=torch.int64, device=dev)
        self.logits_indices = torch.arange(max_nodes, device=dev)
        self.backend.init_cuda_graph_state(max_nodes)  # its node table: one row per node
        self.graphs: dict[int, object] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.failed: set[int] = set()
        self.replays: Counter[int] = Counter()

    def can_run(self, batch: ForwardBatch) -> bool:
        n = batch.input_ids.shape[0]
        return (batch.mode is ForwardMode.TARGET_VERIFY and not batch.capture_hidden_layers
                and not batch.capture_final_hidden and n <= self.max_nodes and n not in self.failed)

    def _static_batch(self, n: int) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            mode=ForwardMode.TARGET_VERIFY, batch_size=1, input_ids=self.input_ids[:n], positions=self.positions[:n],
            req_pool_indices=torch.zeros(1, dtype=torch.int64, device=r.device),
            seq_lens=torch.full((1,), n, dtype=torch.int64, device=r.device), out_cache_loc=self.out_cache_loc[:n],
            seq_lens_cpu=[n], prefix_lens_cpu=[0], extend_lens_cpu=[n], req_to_token=r.req_to_token_pool.req_to_token,
            kv_pool=r.kv_pool, logits_indices=self.logits_indices[:n],
            tree_mask=torch.ones(n * n, dtype=torch.bool, device=r.device), tree_mask_offsets_cpu=[0])

    def _capture(self, n: int) -> bool:
        for t in (self.input_ids, self.positions, self.out_cache_loc):  # the recording writes scratch slot 0
            t.zero_()
        batch = self._static_batch(n)
        self.backend.init_forward_metadata_capture_cuda_graph(batch)
        model = self.runner.model
        try:
            self.graphs[n] = self.capturer.capture(lambda: model(batch), batch)
        except kernel_tape.TapeError as exc:
            logger.warning("recording the verify tape of %d nodes failed (%s); such steps run eagerly", n, exc)
            self.failed.add(n)
            return False
        self.batches[n] = batch
        return True

    def replay(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits ``# [nodes, V]`` of a verify ``batch`` (``can_run`` must hold); None: run it eagerly."""
        n = batch.input_ids.shape[0]
        if n not in self.graphs and not self._capture(n):
            return None
        sb = self.batches[n]
        sb.input_ids.copy_(batch.input_ids)
        sb.positions.copy_(batch.positions)
        sb.out_cache_loc.copy_(batch.out_cache_loc)
        # the real requests and trees, over the static inputs and the static metadata
        view = dataclasses.replace(batch, input_ids=sb.input_ids, positions=sb.positions,
                                   out_cache_loc=sb.out_cache_loc, logits_indices=sb.logits_indices,
                                   attn_metadata=sb.attn_metadata)
        if self.backend.init_forward_metadata_replay_cuda_graph(view) is False:
            return None
        graph = self.graphs[n]
        graph.replay()
        self.replays[n] += 1
        batch.attn_metadata = sb.attn_metadata
        return graph.output.clone()

    def stats(self) -> dict:
        return {"verify_tape_replays": sum(self.replays.values()),
                "verify_tape_replays_by_nodes": dict(sorted(self.replays.items()))}

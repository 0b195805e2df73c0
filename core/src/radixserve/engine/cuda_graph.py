"""CUDA-graph capture of decode steps (``--cuda-graph-max-bs``, ``--cuda-graph-bs``,
``--disable-cuda-graph``, ``--disable-cuda-graph-padding``).

A decode step of a small batch launches hundreds of tiny kernels; on a GPU their launch
cost, not the math, sets the step time. The runner captures the model's decode forward
once per *bucket* batch size into a CUDA graph and replays it: a step of ``b`` requests
copies its inputs into the bucket's static buffers (the smallest bucket >= ``b``), fills
the rows past ``b`` with padding that points at the KV pool's scratch slot 0, lets the
attention backend rewrite its metadata in place, replays, and returns the first ``b``
rows of the captured logits.

On CPU the same runner replays *kernel tapes* instead (:class:`TapeCapturer`,
:mod:`radixserve.kernels.tape`): there the cost to remove is the Python between ~120 kernel
calls per step, and a tape replays the recorded calls from C. On CPU every batch size up to
32 (``DEFAULT_CPU_MAX_BS``) is its own bucket, recorded when first needed; past 32 the Python
is a few percent of a step. The smallest bucket is recorded at start-up over scratch inputs and
checked against the eager forward with other inputs; every later one is recorded over the
live step that first needs it, so that recording is the step's own forward: a new size costs
the recording and one checking replay, not a scratch recording, an eager check and three
replays (BENCHMARKS.md, "Decode tapes recorded over the live step"). Speculative verify steps replay tapes too
(:mod:`radixserve.engine.verify_graph`).

What is captured: ``model(batch)`` over a decode batch whose tensors are the runner's
static buffers. What is not: the attention metadata (the backend's capture/replay hooks
run before, outside the graph, see :class:`radixserve.layers.attention.AttentionBackend`),
sampling, and everything the scheduler does. Steps the graphs cannot run go eagerly:
extend/mixed/verify batches, batches larger than the largest bucket, batches that keep
hidden states for a speculative proposer, multi-rank replicas.

How a graph is captured and replayed is a :class:`GraphCapturer`: :class:`CudaGraphCapturer`
on a GPU; :class:`FakeGraphCapturer` replays by running the captured function again
(tests on CPU: the bucketing, the padding and the static buffers are the same code).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels import tape as kernel_tape
from radixserve.layers.attention import AttentionBackend, ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

# SGLang's bucket ladder: every size up to 4, then 8, then steps of 8
_LADDER = [1, 2, 4, 8, *range(16, 1025, 8)]
DEFAULT_MAX_BS = 160
# On CPU every size is its own bucket: a padded row costs as much as a real one there, and
# a kernel's per-row arithmetic may depend on how many rows it gets (register tiles, the
# attention's key splits), so an exact size replays exactly the eager step's bits. Tapes are
# recorded when a size is first needed, into one shared arena, so the unused sizes cost nothing.
DEFAULT_CPU_MAX_BS = 32
CPU_LADDER = list(range(1, DEFAULT_CPU_MAX_BS + 1))


def capture_sizes(max_bs: int, explicit: list[int] | None = None, ladder: list[int] | None = None) -> list[int]:
    """The bucket sizes to capture: ``explicit`` (``--cuda-graph-bs``) when given, else
    the ladder (1, 2, 4, 8, 16, 24, ... unless another is given) cut at ``max_bs`` (which is
    always included)."""
    if explicit:
        return sorted({int(b) for b in explicit if int(b) <= max_bs} or {min(explicit)})
    sizes = [b for b in (ladder or _LADDER) if b < max_bs]
    return [*sizes, max_bs]


class GraphCapturer(ABC):
    """How graphs are made: ``capture(fn, batch)`` returns a handle whose ``replay()``
    re-runs what ``fn()`` did, writing into the tensor ``fn`` returned (``handle.output``)."""

    @abstractmethod
    def capture(self, fn: Callable[[], torch.Tensor], batch: ForwardBatch) -> Any:
        """Capture ``fn`` (the model over the static ``batch``); the handle replays it."""


class CudaGraphCapturer(GraphCapturer):
    """``torch.cuda.CUDAGraph`` with one memory pool shared by every bucket (capture the
    largest first so the smaller ones reuse its memory); two warm-up runs on a side stream
    first, as PyTorch asks (lazy initialisation and autotuning stay out of the graph)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn, batch):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        return _CudaGraph(graph, out)


class _CudaGraph:
    def __init__(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> None:
        self.graph, self.output = graph, output

    def replay(self) -> None:
        self.graph.replay()


class _FakeGraph:
    def __init__(self, fn, batch: ForwardBatch, output: torch.Tensor) -> None:
        self.fn, self.batch, self.output = fn, batch, output
        self.metadata_ptrs = _tensor_ptrs(batch.attn_metadata)
        self.input_ptrs = _batch_ptrs(batch)
        self.replays = 0

    def replay(self) -> None:
        # what a real graph would silently get wrong: a backend that re-allocated its
        # metadata, or a runner that swapped the batch's input tensors
        if _tensor_ptrs(self.batch.attn_metadata) != self.metadata_ptrs:
            raise RuntimeError("attention metadata moved after capture: a captured kernel would read the old "
                               "buffers (write the replay metadata in place)")
        if _batch_ptrs(self.batch) != self.input_ptrs:
            raise RuntimeError("the batch's input tensors changed after capture")
        self.output.copy_(self.fn())
        self.replays += 1


class FakeGraphCapturer(GraphCapturer):
    """Replays by calling the captured function again over the same static batch, and
    copies its result into the output tensor of the capture (so callers see the one
    static output, as with a real graph). Checks at every replay that the attention
    metadata and the batch's tensors are the very tensors captured. For tests on CPU."""

    def __init__(self) -> None:
        self.graphs: list[_FakeGraph] = []

    def capture(self, fn, batch):
        fn()  # a warm-up, as the CUDA capturer does
        graph = _FakeGraph(fn, batch, fn())
        self.graphs.append(graph)
        return graph


class _TapeGraph:
    def __init__(self, tape: kernel_tape.Tape, output: torch.Tensor, batch: ForwardBatch) -> None:
        self.tape, self.output, self.batch = tape, output, batch
        self.vocab = output.shape[-1]

    def replay(self) -> None:
        ids = self.batch.input_ids  # the embedding's own range check is not on the tape
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab:
            raise IndexError(f"token ids out of range [0, {self.vocab})")
        self.tape.run()


class TapeCapturer(GraphCapturer):
    """On CPU: a bucket's decode forward recorded as a kernel tape (:mod:`radixserve.kernels.tape`)
    and replayed from C. Every bucket's tape allocates from one arena (buckets never run at
    the same time). Each capture is checked before it is used: the replay must give the
    recorded logits bit for bit, and, with other token ids and positions in the static
    inputs, the same logits as the eager forward (a kernel call the tape missed, or a value
    fixed at recording time, would show there). :meth:`capture_live` records a later bucket
    over a live step instead."""

    lazy = True  # recording is cheap: each bucket when first needed

    def __init__(self, kernels) -> None:
        self.lib = kernels.lib  # holds rs_tape_run
        self.arena = kernel_tape.Arena()

    def capture(self, fn, batch):
        out, tape = kernel_tape.record(fn, self.arena, self.lib)
        recorded = out.clone()
        tape.run()
        if not torch.equal(out, recorded):
            raise kernel_tape.TapeError("replaying the tape does not reproduce the recorded step")
        ids, pos = batch.input_ids, batch.positions
        gen = torch.Generator().manual_seed(ids.shape[0])
        ids.copy_(torch.randint(0, out.shape[-1], ids.shape, generator=gen))
        pos.copy_(torch.randint(0, 64, pos.shape, generator=gen))
        try:
            eager = fn()
            tape.run()
            if not torch.equal(out, eager):
                raise kernel_tape.TapeError("the tape and the eager forward differ on new inputs")
        finally:
            ids.zero_()
            pos.zero_()
        return _TapeGraph(tape, out, batch)

    def capture_live(self, fn, batch, vocab: int):
        """Record ``fn()`` over a live step's inputs (already in ``batch``'s static buffers),
        so the recording computes that very step: its output is the step's logits. The
        replay must give them bit for bit (it writes the same K/V again). The check with
        other inputs against the eager forward is left to the start-up capture, which records
        the same code over scratch inputs."""
        ids = batch.input_ids  # the embedding skips its range check while recording
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise IndexError(f"token ids out of range [0, {vocab})")
        out, tape = kernel_tape.record(fn, self.arena, self.lib)
        recorded = out.clone()
        tape.run()
        if not torch.equal(out, recorded):
            raise kernel_tape.TapeError("replaying the tape does not reproduce the recorded step")
        return _TapeGraph(tape, out, batch)


def _tensor_ptrs(obj: Any, depth: int = 0) -> list[tuple[int, tuple[int, ...]]]:
    """(data_ptr, shape) of every tensor reachable from ``obj`` (dataclasses, containers, plain objects)."""
    if depth > 4 or obj is None:
        return []
    if isinstance(obj, torch.Tensor):
        return [(obj.data_ptr(), tuple(obj.shape))]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        names = list(getattr(obj, "__dict__", {})) or list(getattr(obj, "__slots__", ()))
        items = [getattr(obj, n, None) for n in names]
    else:
        return []
    return [p for item in items for p in _tensor_ptrs(item, depth + 1)]


def _batch_ptrs(batch: ForwardBatch) -> list[int]:
    return [t.data_ptr() for t in (batch.input_ids, batch.positions, batch.req_pool_indices, batch.seq_lens,
                                   batch.out_cache_loc, batch.logits_indices)]


def capturer_lazy(capturer: GraphCapturer) -> bool:
    """Whether ``capturer`` records buckets when first needed rather than all at start-up."""
    return bool(getattr(capturer, "lazy", False))


class CudaGraphRunner:
    """Captured decode graphs of one model runner, one per bucket size.

    ``runner`` is the :class:`~radixserve.engine.model_runner.ModelRunner` (its model,
    attention backend, KV pool and request-to-token table). ``pad`` False
    (``--disable-cuda-graph-padding``) replays only batches whose size is a bucket."""

    def __init__(self, runner, sizes: list[int], capturer: GraphCapturer, *, pad: bool = True) -> None:
        if not sizes:
            raise ValueError("no CUDA-graph batch sizes to capture")
        self.runner = runner
        self.sizes = sorted(sizes)
        self.max_bs = self.sizes[-1]
        self.capturer = capturer
        # a lazy capturer (CPU tapes) records the smallest bucket now (a model that cannot be
        # recorded shows at start-up) and each other bucket when a batch first needs it
        self.lazy = capturer_lazy(capturer)
        self.pad = pad
        self.backend: AttentionBackend = runner.attn_backend
        dev = runner.device
        table = runner.req_to_token_pool
        # the padding rows' request: a table row of zeros, so every position is scratch slot 0
        self.pad_row = table.reserve()
        table.req_to_token[self.pad_row].zero_()
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.full((n,), self.pad_row, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.logits_indices = torch.arange(n, device=dev)
        self.batches: dict[int, ForwardBatch] = {}
        self.graphs: dict[int, Any] = {}
        self.replays: Counter[int] = Counter()  # bucket -> replays
        try:
            self.backend.init_cuda_graph_state(self.max_bs)
            for bs in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory
                if not self.lazy or bs == self.sizes[0]:
                    self._capture(bs)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Drop the graphs and give the padding row back."""
        self.graphs.clear()
        self.batches.clear()
        if self.pad_row is not None:
            self.runner.req_to_token_pool.unreserve(self.pad_row)
            self.pad_row = None

    def _reset_static(self) -> None:
        """Every static input back to padding (scratch slot 0), as before the first capture."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.req_pool_indices.fill_(self.pad_row)
        self.seq_lens.fill_(1)
        self.out_cache_loc.zero_()

    def _static_batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs], seq_lens_cpu=[1] * bs, prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs, req_to_token=r.req_to_token_pool.req_to_token, kv_pool=r.kv_pool,
            logits_indices=self.logits_indices[:bs])

    def _capture(self, bs: int) -> None:
        batch = self._static_batch(bs)
        self.backend.init_forward_metadata_capture_cuda_graph(batch)
        model = self.runner.model

        def run() -> torch.Tensor:
            return model(batch)

        lora = getattr(self.runner, "lora", None)  # LoRA: recorded under an empty step (see LoRAManager)
        with lora.recording(bs) if lora is not None else contextlib.nullcontext():
            self.graphs[bs] = self.capturer.capture(run, batch)
        self.batches[bs] = batch

    def _live_ok(self, exact: bool) -> bool:
        """Whether a missing bucket may be recorded over the live step that needs it: a lazy
        capturer that can (kernel tapes), no padding rows (they would run on scratch inputs
        the start-up check never saw), no LoRA (recorded under an empty step), and a tape
        already checked against the eager forward at start-up."""
        return (self.lazy and exact and hasattr(self.capturer, "capture_live") and bool(self.graphs)
                and getattr(self.runner, "lora", None) is None)

    def _capture_live(self, bs: int, batch: ForwardBatch) -> Any:
        model = self.runner.model
        vocab = next(iter(self.graphs.values())).vocab
        graph = self.capturer.capture_live(lambda: model(batch), batch, vocab)
        self.graphs[bs], self.batches[bs] = graph, batch
        return graph

    def bucket_for(self, bs: int) -> int | None:
        """The bucket a batch of ``bs`` requests replays in (None: run it eagerly)."""
        i = bisect.bisect_left(self.sizes, bs)
        if i == len(self.sizes):
            return None
        if not self.pad and self.sizes[i] != bs:
            return None
        return self.sizes[i]

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.mode is ForwardMode.DECODE and not batch.capture_hidden_layers
                and not batch.capture_final_hidden
                and self.bucket_for(batch.batch_size) is not None)

    def replay(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits ``# [B, V]`` of a decode ``batch`` (``can_run(batch)`` must hold); None when
        the attention backend asks for this step to run eagerly."""
        bs = batch.batch_size
        bucket = self.bucket_for(bs)
        live = bucket not in self.graphs and self._live_ok(bucket == bs)
        if bucket not in self.graphs and not live:  # a lazy capturer's first batch of this size
            self._reset_static()  # the recording must write K/V to the scratch slot, not a live request's
            try:
                self._capture(bucket)
            except kernel_tape.TapeError as exc:
                logger.warning("recording the decode tape of batch size %d failed (%s); it runs eagerly",
                               bucket, exc)
                self.sizes.remove(bucket)
                return None
        sb = self._static_batch(bucket) if live else self.batches[bucket]
        for dst, src in ((self.input_ids, batch.input_ids), (self.positions, batch.positions),
                         (self.req_pool_indices, batch.req_pool_indices), (self.seq_lens, batch.seq_lens),
                         (self.out_cache_loc, batch.out_cache_loc)):
            dst[:bs].copy_(src)
        pad = bucket - bs
        if pad:
            self.input_ids[bs:bucket].zero_()
            self.positions[bs:bucket].zero_()
            self.req_pool_indices[bs:bucket].fill_(self.pad_row)
            self.seq_lens[bs:bucket].fill_(1)
            self.out_cache_loc[bs:bucket].zero_()
        sb.seq_lens_cpu = list(batch.seq_lens_cpu) + [1] * pad
        sb.prefix_lens_cpu = list(batch.prefix_lens_cpu) + [0] * pad
        if live:
            self.backend.init_forward_metadata_capture_cuda_graph(sb)
        if self.backend.init_forward_metadata_replay_cuda_graph(sb) is False:
            return None
        if live:  # record this size over this very step: the recording computes its logits
            try:
                graph = self._capture_live(bucket, sb)
            except kernel_tape.TapeError as exc:  # the eager step that follows writes every K/V again
                logger.warning("recording the decode tape of batch size %d failed (%s); it runs eagerly",
                               bucket, exc)
                self.sizes.remove(bucket)
                return None
        else:
            graph = self.graphs[bucket]
            graph.replay()
        self.replays[bucket] += 1
        batch.attn_metadata = sb.attn_metadata
        # a copy: the captured output is overwritten by the next replay, and callers (the
        # overlap scheduler) may still hold this step's logits then
        return graph.output[:bs].clone()

    def stats(self) -> dict[str, Any]:
        return {"cuda_graph_batch_sizes": list(self.sizes), "cuda_graph_replays": sum(self.replays.values()),
                "cuda_graph_replays_by_bs": dict(sorted(self.replays.items()))}


def graph_off_reason(runner, args) -> str | None:
    """Why this engine runs decode eagerly (None: capture graphs, or tapes on CPU)."""
    if args.disable_cuda_graph:
        return "--disable-cuda-graph"
    lora = getattr(runner, "lora", None)
    if lora is not None and not lora.backend.supports_cuda_graph:
        return f"--enable-lora with the {lora.backend.name} LoRA backend (its calls cannot be recorded in a graph)"
    if runner.device.type == "cpu":
        if cpu_kernels.load() is None:
            return f"radixserve's CPU kernels are unavailable ({cpu_kernels.status()})"
        if runner.dtype != torch.float32:
            return f"activations in {str(runner.dtype).removeprefix('torch.')} (tapes record the float32 kernels)"
    if not runner.attn_backend.supports_cuda_graph:
        return (f"the decode attention backend ({args.decode_backend_name}) does not support decode graphs "
                "(supports_cuda_graph)")
    if args.world_size > 1:
        return "--tp-size or --pp-size > 1 (collectives and stage transfers are not captured yet)"
    if runner.expert_load is not None:
        return "MoE models (the MoE runners and transports are not checked for capture yet)"
    return None

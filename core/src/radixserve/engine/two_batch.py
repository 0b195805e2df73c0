"""Two-batch overlap (``--enable-two-batch-overlap``, SGLang's flag): a MoE model's step split
into two micro-batches whose layers interleave, so that one's token dispatch and combine are in
flight while the other computes.

A step of at least two requests (decode, extend or mixed) is cut between two requests where
the token counts are closest to even (:func:`split_point`); each micro-batch is a batch of its
own (:func:`~radixserve.distributed.dp_attention.select_requests`) with its attention metadata
built by an attention backend of its own (the runner's and a second instance of the same
flags), since a backend may keep a step's metadata in its own buffers. The layers run as
generators (``DecoderLayer.stages``, ``SparseMoE.stages``) that yield each time a MoE block
has started a collective: the dispatch (``MoEA2ABackend.dispatch_async``), then the combine
(``combine_async``, or the asynchronous all-reduce that sums the ranks' shares). The driver
(:func:`interleave`) resumes the micro-batches in turn::

    A: attention, router, dispatch starts  | B: attention, router, dispatch starts
    A: wait, experts, combine starts       | B: wait, experts, combine starts
    A: wait, next layer's attention, ...   | B: ...

Every rank runs the same split and the same order, so the collectives match. The layers'
outputs are put back in token order before the final norm and the LM head, which run once
for the whole batch; tokens equal those without overlap.

It runs where there is communication to hide: a model with MoE layers on more than one rank
(``--tp-size``, with or without ``--ep-size``). Not with DP attention, pipeline or context
parallelism (refused at start-up), and not for target-verify steps or a step that keeps
layers' hidden states (EAGLE's capture), which run as one batch. Decode steps under two-batch
overlap run eagerly (no captured graph).
"""

from __future__ import annotations

import logging

import torch

from radixserve.distributed import get_parallel_state
from radixserve.distributed.dp_attention import select_requests
from radixserve.layers.attention import AttentionBackend, ForwardBatch, ForwardMode
from radixserve.layers.moe import moe_layers

logger = logging.getLogger(__name__)

_SPLITTABLE = (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED)


class MicroBatchAttention:
    """What the model's layers hold as their attention backend under two-batch overlap: every
    call goes to the backend of the micro-batch being run (:attr:`current`)."""

    def __init__(self, backends: list[AttentionBackend]) -> None:
        self.backends = backends
        self.current = backends[0]

    def __getattr__(self, name: str):
        return getattr(self.current, name)


def split_point(extend_lens: list[int]) -> int:
    """The number of leading requests in the first micro-batch: the cut (leaving each side one
    request at least) whose token counts are closest to even."""
    total, best, best_gap, seen = sum(extend_lens), 1, None, 0
    for k in range(1, len(extend_lens)):
        seen += extend_lens[k - 1]
        gap = abs(2 * seen - total)
        if best_gap is None or gap < best_gap:
            best, best_gap = k, gap
    return best


def interleave(stages: list, switch) -> list:
    """Resume each generator of ``stages`` in turn until all have returned (``switch(i)`` is
    called before generator ``i`` runs); their return values."""
    results: list = [None] * len(stages)
    live = list(range(len(stages)))
    while live:
        for i in list(live):
            switch(i)
            try:
                next(stages[i])
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
    return results


def layer_stages(model, x: torch.Tensor, part: ForwardBatch):
    """The model's decoder layers over one micro-batch's rows, as a generator (see the module
    docstring); returns ``(x, residual)``."""
    rope = model.rotary.forward(part.positions)
    residual = None
    for i in range(model.start, model.end):
        x, residual = yield from model.layers[i].stages(x, residual, rope, part)
    return x, residual


class TwoBatchOverlap:
    """The runner's two-batch overlap: which steps it takes and how it runs them."""

    def __init__(self, runner, second: AttentionBackend) -> None:
        self.runner = runner
        self.attention = MicroBatchAttention([runner.attn_backend, second])
        runner.model.set_attention_backend(self.attention)
        self.num_steps = 0  # steps run as two micro-batches (stats and tests)

    @classmethod
    def create(cls, runner, make_backend) -> TwoBatchOverlap | None:
        """For ``--enable-two-batch-overlap``, where it has something to overlap (``make_backend()``
        builds the second micro-batch's attention backend); None otherwise, with a warning."""
        if not runner.args.enable_two_batch_overlap:
            return None
        if not moe_layers(runner.model):
            logger.warning("--enable-two-batch-overlap: %s has no MoE layers, so no tokens travel to overlap; "
                           "steps run as one batch", runner.model_config.architecture)
            return None
        if get_parallel_state().moe_world_size == 1:
            logger.warning("--enable-two-batch-overlap on one rank: MoE layers communicate nothing to overlap; "
                           "steps run as one batch (it takes effect with --tp-size / --ep-size > 1)")
            return None
        return cls(runner, make_backend())

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.mode in _SPLITTABLE and batch.batch_size >= 2 and not batch.capture_hidden_layers
                and batch.dp_groups is None and "ring" not in batch.extra)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's logits, its layers run as two interleaved micro-batches."""
        k = split_point(batch.extend_lens_cpu)
        parts = [select_requests(batch, list(range(k))), select_requests(batch, list(range(k, batch.batch_size)))]
        for backend, part in zip(self.attention.backends, parts):
            backend.init_forward_metadata(part)
        batch.extra["two_batch"] = (self, parts)
        try:
            logits = self.runner.model(batch)
        finally:
            del batch.extra["two_batch"]
            self.attention.current = self.attention.backends[0]
        self.num_steps += 1
        return logits

    def run_layers(self, model, x: torch.Tensor, parts: list[ForwardBatch]) -> tuple[torch.Tensor, torch.Tensor]:
        """``x  # [T, hidden]`` (the embeddings) through every layer, micro-batch by micro-batch
        interleaved; ``(x, residual)`` in token order."""
        t0 = int(parts[0].input_ids.shape[0])
        stages = [layer_stages(model, x[:t0], parts[0]), layer_stages(model, x[t0:], parts[1])]

        def switch(i: int) -> None:
            self.attention.current = self.attention.backends[i]

        (x0, r0), (x1, r1) = interleave(stages, switch)
        return torch.cat([x0, x1]), torch.cat([r0, r1])

"""The EAGLE-3 proposer: a :class:`~radixserve.speculative.draft_model.DraftModel` whose
module is the draft head.

Draft row ``j`` of a request carries the target's hidden state of token ``j`` and the
embedding of token ``j + 1`` at position ``j``, and its K/V lives at the target's slot of
``j`` in the draft pool. So a row can only be computed once the target has run token
``j`` *and* the token after it is known: exactly what :meth:`Eagle3Proposer.observe`
reports (``req.all_ids[start + num]`` is always known). Every observed step, prefill
chunk or verify, is therefore extended at once, batched over requests, with the ids
shifted by one and ``fc`` over the target's aux hidden states as the hidden input. The
last row of a request (position ``seq_len - 2``, carrying the root token) gives the first
draft token and the hidden state the next level continues from; drafting levels run at
positions ``seq_len - 1, seq_len, ...`` (the training-time convention) with the previous
level's pre-norm output as the hidden input.

Draft K/V that no observe covers, because the target's hidden states for them are never
reported: the positions of a request ended by its first prefill chunk, and those a verify
step accepted when it also ended the request (they keep what the draft's own levels
wrote there); and the last row of a cached prefix embeds the token that followed it in
the request that computed it. When such pages are reused from the prefix cache, later
drafts over them are less accurate, never wrong (the target verifies every token).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from radixserve.plugin_api.attention import AttentionBackend, AttentionLayer, ForwardBatch
from radixserve.plugin_api.speculative import (
    Draft,
    DraftModel,
    ModelConfig,
    SpeculativeContext,
    TargetStep,
    draft_quantization,
)
from torch import nn

from radixserve_speculative_eagle3.checkpoint import load_head, read_config
from radixserve_speculative_eagle3.head import Eagle3Head, default_aux_layers

# The head's linear layers on CPU unless --speculative-draft-model-quantization says otherwise.
# Per draft step the head runs three times (the observe extend and two drafting levels); in
# float32 its ~10M weights are ~40 MB a pass, more bytes than the default model's whole Q4_1
# decode step reads. Per-channel int8 ran its linear layers 5.8x faster at 1 row and 3.2x at
# 4 (benchmarks in BENCHMARKS.md, "Speculative decoding").
CPU_QUANTIZATION = "w8a16_int8"


class Eagle3Module(nn.Module):
    """The head as a draft module: ``forward(batch)`` reads the per-row hidden input from
    ``batch.extra["eagle_hidden"]  # [T, H]``, leaves its pre-norm output in
    ``batch.extra["eagle_out"]  # [T, H]`` and returns draft-vocabulary logits at
    ``batch.logits_indices``."""

    def __init__(self, head: Eagle3Head) -> None:
        super().__init__()
        self.head = head
        cfg = head.config
        self.layer = AttentionLayer(0, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                    cfg.head_dim ** -0.5)
        self.backend: AttentionBackend | None = None

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        self.backend = backend

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        def attend(q, k, v):
            return self.backend.forward(q, k, v, self.layer, batch)

        h2 = self.head(batch.input_ids, batch.extra["eagle_hidden"], batch.positions, attend)  # [T, H]
        batch.extra["eagle_out"] = h2
        if batch.logits_indices.shape[0] != h2.shape[0]:
            h2 = h2[batch.logits_indices]
        return self.head.logits(h2)  # [B, Vd]


class Eagle3Proposer(DraftModel):
    def __init__(self, ctx: SpeculativeContext) -> None:
        path = ctx.draft_model_path
        raw = read_config(path, ctx.algorithm)
        quant = draft_quantization(ctx, "hf", default=CPU_QUANTIZATION if ctx.device.type == "cpu" else None)
        head = load_head(path, ctx.model_config, algorithm=ctx.algorithm, dtype=ctx.dtype, device=ctx.device,
                         quantization=quant)
        # the target's embedding; with --tp-size > 1 rank 0 holds a slice of it, so the head gets the whole table
        table = ctx.target.embedding_table
        head.set_embed(table() if table is not None else ctx.target.embed_tokens)
        head.finalize(ctx.dtype, ctx.device, ctx.target.context_len)
        config = ModelConfig.from_hf_dict(raw)
        super().__init__(ctx, Eagle3Module(head), config, reuse_draft_kv=False)
        self.head = head
        self.hidden_layers = head.config.aux_layer_ids or default_aux_layers(ctx.model_config.num_hidden_layers)
        self.token_map = head.d2t + torch.arange(head.config.draft_vocab_size, device=head.d2t.device)
        # per request (by rid): the position of its last draft row, that row's logits and output
        self._last: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self._root_hidden: torch.Tensor | None = None  # [B, H] of the requests being drafted
        self._batch: ForwardBatch | None = None  # the latest forward's batch
        self.num_missing_roots = 0

    # ------------------------------------------------------------------ DraftModel hooks
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._batch = batch
        return super().forward(batch)

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.extra["draft_kind"] != "draft":
            return  # an extend brings its hidden input (observe)
        prev = batch.extra["draft_prev"]
        source = self._root_hidden if prev is None else prev.extra["eagle_out"]
        batch.extra["eagle_hidden"] = source[batch.extra["draft_parent_rows"]]

    def root_logits(self, reqs):
        logits, hidden, base = [], [], []
        for r in reqs:
            pos, lg, h = self._last[r.rid]
            logits.append(lg)
            hidden.append(h)
            base.append(pos)
        self._root_hidden = torch.stack(hidden)
        return torch.stack(logits), base

    # ------------------------------------------------------------------ Proposer
    @torch.inference_mode()
    def propose(self, reqs: Sequence, max_tokens: Sequence[int]) -> list[Draft | None]:
        """Requests whose last draft row is their root's (every one whose steps were all
        observed) are drafted together; the others get no draft this step."""
        ready = [i for i, r in enumerate(reqs) if (last := self._last.get(r.rid)) is not None
                 and last[0] == r.seq_len - 2]
        out: list[Draft | None] = [None] * len(reqs)
        self.num_missing_roots += len(reqs) - len(ready)
        if ready:
            drafts = super().propose([reqs[i] for i in ready], [max_tokens[i] for i in ready])
            for i, d in zip(ready, drafts):
                out[i] = d
        self._root_hidden = None
        return out

    @torch.inference_mode()
    def observe(self, steps: Sequence[TargetStep]) -> None:
        """Extend the draft over every step's positions with the target's hidden states."""
        steps = [s for s in steps if s.hidden is not None and s.num > 0]
        if not steps:
            return
        ids: list[int] = []
        for s in steps:
            ids.extend(s.req.all_ids[s.start + 1:s.start + s.num + 1])
        aux = torch.cat([s.hidden for s in steps]).to(self.dtype)  # [T, 3 Ht]
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        logits = self.extend([s.req for s in steps], [s.start for s in steps], [s.start + s.num for s in steps],
                             input_ids=input_ids, extra={"eagle_hidden": self.head.project(aux)})
        batch = self._batch
        last_out = batch.extra["eagle_out"][batch.logits_indices]  # [B, H]
        for i, s in enumerate(steps):
            self._last[s.req.rid] = (s.start + s.num - 1, logits[i], last_out[i])

    def release(self, req) -> None:
        self._last.pop(req.rid, None)

    def stats(self) -> dict:
        return {**super().stats(), "eagle_missing_roots": self.num_missing_roots}

"""Draft models: the shared machinery of proposers that run a model of their own.

:class:`DraftModel` is a :class:`~radixserve.speculative.Proposer` around a *draft module*:
anything with ``set_attention_backend(backend)`` and ``forward(batch) -> logits``
(``# [len(batch.logits_indices), V]``), such as ``LlamaForCausalLM``. It owns the module's
attention backend (the target's prefill backend, by name, built for the draft's shapes)
and its KV pool, and drafts a chain or a tree per request, batched over requests.

KV layout. The draft pool is *indexed by the target's slots*: the draft K/V of position
``p`` of a request lives at the target's slot of ``p`` (read through the target's
request-to-token table), in a pool with the target's page size and page count and the
draft's own layers and heads. The target's page allocator and prefix cache so cover the
draft's K/V too. Slots past the target's range are scratch for tree nodes
(``eagle_topk > 1``), valid during one draft and until the step after it is observed.

Mirror rule: whenever a page can be read by another request (it is in the prefix cache),
its positions' draft K/V were computed from the same tokens as the target's:

* positions the target computed without a draft of ours (prefill chunks, which enter the
  cache at once; decode steps without a draft) are computed when :meth:`observe` reports
  them, batched over requests in one forward (:meth:`extend`);
* positions a verify step accepted are computed lazily, by the first forward of the
  request's next draft, or, when the request ends first (its decode pages enter the cache
  only then), by :meth:`release`'s queue, which the next forward of any kind computes
  before anything else: only this object reads or writes the draft pool, so a cached page
  is never read before it. Accepted nodes whose draft K/V this draft already computed are
  not run again: chain nodes sit at their path's slots already, tree nodes' K/V is copied
  there from scratch.

Drafting, from each request's root (its last token, position ``seq_len - 1``): the first
forward computes the root (and any positions still pending) and gives the root's logits
(:meth:`root_logits`). Every level keeps ``eagle_topk`` frontier nodes per request: the
best children of the previous frontier by cumulative log-probability. A level runs its
frontier through the module in *decode* mode, one row per node, so each level computes
only its new nodes and no tree mask is needed: a chain node takes the target slot of its
column (``seq_len - 1 + depth``, reserved by the core); a tree node takes a scratch slot
and a private table row holding the request's prefix and then its ancestors' slots.
After ``num_steps`` levels the draft is the best ``min(num_draft_tokens - 1,
max_tokens[i])`` candidates by cumulative score (a parent never scores below its child,
so parents are always included). A request stops taking part in levels that could only
add nodes past its ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.distributed import replicated_scope
from radixserve.layers.attention import ForwardBatch, ForwardMode
from radixserve.mem.kv_pool import KVPool
from radixserve.speculative import Proposer, SpeculativeContext, TargetStep
from radixserve.speculative.draft_loading import build_attention_backend
from radixserve.speculative.draft_state import _Computed, _Level, _State
from radixserve.speculative.tree import Draft

if TYPE_CHECKING:
    from radixserve.engine.request import Req
    from radixserve.models.config import ModelConfig

class DraftModel(Proposer):
    """A proposer that drafts with a model of its own; see the module docstring.

    Subclasses (EAGLE-style drafts) may override :meth:`prepare` (extra per-token inputs),
    :meth:`root_logits` (where the first draft token comes from), and :meth:`observe` and
    :meth:`release` (how the draft K/V keep up with the target; the defaults run the
    module on the tokens alone, with ``reuse_draft_kv`` when a node's K/V depend only on
    the tokens up to it). Set ``token_map`` (``# [V_draft]`` target token ids) when the
    module's vocabulary is not the target's.
    """

    def __init__(self, ctx: SpeculativeContext, module: nn.Module, config: ModelConfig, *,
                 reuse_draft_kv: bool = True) -> None:
        target = ctx.target
        self.ctx = ctx
        self.module = module
        self.config = config
        self.device, self.dtype = ctx.device, ctx.dtype
        self.topk = ctx.eagle_topk
        self.num_steps = ctx.num_steps
        self.max_nodes = ctx.num_draft_tokens - 1
        self.reuse_draft_kv = reuse_draft_kv  # accepted nodes' K/V equal what extend computes
        self.token_map: torch.Tensor | None = None
        self.table = target.req_to_token_pool.req_to_token  # [R, W] the target's slots
        self.max_batch = target.max_running_requests
        self.cache_enabled = not ctx.core.args.disable_radix_cache
        tpool = target.kv_pool
        self.page_size = tpool.page_size
        self.num_levels = max(self.num_steps - 1, 0)  # levels whose nodes run through the module
        self.scratch_base = tpool.num_slots
        scratch = self.max_batch * self.topk * self.num_levels if self.topk > 1 else 0
        self.kv_pool = KVPool(num_layers=config.num_hidden_layers,
                              num_pages=tpool.num_slots // self.page_size + -(-scratch // self.page_size),
                              page_size=self.page_size, num_kv_heads=config.num_key_value_heads,
                              head_dim=config.head_dim, dtype=tpool.dtype, device=self.device)
        self.attn_backend = build_attention_backend(ctx, config, self.max_batch * self.topk)
        module.set_attention_backend(self.attn_backend)
        self._states: dict[int, _State] = {}
        self._epoch = 0  # bumped whenever a draft starts writing scratch
        self._root_batch: ForwardBatch | None = None
        self._pending: list[tuple[torch.Tensor, int, list[int]]] = []  # (table row, start, tokens)
        self._pending_read = torch.zeros(self.kv_pool.num_slots, dtype=torch.bool, device=self.device)
        self._pending_write = torch.zeros(self.kv_pool.num_slots, dtype=torch.bool, device=self.device)
        self.num_forwards = 0
        self.num_tokens = 0

    # ------------------------------------------------------------------ hooks
    def prepare(self, batch: ForwardBatch) -> None:
        """Put the module's extra per-token inputs into ``batch.extra`` (default: none).

        Called before every forward. ``batch.extra["draft_kind"]`` is ``"extend"`` (then
        ``batch.extra`` also holds what the caller of :meth:`extend` passed) or
        ``"draft"``; a draft level also has ``"draft_prev"`` (the previous forward's batch,
        None when :meth:`root_logits` ran none) and ``"draft_parent_rows"`` (``# [T]``: each
        token's parent as a row of the previous forward's logits)."""

    def root_logits(self, reqs: Sequence[Req]) -> tuple[torch.Tensor, list[int]]:
        """Logits ``# [B, V]`` of each request's first draft token, and the positions
        ``base`` such that a depth-``d`` node runs at ``base[i] + d`` (chain nodes in the slot
        of that column). Default: one forward over each root and any pending positions."""
        ends = [r.seq_len for r in reqs]
        logits = self._catch_up(reqs, ends, new_valid=[0] * len(reqs), last_logits=True)
        return logits, [e - 1 for e in ends]

    # ------------------------------------------------------------------ Proposer
    @torch.inference_mode()
    def propose(self, reqs: Sequence[Req], max_tokens: Sequence[int]) -> list[Draft | None]:
        want = [min(self.max_nodes, k) for k in max_tokens]
        self._flush()
        self._root_batch = None
        logits, base = self.root_logits(reqs)
        return self._draft(list(reqs), want, logits, base)

    @torch.inference_mode()
    def observe(self, steps: Sequence[TargetStep]) -> None:
        """Compute the positions of steps this proposer did not draft for (prefill chunks,
        decode steps without a draft); a drafted verify step's positions wait (module
        docstring)."""
        now = [s for s in steps if s.num_accepted is None]
        if now:
            self._catch_up([s.req for s in now], [s.start + s.num for s in now],
                           new_valid=[s.start for s in now], last_logits=False)

    @torch.inference_mode()
    def release(self, req: Req) -> None:
        """Queue the draft K/V of ``req``'s computed full pages still pending (they go to the
        prefix cache now; a request ended by its first prefill chunk was never observed).
        The next forward computes every queued request's at once, through copies of their
        table rows; the queue is computed now instead when a slot of this request is one a
        queued request reads or writes (a page freed and handed out again)."""
        state = self._states.pop(id(req), None)
        if not self.cache_enabled or req.req_pool_idx is None:
            return
        if state is None:  # never observed (ended by its first prefill chunk): from its cache hit
            state = _State(req.cached_tokens if req.num_retractions == 0 else 0)
        end = req.kv_len - req.kv_len % self.page_size
        if end <= state.valid:
            return
        row = self.table[req.req_pool_idx, :end].clone()  # [end] slots
        start, moves = state.valid, []
        if state.computed is not None and self.reuse_draft_kv:
            start = self._walk(req, state, end, moves)
        if self._pending and bool(self._pending_write[row].any() | self._pending_read[row[state.valid:]].any()):
            self._flush()  # a queued request writes what this one reads, or reads what it writes
        self._move(moves)
        if start < end:
            self._pending.append((row, start, _tokens(req, start, end)))
            self._pending_read[row] = True
            self._pending_write[row[start:]] = True

    def stats(self) -> dict:
        return {"draft_num_forwards": self.num_forwards, "draft_num_tokens": self.num_tokens}

    # ------------------------------------------------------------------ forward passes
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the module on ``batch``: logits ``# [len(batch.logits_indices), V]`` (float32)."""
        self.attn_backend.init_forward_metadata(batch)
        self.prepare(batch)
        self.num_forwards += 1
        self.num_tokens += batch.input_ids.shape[0]
        with replicated_scope():  # with --tp-size > 1 the draft is whole on rank 0: no collective
            return self.module(batch).float()

    @torch.inference_mode()
    def extend(self, reqs: Sequence[Req], starts: Sequence[int], ends: Sequence[int], *,
               input_ids: torch.Tensor | None = None, extra: dict | None = None) -> torch.Tensor:
        """Draft K/V for positions ``[starts[i], ends[i])`` of ``reqs[i]`` (earlier positions'
        must be there), at the target's slots, in one forward. Tokens: ``req.all_ids``
        there unless ``input_ids  # [sum(ends - starts)]``; ``extra`` goes into
        ``batch.extra``. Returns the logits ``# [B, V]`` at each request's last position."""
        self._flush()
        if input_ids is None:
            ids: list[int] = []
            for r, s, e in zip(reqs, starts, ends):
                ids.extend(_tokens(r, s, e))
            input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=self.device)
        logits, self._root_batch = self._extend(self.table, rows, starts, ends, input_ids, extra)
        return logits

    def _flush(self) -> None:
        """Compute the positions :meth:`release` queued, in one forward."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self._pending_read.zero_()
        self._pending_write.zero_()
        width = max(row.shape[0] for row, _, _ in pending)
        table = torch.zeros(len(pending), width, dtype=torch.int64, device=self.device)
        for i, (row, _, _) in enumerate(pending):
            table[i, :row.shape[0]] = row
        ids = torch.tensor([t for _, _, toks in pending for t in toks], dtype=torch.int64, device=self.device)
        self._extend(table, torch.arange(len(pending), device=self.device), [s for _, s, _ in pending],
                     [row.shape[0] for row, _, _ in pending], ids, None)

    def _extend(self, table: torch.Tensor, rows: torch.Tensor, starts: Sequence[int], ends: Sequence[int],
                input_ids: torch.Tensor, extra: dict | None) -> tuple[torch.Tensor, ForwardBatch]:
        """One extend over rows ``rows`` of ``table``; see :meth:`extend`."""
        nums = [e - s for s, e in zip(starts, ends)]
        if not nums or min(nums) < 1:
            raise ValueError(f"extend() needs at least one position per request, got {nums}")
        dev = self.device
        starts_t = torch.tensor(list(starts), dtype=torch.int64, device=dev)
        total = sum(nums)
        if total == len(nums):  # one position each: a decode batch
            mode, positions, row_of = ForwardMode.DECODE, starts_t, rows
            logits_indices = torch.arange(total, device=dev)
        else:
            nums_t = torch.tensor(nums, dtype=torch.int64, device=dev)
            first = nums_t.cumsum(0) - nums_t  # [B] first row of each request
            mode = ForwardMode.EXTEND
            positions = starts_t.repeat_interleave(nums_t) + torch.arange(total, device=dev) - \
                first.repeat_interleave(nums_t)  # [T]
            row_of = rows.repeat_interleave(nums_t)
            logits_indices = first + nums_t - 1
        batch = ForwardBatch(
            mode=mode, batch_size=len(nums), input_ids=input_ids, positions=positions,
            req_pool_indices=rows, seq_lens=torch.tensor(list(ends), dtype=torch.int64, device=dev),
            out_cache_loc=table[row_of, positions], seq_lens_cpu=list(ends), prefix_lens_cpu=list(starts),
            extend_lens_cpu=nums, req_to_token=table, kv_pool=self.kv_pool, logits_indices=logits_indices,
            extra={**(extra or {}), "draft_kind": "extend"})
        return self.forward(batch), batch

    def _decode(self, input_ids: torch.Tensor, positions: list[int], rows: torch.Tensor, slots: torch.Tensor,
                table: torch.Tensor, parent_rows: torch.Tensor,
                prev: ForwardBatch | None) -> tuple[torch.Tensor, ForwardBatch]:
        """One drafting level: token ``t`` at ``positions[t]`` of table row ``rows[t]``."""
        dev = self.device
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        seq_lens = [p + 1 for p in positions]
        batch = ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=len(positions), input_ids=input_ids, positions=pos_t,
            req_pool_indices=rows, seq_lens=pos_t + 1, out_cache_loc=slots, seq_lens_cpu=seq_lens,
            prefix_lens_cpu=list(positions), extend_lens_cpu=[1] * len(positions), req_to_token=table,
            kv_pool=self.kv_pool, logits_indices=torch.arange(len(positions), device=dev),
            extra={"draft_kind": "draft", "draft_prev": prev, "draft_parent_rows": parent_rows})
        return self.forward(batch), batch

    # ------------------------------------------------------------------ catching up
    def _catch_up(self, reqs: Sequence[Req], ends: Sequence[int], new_valid: Sequence[int],
                  last_logits: bool) -> torch.Tensor | None:
        """Make positions ``[0, ends[i])`` valid (a request without state starts from
        ``new_valid[i]``); with ``last_logits`` the last position always runs and its logits
        come back ``# [B, V]``."""
        self._flush()  # before the moves below write anything
        starts, moves = [], []
        for req, end, fresh in zip(reqs, ends, new_valid):
            state = self._states.get(id(req))
            if state is None:
                state = self._states[id(req)] = _State(fresh)
            start = state.valid
            if state.computed is not None and self.reuse_draft_kv and start < end:
                start = self._walk(req, state, end, moves)
            state.computed = None
            if last_logits:
                start = min(start, end - 1)
            starts.append(start)
            state.valid = end
        self._move(moves)
        run = [i for i, (s, e) in enumerate(zip(starts, ends)) if s < e]
        if not run:
            return None
        logits = self.extend([reqs[i] for i in run], [starts[i] for i in run], [ends[i] for i in run])
        return logits if last_logits else None

    def _move(self, moves: list[tuple[int, int]]) -> None:
        if moves:
            src, dst = zip(*moves)
            self.kv_pool.move_kv(torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))

    def _walk(self, req: Req, state: _State, end: int, moves: list[tuple[int, int]]) -> int:
        """Follow ``req``'s tokens from ``state.valid`` through the nodes of its last draft
        whose K/V exist; queue scratch -> path slot copies. Returns the first position
        still to compute."""
        comp = state.computed
        pos = state.valid
        if comp.root != pos - 1 or (comp.epoch >= 0 and comp.epoch != self._epoch):
            return pos
        slots = self.table[req.req_pool_idx, pos:end].tolist()
        node = -1
        for k, tok in enumerate(_tokens(req, pos, end)):
            hit = comp.children.get((node, tok))
            if hit is None:
                break
            node, slot = hit
            if slot != slots[k]:
                moves.append((slot, slots[k]))
            pos += 1
        return pos

    # ------------------------------------------------------------------ drafting
    def _pick(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.token_map is None else self.token_map[ids]

    def _draft(self, reqs: list[Req], want: list[int], logits: torch.Tensor, base: list[int]) -> list[Draft | None]:
        """The best-first tree (a chain when ``topk == 1``) of every request; see the
        module docstring."""
        dev, k = self.device, self.topk
        b = len(reqs)
        tree = k > 1
        levels = min(self.num_steps, max(want))
        lp = torch.log_softmax(logits, dim=-1)  # [B, V]
        score, idx = lp.topk(k, dim=-1)  # [B, K]
        tok = self._pick(idx)
        cand_tok, cand_score, cand_parent = [tok], [score], [torch.full_like(idx, -1)]
        cand_ok = [torch.ones(b, k, dtype=torch.bool, device=dev)]
        fr_tok, fr_score = tok.clone(), score.clone()  # [B, K] the frontier
        fr_node = torch.arange(k, device=dev).expand(b, k).clone()  # its candidate indices
        num_cand = k
        base_t = torch.tensor(base, dtype=torch.int64, device=dev)
        rows_t = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=dev)
        if tree and levels > 1:
            if b > self.max_batch:
                raise ValueError(f"a draft of {b} requests exceeds the {self.max_batch} the scratch slots hold")
            self._epoch += 1
            width = max(base) + 1 + self.num_levels
            table = torch.zeros(b * k, width, dtype=torch.int64, device=dev)
            have = min(width, self.table.shape[1])
            table[:, :have] = self.table[rows_t.repeat_interleave(k), :have]  # every branch: the prefix
            path = torch.zeros(b, k, self.num_levels, dtype=torch.int64, device=dev)  # ancestors' slots
        ran: list[_Level] = []
        act_prev, prev = list(range(b)), self._root_batch
        from_branch = None  # [A_prev, K] parent branch of each frontier node
        arange_k = torch.arange(k, device=dev)
        for level in range(1, levels):
            keep = [j for j, i in enumerate(act_prev) if want[i] > level]
            if not keep:
                break
            act = [act_prev[j] for j in keep]
            a = torch.tensor(act, dtype=torch.int64, device=dev)
            sel = torch.tensor(keep, dtype=torch.int64, device=dev)  # rows of act in act_prev
            n = len(act)
            positions = [base[i] + level for i in act for _ in range(k)]
            if level == 1:
                parent_rows = a.repeat_interleave(k)  # the root forward has a row per request
            else:
                parent_rows = (sel[:, None] * k + from_branch[sel]).reshape(-1)
            if tree:
                slots = self.scratch_base + (a[:, None] * k + arange_k) * self.num_levels + level - 1  # [A, K]
                if level > 1:
                    path[a] = path[a].gather(1, from_branch[sel][:, :, None].expand(-1, -1, self.num_levels))
                path[a, :, level - 1] = slots
                branch_rows = a[:, None] * k + arange_k  # [A, K]
                cols = (base_t[a] + 1)[:, None, None] + torch.arange(level, device=dev)  # [A, 1, level]
                table[branch_rows[:, :, None], cols] = path[a, :, :level]
                lg, prev = self._decode(fr_tok[a].reshape(-1), positions, branch_rows.reshape(-1),
                                        slots.reshape(-1), table, parent_rows, prev)
            else:
                slots = self.table[rows_t[a], base_t[a] + level][:, None]  # [A, 1]
                lg, prev = self._decode(fr_tok[a].reshape(-1), positions, rows_t[a], slots.reshape(-1),
                                        self.table, parent_rows, prev)
            ran.append(_Level(act, fr_node[a], slots))
            s2, i2 = torch.log_softmax(lg, dim=-1).topk(k, dim=-1)  # [A*K, K]
            child_score = (fr_score[a][:, :, None] + s2.view(n, k, k)).view(n, k * k)
            child_tok = self._pick(i2).view(n, k * k)
            child_parent = fr_node[a][:, :, None].expand(n, k, k).reshape(n, k * k)
            for dst, src, fill in ((cand_score, child_score, float("-inf")), (cand_tok, child_tok, 0),
                                   (cand_parent, child_parent, -1)):
                full = torch.full((b, k * k), fill, dtype=src.dtype, device=dev)
                full[a] = src
                dst.append(full)
            ok = torch.zeros(b, k * k, dtype=torch.bool, device=dev)
            ok[a] = True
            cand_ok.append(ok)
            best_score, best = child_score.topk(k, dim=-1)  # [A, K] the next frontier
            fr_tok[a] = child_tok.gather(1, best)
            fr_score[a] = best_score
            fr_node[a] = num_cand + best
            from_branch = best // k
            num_cand += k * k
            act_prev = act
        return self._select(reqs, want, base, cand_tok, cand_score, cand_parent, cand_ok, ran, tree)

    def _select(self, reqs, want, base, cand_tok, cand_score, cand_parent, cand_ok, ran, tree) -> list[Draft | None]:
        """Each request's best candidates as a Draft; remember the nodes whose K/V exist."""
        scores = torch.cat(cand_score, dim=1)  # [B, M]
        ok = torch.cat(cand_ok, dim=1)
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices
        order = order.gather(1, torch.sort(ok.gather(1, order).int(), dim=1, descending=True, stable=True).indices)
        top = order[:, :max(want)].tolist()
        toks = torch.cat(cand_tok, dim=1).tolist()
        parents = torch.cat(cand_parent, dim=1).tolist()
        num_ok = ok.sum(1).tolist()
        out: list[Draft | None] = []
        for i in range(len(reqs)):
            chosen = sorted(top[i][:min(want[i], num_ok[i])])  # parents before children
            at: dict[int, int] = {}
            tokens, tparents = [], []
            for c in chosen:
                p = parents[i][c]
                if p >= 0 and p not in at:
                    continue  # unreachable unless scores are NaN
                at[c] = len(tokens)
                tokens.append(toks[i][c])
                tparents.append(at[p] if p >= 0 else -1)
            out.append(Draft(tokens, tparents) if tokens else None)
        epoch = self._epoch if tree else -1
        computed = [_Computed(base[i], epoch, {}) for i in range(len(reqs))]
        for lv in ran:
            for i, nodes, slots in zip(lv.act, lv.nodes.tolist(), lv.slots.tolist()):
                for c, slot in zip(nodes, slots):
                    computed[i].children[(parents[i][c], toks[i][c])] = (c, slot)
        for req, comp in zip(reqs, computed):
            state = self._states.get(id(req))
            if state is not None and state.valid == comp.root + 1:
                state.computed = comp
        return out


def _tokens(req: Req, start: int, end: int) -> list[int]:
    """``req.all_ids[start:end]`` without building the whole list."""
    n = len(req.input_ids)
    if start >= n:
        return req.output_ids[start - n:end - n]
    if end <= n:
        return req.input_ids[start:end]
    return req.input_ids[start:] + req.output_ids[:end - n]


__all__ = ["DraftModel"]

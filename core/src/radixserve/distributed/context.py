"""Context parallelism for long prefills (``--attn-cp-size C``, SGLang's name).

Every rank of the replica holds the whole model and a whole KV pool. A prefill step (an
extend or mixed batch of at least :data:`MIN_TOKENS` tokens) is cut along its tokens into C
contiguous slices, one per rank: each rank runs the embedding, the linears and the MLPs on
its slice only, and attention ring-style (:func:`ring_attention`):

1. the rank's queries attend to each request's cached prefix (read from its own pool, which
   holds every token's K/V on every rank);
2. the slices' new K/V go round the ring: at step ``i`` a rank holds the block of rank
   ``r - i``, writes it into its pool (so every rank ends the layer with every new token's K/V),
   attends its queries to it under the causal mask (same request, key position <= query
   position, and the sliding window if the model has one) and sends it on while it receives
   the next;
3. the partial results merge by online softmax (each keeps its log-sum-exp), in float32.

The logits rows of each slice are gathered to every rank. Every other step (decode, target
verify, short extends, and any step that keeps hidden states) runs whole on every rank, as on
one, so decode proceeds normally over the full KV each rank holds; rank 0's logits are the
ones sampled.

Same tokens as one rank: the only difference is the order of the float32 sums of attention.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from radixserve.distributed import get_parallel_state, split_range
from radixserve.layers.attention import AttentionLayer, ForwardBatch, ForwardMode

MIN_TOKENS = 64  # a prefill step shorter than this runs whole on every rank (the ring would cost more)
QUERY_BLOCK = 512  # queries per score block: [heads, 512, keys] floats at a time


@dataclass
class RingContext:
    """What every rank knows of a split prefill step (from the whole batch)."""

    bounds: list[tuple[int, int]]  # token range of each rank's slice
    rank: int
    tok_req: torch.Tensor  # [T] request index of each token of the step
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] slots of the step's tokens
    rows: list[int]  # each request's request-to-token row
    prefix_lens: list[int]  # each request's tokens cached before this step
    req_to_token: torch.Tensor
    kv_pool: object


def token_bounds(num_tokens: int, size: int) -> list[tuple[int, int]]:
    return [(s, s + n) for s, n in (split_range(num_tokens, size, r) for r in range(size))]


def splits(batch: ForwardBatch) -> bool:
    """Whether a step is cut along its tokens (see the module docstring)."""
    return (batch.mode in (ForwardMode.EXTEND, ForwardMode.MIXED) and batch.input_ids.shape[0] >= MIN_TOKENS
            and not batch.capture_hidden_layers and not batch.capture_final_hidden)


class ContextParallel:
    """This rank's part of every step of a context-parallel replica."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.ps = get_parallel_state()
        self.num_split_steps = 0

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        runner, ps = self.runner, self.ps
        self.num_split_steps += 1
        total = batch.input_ids.shape[0]
        bounds = token_bounds(total, ps.cp_size)
        t0, t1 = bounds[ps.cp_rank]
        dev = batch.input_ids.device
        tok_req = torch.repeat_interleave(torch.arange(batch.batch_size, device=dev),
                                          torch.tensor(batch.extend_lens_cpu, device=dev))
        ctx = RingContext(bounds, ps.cp_rank, tok_req, batch.positions, batch.out_cache_loc,
                          batch.req_pool_indices.tolist(), list(batch.prefix_lens_cpu), batch.req_to_token,
                          batch.kv_pool)
        li = batch.logits_indices
        mine = li[(li >= t0) & (li < t1)] - t0
        part = dataclasses.replace(batch, input_ids=batch.input_ids[t0:t1], positions=batch.positions[t0:t1],
                                   out_cache_loc=batch.out_cache_loc[t0:t1], logits_indices=mine,
                                   attn_metadata=None, extra={"ring": ctx})
        logits = runner.model(part)  # [rows of this slice, V]
        # every slice's rows, in order, on every rank
        counts = [int(((li >= a) & (li < b)).sum()) for a, b in bounds]
        width = max(counts)
        padded = torch.zeros(width, logits.shape[1], dtype=logits.dtype, device=logits.device)
        padded[:logits.shape[0]] = logits
        parts = [torch.empty_like(padded) for _ in bounds]
        dist.all_gather(parts, padded, group=ps.cpu_group if logits.device.type == "cpu" else None)
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                   ctx: RingContext) -> torch.Tensor:
    """Attention of this rank's queries ``q  # [Tq, H, D]`` (its slice's ``k``/``v``) over
    each request's cached prefix and every new token before them (see the module docstring)."""
    size, rank = len(ctx.bounds), ctx.rank
    t0, t1 = ctx.bounds[rank]
    pool, lid = ctx.kv_pool, layer.layer_id
    q_req, q_pos = ctx.tok_req[t0:t1], ctx.positions[t0:t1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)  # [Tq, H]
    spans = _spans(q_req)  # (request, first row, end row) of each request in this slice
    # 1. each request's cached prefix, from this rank's pool
    for b, lo, hi in spans:
        n = ctx.prefix_lens[b]
        if n == 0:
            continue
        kp, vp = pool.get_kv(lid, ctx.req_to_token[ctx.rows[b], :n])
        rows = torch.arange(lo, hi, device=q.device)
        if layer.sliding_window is None:
            o, s = _attend(q[lo:hi], kp.to(q.dtype), vp.to(q.dtype), False, layer)
        else:
            mask = _window(torch.ones(hi - lo, n, dtype=torch.bool, device=q.device), q_pos[lo:hi],
                           torch.arange(n, device=q.device), layer)
            o, s = _partial(q[lo:hi], kp.to(q.dtype), vp.to(q.dtype), mask, layer)
        _merge(out, lse, rows, o, s)
    # 2. the new tokens' K/V round the ring
    block_k, block_v, src = k.contiguous(), v.contiguous(), rank
    for step in range(size):
        if step:
            src = (rank - step) % size
            a, b = ctx.bounds[src]
            new_k = torch.empty((b - a, *k.shape[1:]), dtype=k.dtype, device=k.device)
            new_v = torch.empty_like(new_k)
            nxt, prv = (rank + 1) % size, (rank - 1) % size
            works = [dist.isend(block_k, nxt), dist.isend(block_v, nxt), dist.irecv(new_k, prv), dist.irecv(new_v, prv)]
            for work in works:
                work.wait()
            block_k, block_v = new_k, new_v
        a, b = ctx.bounds[src]
        pool.set_kv(lid, ctx.out_cache_loc[a:b], block_k, block_v)  # every rank ends with every token's K/V
        if src > rank:  # later tokens: no query here sees them
            continue
        kk, vv = pool.get_kv(lid, ctx.out_cache_loc[a:b])  # as one rank reads them: in the storage dtype
        kk, vv = kk.to(q.dtype), vv.to(q.dtype)
        if layer.sliding_window is not None:
            mask = (ctx.tok_req[a:b][None, :] == q_req[:, None]) & (ctx.positions[a:b][None, :] <= q_pos[:, None])
            mask = _window(mask, q_pos, ctx.positions[a:b], layer)
            if bool(mask.any()):
                o, s = _partial(q, kk, vv, mask, layer)
                _merge(out, lse, torch.arange(t1 - t0, device=q.device), o, s)
            continue
        block_req = ctx.tok_req[a:b]
        for r, lo, hi in spans:  # a request's keys in an earlier block all precede its queries here
            keys = torch.nonzero(block_req == r).squeeze(1)
            if keys.numel() == 0:
                continue
            ka, kb = int(keys[0]), int(keys[-1]) + 1
            o, s = _attend(q[lo:hi], kk[ka:kb], vv[ka:kb], src == rank, layer)
            _merge(out, lse, torch.arange(lo, hi, device=q.device), o, s)
    return out.to(q.dtype)


def _spans(req: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(request, start, end)`` of each run of one request's rows in ``req`` (requests are contiguous)."""
    if req.numel() == 0:
        return []
    change = torch.nonzero(req[1:] != req[:-1]).squeeze(1) + 1
    starts = [0, *change.tolist()]
    ends = [*starts[1:], req.numel()]
    return [(int(req[s]), s, e) for s, e in zip(starts, ends, strict=True)]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q  # [Tq, H, D]`` over all of ``k, v  # [Tk, Hkv, D]`` (``causal``: the
    keys are the queries' own tokens) and its log-sum-exp, by the fused CPU kernel that returns
    it when torch has one, else :func:`_partial`."""
    fused = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if fused is None or q.device.type != "cpu":
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
        return _partial(q, k, v, mask.tril() if causal else mask, layer)
    group = layer.num_heads // layer.num_kv_heads
    qh = q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, H, Tq, D]
    kh = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
    vh = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
    o, s = fused(qh, kh, vh, 0.0, causal, scale=layer.scaling)
    return o[0].transpose(0, 1).float(), s[0].transpose(0, 1).float()


def _window(mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
    if layer.sliding_window is None:
        return mask
    return mask & (k_pos[None, :] > q_pos[:, None] - layer.sliding_window)


def _partial(q, k, v, mask, layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q  # [Tq, H, D]`` over ``k, v  # [Tk, Hkv, D]`` under ``mask  # [Tq, Tk]``:
    its output ``# [Tq, H, D]`` and log-sum-exp ``# [Tq, H]`` (-inf where a row sees no key)."""
    group = layer.num_heads // layer.num_kv_heads
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Tk, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    outs, lses = [], []
    for s in range(0, q.shape[0], QUERY_BLOCK):
        qb = q[s:s + QUERY_BLOCK].float().transpose(0, 1)  # [H, tq, D]
        scores = torch.matmul(qb, kf.transpose(1, 2)) * layer.scaling  # [H, tq, Tk]
        scores.masked_fill_(~mask[s:s + QUERY_BLOCK][None], float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m)
        denom = p.sum(dim=-1, keepdim=True)  # [H, tq, 1]
        o = torch.matmul(p, vf) / denom.clamp_min(1e-30)
        outs.append(o.transpose(0, 1))  # [tq, H, D]
        lses.append((m + torch.log(denom)).squeeze(-1).transpose(0, 1))  # [tq, H]; -inf: no key
    return torch.cat(outs), torch.cat(lses)


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, o: torch.Tensor, s: torch.Tensor) -> None:
    """Fold a partial result into ``out``/``lse`` at ``rows`` (online softmax)."""
    old_out, old_lse = out[rows], lse[rows]
    new = torch.logaddexp(old_lse, s)
    w_old = torch.where(torch.isfinite(old_lse), torch.exp(old_lse - new), torch.zeros_like(new))
    w_new = torch.where(torch.isfinite(s), torch.exp(s - new), torch.zeros_like(new))
    out[rows] = old_out * w_old[..., None] + o * w_new[..., None]
    lse[rows] = new


__all__ = ["MIN_TOKENS", "ContextParallel", "RingContext", "ring_attention", "splits", "token_bounds"]

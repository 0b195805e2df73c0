"""The MoE all-to-all transport ``torch_distributed``: expert parallelism over
``torch.distributed`` collectives (gloo on CPU, NCCL on GPUs), no library of its own.

Every rank of the EP group holds the same ``T`` tokens (attention is tensor-parallel) and
the same routing. Each rank works on its share, and the collectives move rows between
the ``P = ep_size`` ranks of ``ctx.ep_group``:

``dispatch``
    1. rank ``r`` takes tokens ``[start_r, start_r + n_r)``, an even split of ``T``
       (:func:`radixserve.distributed.split_range`);
    2. each of those tokens becomes one send row per rank that holds at least one of its
       chosen experts (expert ``e`` lives on rank ``e // E_local``), the rows ordered by
       destination rank, then token; a row carries the token's hidden state, its ``K``
       choices as that rank's local ids (``-1`` for choices held elsewhere) and its weights
       (``0`` where ``-1``);
    3. the per-destination row counts are exchanged with one ``all_to_all_single``, then
       the rows with one more: each row is one byte string, the hidden state (activations'
       dtype), ``K`` int32 ids and ``K`` float32 weights side by side. The received rows,
       grouped by source rank, are the dispatched layout (``N`` rows, at most ``T``: a
       token reaches a rank at most once).

``combine``
    4. the runner's ``[N, H]`` goes back over the same splits reversed
       (``all_to_all_single``) and each token of the share sums the rows that carried it
       (float32, in the order the ranks were addressed);
    5. an all-gather over the EP group (shares padded to the largest) gives every rank all
       ``T`` tokens again, in token order.

``dispatch_async`` exchanges the counts, starts step 3's rows asynchronously and returns;
``combine_async`` starts step 4 and leaves the sums and step 5 to its ``wait()``. Meanwhile the
layer computes its shared experts (single-batch overlap) or the other micro-batch's layers
(two-batch overlap).

On a single rank dispatch and combine are the identity. With ``moe_tp_size > 1`` every
rank runs this inside its own EP group (the ranks with the same intermediate slice); the
layer sums the slices afterwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from radixserve.plugin_api.moe import DispatchOutput, MoEA2ABackend, MoEContext, Pending, split_range


class TorchDistributedA2A(MoEA2ABackend):
    name = "torch_distributed"

    def __init__(self, ctx: MoEContext) -> None:
        super().__init__(ctx)
        if ctx.num_experts % ctx.ep_size:
            raise ValueError(f"torch_distributed: {ctx.num_experts} experts do not split evenly over "
                             f"{ctx.ep_size} EP ranks")
        self.group = ctx.ep_group_or_default() if ctx.ep_size > 1 else None
        if self.group is not None and dist.get_world_size(self.group) != ctx.ep_size:
            raise ValueError(f"torch_distributed: the EP group has {dist.get_world_size(self.group)} ranks, the "
                             f"MoE context says ep_size {ctx.ep_size}")

    def dispatch(self, hidden_states, topk_ids, topk_weights):
        return self.dispatch_async(hidden_states, topk_ids, topk_weights).wait()

    def dispatch_async(self, hidden_states, topk_ids, topk_weights):
        """The counts exchange, then the rows' ``all_to_all_single`` started asynchronously:
        ``wait()`` waits for it and unpacks the rows."""
        ctx = self.ctx
        if ctx.ep_size == 1:
            return Pending(DispatchOutput(hidden_states, topk_ids.to(torch.int32), topk_weights.float()))
        p, num_local = ctx.ep_size, ctx.num_local_experts
        t, k = topk_ids.shape
        start, n = split_range(t, p, ctx.ep_rank)
        x = hidden_states[start:start + n]  # [n, H]
        ids = topk_ids[start:start + n].long()  # [n, K]
        weights = topk_weights[start:start + n].float()  # [n, K]
        valid = ids >= 0
        dest = torch.where(valid, ids // num_local, torch.full_like(ids, p))  # [n, K]; p: nowhere
        hit = torch.zeros(n, p + 1, dtype=torch.bool, device=ids.device)
        hit.scatter_(1, dest, True)
        hit = hit[:, :p]  # [n, P]: token i has a choice on rank r
        rank_of_row, token_of_row = hit.t().nonzero(as_tuple=True)  # [S], by rank then token
        mine = dest[token_of_row] == rank_of_row.unsqueeze(1)  # [S, K]
        row_ids = torch.where(mine, ids[token_of_row] - rank_of_row.unsqueeze(1) * num_local,
                              torch.full_like(mine, -1, dtype=torch.long))
        row_weights = torch.where(mine, weights[token_of_row], torch.zeros_like(weights[token_of_row]))
        send_counts = hit.sum(0)  # [P]
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        # one message per row: the hidden state's bytes, then K int32 ids, then K float32 weights
        hidden_bytes = x.shape[1] * x.element_size()
        payload = torch.cat([x[token_of_row].contiguous().view(torch.uint8),
                             row_ids.to(torch.int32).view(torch.uint8),
                             row_weights.contiguous().view(torch.uint8)], dim=1)  # [S, bytes per row]
        recv = payload.new_empty(sum(recv_splits), payload.shape[1])
        work = dist.all_to_all_single(recv, payload, recv_splits, send_splits, group=self.group, async_op=True)
        handle = (t, start, n, token_of_row, send_splits, recv_splits)

        def finish() -> DispatchOutput:
            work.wait()
            recv_x = recv[:, :hidden_bytes].contiguous().view(x.dtype)  # [N, H]
            recv_ids = recv[:, hidden_bytes:hidden_bytes + 4 * k].contiguous().view(torch.int32)  # [N, K]
            recv_weights = recv[:, hidden_bytes + 4 * k:].contiguous().view(torch.float32)  # [N, K]
            return DispatchOutput(recv_x, recv_ids, recv_weights, handle)

        return Pending(finish=finish)

    def combine(self, expert_output, dispatched):
        return self.combine_async(expert_output, dispatched).wait()

    def combine_async(self, expert_output, dispatched):
        """Step 4's ``all_to_all_single`` started asynchronously; ``wait()`` waits for it, sums
        each token's rows and runs step 5's all-gather."""
        if self.ctx.ep_size == 1:
            return Pending(expert_output)
        p = self.ctx.ep_size
        t, _, n, token_of_row, send_splits, recv_splits = dispatched.handle
        h = expert_output.shape[1]
        back = expert_output.new_empty(sum(send_splits), h)  # [S, H], in send order
        work = dist.all_to_all_single(back, expert_output.contiguous(), send_splits, recv_splits, group=self.group,
                                      async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            share = torch.zeros(n, h, dtype=torch.float32, device=back.device)
            share.index_add_(0, token_of_row, back.float())
            sizes = [split_range(t, p, r)[1] for r in range(p)]
            padded = expert_output.new_zeros(max(sizes), h)
            padded[:n] = share.to(expert_output.dtype)
            parts = [torch.empty_like(padded) for _ in range(p)]
            dist.all_gather(parts, padded, group=self.group)
            return torch.cat([part[:size] for part, size in zip(parts, sizes)], dim=0)  # [T, H]

        return Pending(finish=finish)

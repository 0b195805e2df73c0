"""DeepEP's dispatch outputs <-> the core's dispatched layout (:class:`DispatchOutput`).

Plain torch, no ``deep_ep`` import; tested on CPU.

**Normal mode** (``Buffer.dispatch``) already gives the dispatched layout: ``recv_x  # [N, H]``
(the rows this rank received, grouped by source rank), ``recv_topk_idx  # [N, K]`` as
*local* expert ids with ``-1`` for choices held by other ranks, and ``recv_topk_weights
# [N, K]``. Only the dtypes change (DeepEP's ``topk_idx_t``, int64, -> int32). ``combine``
sums the rows that came from one token without weights, so the runner's weighted rows
combine to the token's output.

**Low-latency mode** (``Buffer.low_latency_dispatch``) gives DeepGEMM's masked layout:
``recv_x  # [E_local, C, H]`` with ``C = num_max_dispatch_tokens_per_rank * num_ranks``
and ``recv_count  # [E_local]``: expert ``e``'s tokens are ``recv_x[e, :recv_count[e]]``,
the other rows are garbage. As dispatched rows that is ``N = E_local * C`` rows, row
``e * C + j`` with its only valid choice ``e`` (column 0) when ``j < recv_count[e]``, else
no valid choice; its weight is ``1``, because ``low_latency_combine`` applies the routing
weights itself. The runner's ``[N, H]`` output goes back as ``[E_local, C, H]``.
"""

from __future__ import annotations

import torch
from radixserve.plugin_api.moe import DispatchOutput


def normal_to_dispatch(recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor,
                       handle) -> DispatchOutput:
    """``Buffer.dispatch``'s outputs -> the dispatched layout."""
    return DispatchOutput(recv_x, recv_topk_idx.to(torch.int32), recv_topk_weights.float(), handle)


def masked_to_dispatch(recv_x: torch.Tensor, recv_count: torch.Tensor, top_k: int, handle) -> DispatchOutput:
    """``Buffer.low_latency_dispatch``'s ``(recv_x [E_local, C, H], recv_count [E_local])`` -> the
    dispatched layout: ``E_local * C`` rows, one valid choice (the row's expert, weight 1) on
    each row below its expert's count, none on the rest."""
    num_local, cap, hidden = recv_x.shape
    dev = recv_x.device
    slot = torch.arange(cap, device=dev).unsqueeze(0)  # [1, C]
    expert = torch.arange(num_local, device=dev, dtype=torch.int32).unsqueeze(1)  # [E_local, 1]
    first = torch.where(slot < recv_count.to(dev).unsqueeze(1), expert, torch.full_like(expert, -1))  # [E_local, C]
    ids = torch.full((num_local * cap, top_k), -1, dtype=torch.int32, device=dev)
    ids[:, 0] = first.reshape(-1)
    weights = torch.zeros(num_local * cap, top_k, dtype=torch.float32, device=dev)
    weights[:, 0] = (first.reshape(-1) >= 0).float()
    return DispatchOutput(recv_x.reshape(num_local * cap, hidden), ids, weights, handle)


def dispatch_to_masked(expert_output: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """The runner's ``# [E_local * C, H]`` over :func:`masked_to_dispatch`'s rows -> ``# [E_local, C, H]``."""
    return expert_output.reshape(num_local_experts, -1, expert_output.shape[1])

"""Random experts and routings for the triton MoE runner's tests, and the comparison with
:func:`radixserve.layers.moe.reference_moe`.

Error measure: max |triton - reference| / max |reference| over the whole output.
"""

from __future__ import annotations

import torch
from radixserve.layers.moe import reference_moe

#: relative error bound per dtype. float32: summation order only. float16/bfloat16: the
#: kernels round SiLU * up and each routed expert output to the activations' dtype before
#: the next step (the oracle rounds once, at the end), about 2 ulp of the output's scale.
REL_BOUND = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device="cpu",
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13  # [E, 2I, H]``, ``w2  # [E, H, I]`` scaled so outputs are of order one (drawn
    on ``device``: real sizes are billions of numbers)."""
    g = torch.Generator(device).manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g, device=device) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


def routing(num_tokens: int, num_experts: int, top_k: int, *, skew: float = 0.0,
            empty: tuple[int, ...] = (), drop: float = 0.0, device="cpu",
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_ids  # [N, K] int32`` (distinct experts per row) and ``topk_weights  # [N, K]``.

    ``skew`` > 0 concentrates choices on low expert ids (uneven loads), experts in ``empty``
    get no tokens, and a fraction ``drop`` of the choices become ``-1``."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    scores = scores + skew * torch.linspace(1.0, 0.0, num_experts)  # low ids win under skew
    if empty:
        scores[:, list(empty)] = -1.0
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    if drop:
        ids[torch.rand(ids.shape, generator=g) < drop] = -1
    weights = torch.rand(num_tokens, top_k, generator=g)
    weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(device), weights.to(device)


def hidden_states(num_tokens: int, hidden: int, dtype: torch.dtype, device="cpu",
                  seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(num_tokens, hidden, generator=g).to(device, dtype)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.float().abs().max().clamp_min(1e-6)
    return float((out.float() - ref.float()).abs().max() / scale)


def reference(x, ids, weights, w13, w2) -> torch.Tensor:
    """The oracle on CPU (it loops over (token, choice) pairs in Python)."""
    return reference_moe(x.cpu(), ids.cpu(), weights.cpu(), w13.cpu(), w2.cpu())


def check(out: torch.Tensor, x, ids, weights, w13, w2) -> float:
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    err = rel_error(out.cpu(), reference(x, ids, weights, w13, w2))
    assert err <= REL_BOUND[x.dtype], f"relative error {err:.3g} > {REL_BOUND[x.dtype]:g}"
    return err

"""Start-up of a model's MoE layers: resolve ``--moe-runner-backend`` and
``--moe-a2a-backend`` once and hand every sparse layer its runner, transport and expert
load counters."""

from __future__ import annotations

import logging

import torch
from torch import nn

from radixserve.config import ServerArgs
from radixserve.layers.moe import ExpertLoadRecorder, MoEContext, moe_layers
from radixserve.registry import Registry

logger = logging.getLogger(__name__)

DEFAULT_A2A_BACKEND = "none"


def default_runner_name(registry: Registry, device: torch.device) -> str:
    """``triton`` on a GPU when it is installed and usable there, else ``torch_native``."""
    if device.type == "cuda":
        entry = registry.entries["moe_runner"].get("triton")
        if entry is not None and entry.is_available:
            return "triton"
    return "torch_native"


def check_moe_flags(registry: Registry, args: ServerArgs) -> None:
    """A named runner or transport must exist even when the model has no MoE layer."""
    if args.moe_runner_backend not in (None, "auto"):
        registry.get("moe_runner", args.moe_runner_backend, flag="--moe-runner-backend")
    if args.moe_a2a_backend is not None:
        registry.get("moe_a2a", args.moe_a2a_backend, flag="--moe-a2a-backend")


def setup_moe(model: nn.Module, registry: Registry, args: ServerArgs, *, dtype: torch.dtype,
              device: torch.device, max_num_tokens: int) -> ExpertLoadRecorder | None:
    """Bind the runner and transport to every sparse MoE layer of ``model`` (after its
    weights are placed). Returns the model's expert load recorder, or None for a dense
    model (whose MoE flags are only checked for valid names)."""
    check_moe_flags(registry, args)
    layers = moe_layers(model)
    if not layers:
        if args.moe_runner_backend not in (None, "auto") or args.moe_a2a_backend not in (None, DEFAULT_A2A_BACKEND):
            logger.warning("the model has no MoE layers; --moe-runner-backend/--moe-a2a-backend are unused")
        return None
    first = layers[0][1]
    ctx = MoEContext(num_experts=first.num_experts, top_k=first.top_k, hidden_size=first.hidden_size,
                     intermediate_size=first.intermediate_size, dtype=dtype, device=device,
                     num_moe_layers=len(layers), max_num_tokens=max_num_tokens)
    runner_name = args.moe_runner_backend
    if runner_name in (None, "auto"):
        runner_name = default_runner_name(registry, device)
    runner = registry.resolve("moe_runner", runner_name, flag="--moe-runner-backend").factory(ctx)
    a2a_name = args.moe_a2a_backend or DEFAULT_A2A_BACKEND
    a2a = registry.resolve("moe_a2a", a2a_name, flag="--moe-a2a-backend").factory(ctx)
    recorder = ExpertLoadRecorder(len(layers), ctx.num_experts, device)
    recorder.layer_ids = [i for i, _ in layers]
    for row, (_, layer) in enumerate(layers):
        layer.bind(runner, a2a, recorder, row)
    logger.info("MoE: %d sparse layers, %d experts top-%d, runner %s, a2a %s", len(layers), ctx.num_experts,
                ctx.top_k, runner_name, a2a_name)
    return recorder

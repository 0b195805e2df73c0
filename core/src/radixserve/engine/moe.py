"""Start-up of a model's MoE layers: resolve ``--moe-runner-backend`` and
``--moe-a2a-backend`` once and hand every sparse layer its runner, transport and expert
load counters, under the parallel state (:mod:`radixserve.distributed`: which experts and
which intermediate slice this rank holds) and, with ``--init-expert-location``, the
expert placement of :mod:`radixserve.engine.eplb`."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from radixserve.config import ConfigError, ServerArgs
from radixserve.distributed import get_parallel_state, split_range
from radixserve.engine.eplb import imbalance, plan_placement, rank_loads
from radixserve.engine.expert_distribution import load_distribution
from radixserve.layers.moe import ExpertLoadRecorder, ExpertLocation, MoEContext, moe_layers
from radixserve.options import options_for
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
    for i, layer in layers:
        if (layer.num_experts, layer.intermediate_size) != (first.num_experts, first.intermediate_size):
            raise ValueError(f"MoE layer {i} has {layer.num_experts} experts of intermediate size "
                             f"{layer.intermediate_size}, layer {layers[0][0]} {first.num_experts} of "
                             f"{first.intermediate_size}; one runner serves every layer, so they must agree")
    ps = get_parallel_state()
    num_redundant = getattr(args, "ep_num_redundant_experts", 0) or 0
    location_file = getattr(args, "init_expert_location", None)
    num_physical = first.num_experts + num_redundant
    if num_physical % ps.ep_size:
        if num_redundant:
            raise ConfigError(f"{first.num_experts} experts + --ep-num-redundant-experts {num_redundant} = "
                              f"{num_physical} physical experts do not split evenly over --ep-size {ps.ep_size}; "
                              f"choose N so that {first.num_experts} + N is a multiple of {ps.ep_size}")
        raise ConfigError(f"--ep-size {ps.ep_size} must divide the model's {first.num_experts} experts per layer")
    _, local_inter = split_range(first.intermediate_size, ps.moe_tp_size, ps.moe_tp_rank)
    if local_inter == 0:
        raise ConfigError(f"--tp-size {ps.tp_size} / --ep-size {ps.ep_size} = {ps.moe_tp_size} slices of each "
                          f"expert, more than its intermediate size {first.intermediate_size}")
    ctx = MoEContext(num_experts=num_physical, top_k=first.top_k, hidden_size=first.hidden_size,
                     intermediate_size=local_inter, dtype=dtype, device=device,
                     num_moe_layers=len(layers), max_num_tokens=max_num_tokens, ep_rank=ps.ep_rank,
                     ep_size=ps.ep_size, moe_tp_rank=ps.moe_tp_rank, moe_tp_size=ps.moe_tp_size,
                     num_redundant_experts=num_redundant, ep_group=ps.ep_group, moe_tp_group=ps.moe_tp_group)
    locations: dict[int, ExpertLocation] = {}
    if location_file:
        record = load_distribution(location_file)
        plans = plan_placement(record, [i for i, _ in layers], first.num_experts,
                               num_redundant, ps.ep_size, source=f"--init-expert-location {location_file}")
        locations = {i: ExpertLocation(plan, first.num_experts) for i, plan in plans.items()}
        loads = dict(zip(record["layers"], record["counts"]))
        before = max(imbalance(rank_loads(range(first.num_experts), loads[i], ps.ep_size)) for i in plans) \
            if first.num_experts % ps.ep_size == 0 else float("nan")
        after = max(imbalance(rank_loads(plan, loads[i], ps.ep_size)) for i, plan in plans.items())
        logger.info("EPLB: %d redundant experts per layer placed from %s; recorded load per EP rank, worst layer "
                    "max/mean: %.3f in rank order, %.3f placed", num_redundant, location_file, before, after)
    elif num_redundant:
        raise ConfigError("--ep-num-redundant-experts needs --init-expert-location (a recorded expert distribution)")
    runner_name = args.moe_runner_backend
    if runner_name in (None, "auto"):
        runner_name = default_runner_name(registry, device)
    entry = registry.resolve("moe_runner", runner_name, flag="--moe-runner-backend")
    runner = entry.factory(dataclasses.replace(ctx, options=options_for(args, entry)))
    a2a_name = args.moe_a2a_backend or DEFAULT_A2A_BACKEND
    entry = registry.resolve("moe_a2a", a2a_name, flag="--moe-a2a-backend")
    a2a = entry.factory(dataclasses.replace(ctx, options=options_for(args, entry)))
    recorder = ExpertLoadRecorder(len(layers), first.num_experts, device)  # per logical expert
    recorder.layer_ids = [i for i, _ in layers]
    for row, (i, layer) in enumerate(layers):
        layer.bind(runner, a2a, recorder, row, locations.get(i))
        layer.single_batch_overlap = args.enable_single_batch_overlap  # shared experts while tokens travel
    logger.info("MoE: %d sparse layers, %d experts (+%d redundant) top-%d, runner %s, a2a %s, ep rank %d/%d "
                "(%d local experts), moe-tp rank %d/%d (intermediate %d of %d)", len(layers), first.num_experts,
                num_redundant, ctx.top_k, runner_name, a2a_name, ctx.ep_rank, ctx.ep_size, ctx.num_local_experts,
                ctx.moe_tp_rank, ctx.moe_tp_size, local_inter, first.intermediate_size)
    return recorder

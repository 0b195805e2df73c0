"""The engine's LoRA set-up: the adapter manager and its backend (``--enable-lora``), the
flags it cannot run with yet, and each batch's adapter slots (:mod:`radixserve.lora`)."""

from __future__ import annotations

import dataclasses
import logging

from radixserve.config import ConfigError
from radixserve.lora.backend import LoRAContext

logger = logging.getLogger(__name__)

DEFAULT_LORA_BACKEND = "torch_native"


def check_lora_supported(args) -> None:
    """Flags LoRA cannot run with yet fail at start-up, naming them."""
    if not args.enable_lora:
        return
    not_yet = {"--tp-size": args.tp_size > 1, "--pp-size": args.pp_size > 1, "--attn-cp-size": args.attn_cp_size > 1,
               "--dp-size": args.dp_size > 1, "--disaggregation-mode": args.disaggregation_mode != "null"}
    for flag, on in not_yet.items():
        if on:
            raise ConfigError(f"{flag} with --enable-lora: not with LoRA adapters yet; drop one of the two")


def setup_lora(runner, registry):
    """The runner's :class:`~radixserve.lora.manager.LoRAManager`, or None without ``--enable-lora``."""
    args = runner.args
    if not args.enable_lora:
        return None
    from radixserve.lora.adapter import LoRAError
    from radixserve.lora.manager import LoRAManager
    from radixserve.options import options_for

    name = args.lora_backend or DEFAULT_LORA_BACKEND
    entry = registry.resolve("lora", name, flag="--lora-backend")

    def make(max_loras: int, max_rank: int):
        ctx = LoRAContext(max_loras, max_rank, runner.dtype, runner.device)
        return entry.factory(dataclasses.replace(ctx, options=options_for(args, entry)))

    try:
        manager = LoRAManager(runner.model, args, make)
    except LoRAError as e:
        raise ConfigError(f"--lora-paths: {e}") from None
    logger.info("LoRA: %d adapters loaded (%s), %d slots of rank %d over %s, backend %s", len(manager.adapters),
                ", ".join(manager.adapters) or "none", manager.max_slots, manager.max_rank,
                ", ".join(manager.targets), name)
    return manager

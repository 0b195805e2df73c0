"""The engine's LoRA set-up: the adapter manager and its backend (``--enable-lora``), the
flags it cannot run with yet, and run-time loads and unloads on every rank of a replica
(:mod:`radixserve.lora`)."""

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
    not_yet = {"--pp-size": args.pp_size > 1, "--attn-cp-size": args.attn_cp_size > 1,
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
    # rank 0 of a multi-rank replica (its step driver is set once the ranks are up): the other
    # ranks fill the same slots before the next step
    manager.announce = lambda op, *values: runner.step_driver and runner.step_driver.defer(op, *values)
    logger.info("LoRA: %d adapters loaded (%s), %d slots of rank %d over %s, backend %s", len(manager.adapters),
                ", ".join(manager.adapters) or "none", manager.max_slots, manager.max_rank,
                ", ".join(manager.targets), name)
    return manager


def _manager(runner):
    from radixserve.lora.adapter import LoRAError

    if runner.lora is None:
        raise LoRAError("this server serves no LoRA adapters (start it with --enable-lora or --lora-paths)")
    return runner.lora


def load_adapter(runner, name: str, path: str) -> None:
    """Load a PEFT adapter at run time on every rank (rank 0 checks it first: a bad adapter is
    refused with LoRAError before another rank reads it)."""
    from radixserve.distributed.step_sync import RankCallError
    from radixserve.lora.adapter import LoRAError

    manager = _manager(runner)
    manager.load(name, path)
    if runner.step_driver is not None:
        try:
            runner.step_driver.call("lora.load", [name, path], {"lora.load": lambda _p: None})
        except RankCallError as e:
            manager.unload(name, set())
            runner.step_driver.call("lora.unload", name, {"lora.unload": lambda _p: None})
            raise LoRAError(f"LoRA adapter {name!r}: another rank could not load it ({e})") from None


def unload_adapter(runner, name: str, in_use: set) -> None:
    """Unload adapter ``name`` on every rank; refused (LoRAError) while ``in_use`` (the queued
    and running requests' adapters) names it."""
    _manager(runner).unload(name, in_use)
    if runner.step_driver is not None:
        runner.step_driver.call("lora.unload", name, {"lora.unload": lambda _p: None})


def adapters_in_use(queues) -> set:
    """The adapters of the requests compiling a grammar, queued or running (never unloaded)."""
    return {r.lora_name for r in (*queues.grammar, *queues.waiting, *queues.running)}

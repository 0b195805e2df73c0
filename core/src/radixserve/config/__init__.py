"""Engine configuration: :class:`ServerArgs`, shared by the offline Engine and the CLI.

Field names follow SGLang's ``ServerArgs``; each field maps to ``--field-name`` on the
command line and to an ``Engine(field_name=...)`` keyword. The fields are declared in groups,
one module each, with each group's checks beside its fields:

================ ==========================================================================
``model``        the checkpoint, dtype, device, chat template, sampling defaults, logging
``cache``        the KV pool, the radix cache, HiCache's tiers
``scheduler``    admission caps, prefill budgets, policy and priority, overlap, CUDA graphs
``parallel``     tensor/expert/data parallelism, nodes, MoE runner and transport, EPLB
``speculative``  speculative decoding's method, draft model and draft sizes
``backends``     attention and grammar backends, JSON constraint bounds
``limits``       what one request may ask for (stop strings, stop ids, logit bias, n x prompt)
``disaggregation`` prefill-decode disaggregation: mode, transfer engine, bootstrap endpoint
``lora``         LoRA adapters: the ones loaded at start-up, the adapter pool, the backend
================ ==========================================================================

``ServerArgs`` is all of them in one flat object (``args.page_size``), plus the options
plugins declare (``plugin_options``, :mod:`radixserve.options`); ``args.cache_args`` and the
like give one group alone. The HTTP server's own flags are ``radixserve_server.http_args``.
Bad values raise :class:`ConfigError` naming the flag and what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from radixserve.config.backends import (
    DEFAULT_ATTENTION_BACKEND,
    DEFAULT_GRAMMAR_COMPILE_TIMEOUT,
    BackendArgs,
)
from radixserve.config.cache import (
    HICACHE_IO_BACKENDS,
    HICACHE_PREFETCH_POLICIES,
    HICACHE_WRITE_POLICIES,
    CacheArgs,
)
from radixserve.config.disaggregation import DISAGGREGATION_MODES, DisaggregationArgs
from radixserve.config.limits import RequestLimitArgs
from radixserve.config.lora import LORA_TARGET_MODULES, LoRAArgs
from radixserve.config.model import (
    DEVICES,
    DTYPES,
    KV_CACHE_DTYPES,
    PREFERRED_SAMPLING_FIELDS,
    REASONING_PARSERS,
    SAMPLING_DEFAULTS,
    ModelArgs,
)
from radixserve.config.parallel import EXPERT_DISTRIBUTION_MODES, ParallelArgs
from radixserve.config.scheduler import SCHEDULE_POLICIES, SchedulerArgs
from radixserve.config.speculative import SpeculativeArgs
from radixserve.flags import ConfigError, flag_of

GROUPS = (("model", ModelArgs), ("cache", CacheArgs), ("scheduler", SchedulerArgs), ("parallel", ParallelArgs),
          ("speculative", SpeculativeArgs), ("backends", BackendArgs), ("limits", RequestLimitArgs),
          ("disaggregation", DisaggregationArgs), ("lora", LoRAArgs))

__all__ = ["DEFAULT_ATTENTION_BACKEND", "DEFAULT_GRAMMAR_COMPILE_TIMEOUT", "DEVICES", "DISAGGREGATION_MODES",
           "DTYPES", "DisaggregationArgs",
           "EXPERT_DISTRIBUTION_MODES", "GROUPS", "HICACHE_IO_BACKENDS", "HICACHE_PREFETCH_POLICIES",
           "HICACHE_WRITE_POLICIES", "KV_CACHE_DTYPES", "LORA_TARGET_MODULES", "LoRAArgs",
           "PREFERRED_SAMPLING_FIELDS", "REASONING_PARSERS",
           "SAMPLING_DEFAULTS", "SCHEDULE_POLICIES", "BackendArgs", "CacheArgs", "ConfigError", "ModelArgs",
           "ParallelArgs", "RequestLimitArgs", "SchedulerArgs", "ServerArgs", "SpeculativeArgs", "flag_of",
           "without_plugin_flags"]


@dataclass
class ServerArgs(LoRAArgs, DisaggregationArgs, RequestLimitArgs, BackendArgs, SpeculativeArgs, ParallelArgs,
                 SchedulerArgs, CacheArgs, ModelArgs):
    # the flags plugins declare (radixserve.options), by field name; set through the same
    # keywords and flags as the fields of the groups
    plugin_options: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})

    def __post_init__(self) -> None:
        for f in self.core_fields():
            value = getattr(self, f.name)
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ConfigError(f"{flag_of(f.name)}: invalid value {value!r}; choose from: {', '.join(choices)}")
            if str(f.type) == "bool" and not isinstance(value, bool):
                raise ConfigError(f"{flag_of(f.name)} is a switch (true/false), got {value!r}")
        self.check_model()
        self.check_cache()
        self.check_scheduler()
        self.check_parallel()
        self.check_speculative()
        self.check_backends()
        self.check_limits()
        self.check_disaggregation()
        self.check_lora()

    def _group(self, group: type) -> Any:
        return group(**{f.name: getattr(self, f.name) for f in dataclasses.fields(group)})

    @property
    def model_args(self) -> ModelArgs:
        return self._group(ModelArgs)

    @property
    def cache_args(self) -> CacheArgs:
        return self._group(CacheArgs)

    @property
    def scheduler_args(self) -> SchedulerArgs:
        return self._group(SchedulerArgs)

    @property
    def parallel_args(self) -> ParallelArgs:
        return self._group(ParallelArgs)

    @property
    def speculative_args(self) -> SpeculativeArgs:
        return self._group(SpeculativeArgs)

    @property
    def backend_args(self) -> BackendArgs:
        return self._group(BackendArgs)

    @property
    def limit_args(self) -> RequestLimitArgs:
        return self._group(RequestLimitArgs)

    @property
    def disaggregation_args(self) -> DisaggregationArgs:
        return self._group(DisaggregationArgs)

    @property
    def lora_args(self) -> LoRAArgs:
        return self._group(LoRAArgs)

    # ------------------------------------------------------------------ CLI
    def options_for(self, entry) -> Any:
        """The checked options instance of a registry entry that declares some, else None."""
        from radixserve.options import options_for

        return options_for(self, entry)

    @classmethod
    def core_fields(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]

    @classmethod
    def from_kwargs(cls, registry=None, **kwargs: Any) -> ServerArgs:
        """Engine keywords: the core's fields, and the options plugins declare (``registry``:
        the process-wide one by default), each checked."""
        known = {f.name for f in dataclasses.fields(cls)}
        plugin = dict(kwargs.pop("plugin_options", None) or {})
        extra = {k: kwargs.pop(k) for k in sorted(set(kwargs) - known)}
        if extra or plugin:
            declared = _plugin_option_fields(registry, known)
            unknown = sorted(set(extra) - set(declared))
            if unknown:
                valid = sorted(known - {"plugin_options"}) + sorted(declared)
                raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}; valid: {', '.join(valid)}")
            plugin.update(extra)
            _check_plugin_options(plugin, declared)
        return cls(**kwargs, plugin_options=plugin)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, registry=None) -> None:
        """The core's flags, then (unless :func:`without_plugin_flags` is in effect) every
        flag the installed plugins declare, one group per plugin."""
        from radixserve.options import add_field_arguments

        for title, group in GROUPS:
            add_field_arguments(parser.add_argument_group(f"engine: {title}"), dataclasses.fields(group))
        if not _PLUGIN_FLAGS[0]:
            return
        declared = _plugin_option_fields(registry, {f.name for f in dataclasses.fields(cls)})
        by_entry: dict[tuple, list] = {}
        for entry, f in declared.values():
            by_entry.setdefault((entry.kind, entry.name, entry.distribution), []).append(f)
        for (kind, name, dist), fields in sorted(by_entry.items()):
            add_field_arguments(parser.add_argument_group(f"{kind} {name} ({dist})"), fields)
        parser.set_defaults(_plugin_option_names=sorted(declared))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, registry=None) -> ServerArgs:
        plugin = {name: getattr(args, name) for name in getattr(args, "_plugin_option_names", ())}
        out = cls(**{f.name: getattr(args, f.name) for f in cls.core_fields()}, plugin_options=plugin)
        if plugin:  # each plugin's options as a whole (rules across its fields), before anything loads
            _check_plugin_options(plugin, _plugin_option_fields(registry, {f.name for f in dataclasses.fields(cls)}))
        return out



_PLUGIN_FLAGS = [True]  # whether add_cli_args adds the plugins' flags (see without_plugin_flags)


class without_plugin_flags:  # noqa: N801 - used as a context manager
    """Build parsers without the plugins' flags (``radixserve`` builds every command's parser,
    and only the command that runs needs them: collecting them loads every plugin kind)."""

    def __enter__(self) -> None:
        self._saved = _PLUGIN_FLAGS[0]
        _PLUGIN_FLAGS[0] = False

    def __exit__(self, *exc) -> None:
        _PLUGIN_FLAGS[0] = self._saved


def _plugin_option_fields(registry, reserved: set[str]) -> dict:
    if registry is None:
        from radixserve.registry import get_registry

        registry = get_registry()
    return registry.option_fields(reserved)


def _check_plugin_options(values: dict[str, Any], declared: dict) -> None:
    """Check every given plugin option, then each declaring plugin's options as a whole."""
    from radixserve.options import check_value, make_options

    entries = {}
    for name, value in values.items():
        entry, f = declared[name]
        check_value(f, value)
        entries[id(entry.options)] = entry.options
    for options_cls in entries.values():
        make_options(options_cls, values)

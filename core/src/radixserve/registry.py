"""Plugin loading and the registry of named backends.

Plugins are found through the entry-point group ``radixserve`` and loaded once, lazily,
the first time the registry is asked for. ``RADIXSERVE_PLUGINS=a,b`` restricts loading to
the listed entry points or distributions (the core's own built-ins always load; an empty
value loads none but them). Each registration becomes an :class:`Entry` that knows its
kind, name, providing distribution and availability. Names are resolved once at start-up
(:meth:`Registry.resolve`); the engine then calls the returned objects directly.

A kind's hooks run the first time that kind is asked for, not before: building the command
line needs only the ``command`` kind, so ``radixserve --help`` never runs (or imports what
is behind) the attention, MoE or model hooks.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from radixserve import hookspecs
from radixserve.options import describe_fields, is_options_class

ENTRY_POINT_GROUP = "radixserve"
ALLOWLIST_ENV = "RADIXSERVE_PLUGINS"
CORE_DISTRIBUTION = "radixserve"


@dataclass(frozen=True)
class Kind:
    """One kind of plugin: the hook that feeds it and the CLI flags that choose from it."""

    name: str
    hook: str
    flags: tuple[str, ...]
    title: str


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("attention", "register_attention_backends",
             ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend"),
             "attention backend"),
        Kind("moe_runner", "register_moe_runners", ("--moe-runner-backend",), "MoE runner"),
        Kind("moe_a2a", "register_moe_a2a_backends", ("--moe-a2a-backend",), "MoE all-to-all transport"),
        Kind("cache_tier", "register_cache_tiers", ("--hicache-storage-backend",), "KV cache tier"),
        Kind("kv_transfer", "register_kv_transfer_backends", (),
             "KV transfer engine (prefill-decode disaggregation)"),
        Kind("speculative", "register_speculative_algorithms", ("--speculative-algorithm",),
             "speculative decoding method"),
        Kind("grammar", "register_grammar_backends", ("--grammar-backend",), "grammar backend"),
        Kind("quantization", "register_quantization_methods", ("--quantization",), "quantization method"),
        Kind("lora", "register_lora_backends", ("--lora-backend",), "LoRA backend"),
        Kind("model", "register_model_architectures", (), "model architecture"),
        Kind("command", "register_commands", (), "CLI command"),
    )
}


class PluginError(Exception):
    """A plugin could not be loaded, registered or resolved; the message says what to do."""


class UnknownBackendError(PluginError, ValueError):
    pass


class BackendUnavailableError(PluginError, RuntimeError):
    pass


@dataclass
class Entry:
    kind: str
    name: str
    factory: Any
    distribution: str
    probe: Callable[[], str | None] | None = None
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    options: type | None = None  # the dataclass of flags it declares (radixserve.options)

    def unavailable_reason(self) -> str | None:
        """``None`` when usable here, else why not. A probe that raises counts as a reason."""
        if self.probe is None:
            return None
        try:
            return self.probe()
        except Exception as e:  # a broken probe must not take the listing down
            return f"availability probe failed: {type(e).__name__}: {e}"

    @property
    def is_available(self) -> bool:
        return self.unavailable_reason() is None


def _distribution_of(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else ep.module.split(".")[0]


def _normalize(name: str) -> str:
    """Distribution names compare like pip compares them: case, ``-``, ``_`` and ``.`` aside."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _allowlist() -> set[str] | None:
    raw = os.environ.get(ALLOWLIST_ENV)
    if raw is None:
        return None
    return {_normalize(p.strip()) for p in raw.split(",") if p.strip()}


class Registry:
    """Every registered backend, by kind and name."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self._distribution: dict[str, str] = {}  # plugin name -> distribution
        self._entries: dict[str, dict[str, Entry]] = {}  # kind -> its entries, collected on first use

    # ---------------------------------------------------------------- loading
    def load_entry_points(self) -> None:
        allow = _allowlist()
        seen: set[str] = set()
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = _distribution_of(ep)
            key = f"{dist}:{ep.name}"
            if key in seen:  # the same distribution can be visible twice on sys.path
                continue
            seen.add(key)
            if (dist != CORE_DISTRIBUTION and allow is not None
                    and not ({_normalize(ep.name), _normalize(dist)} & allow)):
                continue
            try:
                module = ep.load()
            except Exception as e:
                raise PluginError(
                    f"plugin entry point {ep.name!r} from {dist} failed to import: "
                    f"{type(e).__name__}: {e}. Uninstall it or leave it out of {ALLOWLIST_ENV}."
                ) from e
            try:
                self.add_plugin(module, name=key, distribution=dist)
            except pluggy.PluginValidationError as e:
                raise PluginError(f"plugin entry point {ep.name!r} from {dist} is invalid: {e}") from e
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            name = self.pm.get_name(e.plugin)
            raise PluginError(
                f"plugin {name} from {self._distribution.get(name, name)} implements a hook that "
                f"does not exist: {e}. Known hooks: {', '.join(k.hook for k in KINDS.values())}"
            ) from e

    def add_plugin(self, plugin: object, *, name: str, distribution: str) -> None:
        """Register a plugin object (a module or any object with hook implementations)."""
        self.pm.register(plugin, name=name)
        self._distribution[name] = distribution
        self._entries = {}

    def remove_plugin(self, name: str) -> None:
        self.pm.unregister(name=name)
        self._distribution.pop(name, None)
        self._entries = {}

    def _collect(self, kind: Kind) -> dict[str, Entry]:
        """Run ``kind``'s hook implementations and gather what they register."""
        table: dict[str, Entry] = {}
        caller = getattr(self.pm.hook, kind.hook)
        for impl in caller.get_hookimpls():
            dist = self._distribution.get(impl.plugin_name, impl.plugin_name)

            def register(name, factory, probe=None, description="", options=None, _kind=kind, _dist=dist,
                         **extra):
                if not isinstance(name, str) or not name:
                    raise PluginError(f"{_dist} registered a {_kind.title} with a bad name {name!r}")
                if options is not None and not is_options_class(options):
                    raise PluginError(f"{_dist}: the options of {_kind.title} {name!r} must be a dataclass, "
                                      f"got {options!r}")
                if name in table and table[name].distribution != _dist:
                    raise PluginError(
                        f"{_kind.title} {name!r} is registered by two distributions: "
                        f"{table[name].distribution} and {_dist}. Uninstall one of them or "
                        f"restrict loading with {ALLOWLIST_ENV}."
                    )
                table[name] = Entry(_kind.name, name, factory, _dist, probe, description, extra, options)

            impl.function(register=register)
        return table

    def kind_entries(self, kind: str) -> dict[str, Entry]:
        """The entries of one kind (``KeyError`` for an unknown kind), its hooks run on first use."""
        table = self._entries.get(kind)
        if table is None:
            table = self._collect(KINDS[kind])
            self._entries[kind] = table
        return table

    @property
    def entries(self) -> Mapping[str, dict[str, Entry]]:
        """Every kind's entries by kind, in :data:`KINDS` order; a kind is collected when looked up."""
        return _Entries(self)

    def option_fields(self, reserved: set[str] = frozenset()) -> dict[str, tuple[Entry, dataclasses.Field]]:
        """Every flag a plugin declares, by field name, with the entry that declares it
        (collects every kind but commands). Two distributions declaring one name, or a
        plugin declaring a core flag (``reserved``), is a PluginError."""
        out: dict[str, tuple[Entry, dataclasses.Field]] = {}
        for kind in KINDS:
            if kind == "command":
                continue
            for entry in self.kind_entries(kind).values():
                for f in dataclasses.fields(entry.options) if entry.options else ():
                    if f.name in reserved:
                        raise PluginError(f"{entry.distribution} declares the option {f.name!r} of {kind} "
                                          f"{entry.name!r}, which is a core flag; rename it")
                    seen = out.get(f.name)
                    if seen is not None and seen[0].distribution != entry.distribution:
                        raise PluginError(f"the option {f.name!r} is declared by two distributions: "
                                          f"{seen[0].distribution} and {entry.distribution}")
                    out.setdefault(f.name, (entry, f))
        return out

    # -------------------------------------------------------------- resolving
    def names(self, kind: str) -> list[str]:
        return sorted(self.kind_entries(kind))

    def get(self, kind: str, name: str, *, flag: str | None = None) -> Entry:
        """The entry for ``name``; an unknown name is an error that lists the choices."""
        table = self.kind_entries(kind)
        if name not in table:
            what = flag or KINDS[kind].title
            choices = ", ".join(sorted(table)) or "(none installed)"
            raise UnknownBackendError(f"{what}: unknown {KINDS[kind].title} {name!r}; choose from: {choices}")
        return table[name]

    def resolve(self, kind: str, name: str, *, flag: str | None = None) -> Entry:
        """Like :meth:`get`, and the entry must also be available here."""
        entry = self.get(kind, name, flag=flag)
        reason = entry.unavailable_reason()
        if reason is not None:
            what = flag or KINDS[kind].title
            ok = [n for n, e in sorted(self.kind_entries(kind).items()) if e.is_available]
            raise BackendUnavailableError(
                f"{what}: {KINDS[kind].title} {name!r} (from {entry.distribution}) is not available "
                f"here: {reason}. Available: {', '.join(ok) or '(none)'}"
            )
        return entry

    def describe(self) -> list[dict[str, Any]]:
        rows = []
        for kind, table in self.entries.items():
            for name, e in sorted(table.items()):
                reason = e.unavailable_reason()
                rows.append({
                    "kind": kind, "name": name, "package": e.distribution,
                    "available": reason is None, "reason": reason, "description": e.description,
                    "options": describe_fields(e.options) if e.options else [],
                    "features": [f for attr, f in FEATURES.get(kind, ()) if getattr(e.factory, attr, False) is True],
                })
        return rows


# capabilities a backend class declares, shown by ``radixserve plugins`` (attribute, name)
FEATURES = {"attention": (("supports_mla", "mla"), ("supports_target_verify", "target-verify"))}


class _Entries(Mapping):
    """``Registry.entries``: a read-only view that collects a kind when it is looked up."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def __getitem__(self, kind: str) -> dict[str, Entry]:
        return self._registry.kind_entries(kind)

    def __iter__(self) -> Iterator[str]:
        return iter(KINDS)

    def __len__(self) -> int:
        return len(KINDS)


_registry: Registry | None = None


def get_registry() -> Registry:
    """The process-wide registry, loading entry points on first use."""
    global _registry
    if _registry is None:
        reg = Registry()
        reg.load_entry_points()
        _registry = reg
    return _registry


def reset_registry() -> None:
    """Forget the loaded registry (tests use this after changing the environment)."""
    global _registry
    _registry = None

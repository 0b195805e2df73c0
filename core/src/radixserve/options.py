"""Options a plugin declares: a dataclass whose fields are its command-line flags.

A plugin passes ``options=MyOptions`` to ``register``; each field becomes ``--field-name`` on
``radixserve serve`` / ``generate`` and an ``Engine(field_name=...)`` keyword, with the help
text, choices and bounds given by :func:`option`. The plugin's factory receives the checked
instance as ``ctx.options``. Field names are global flags: prefix them with the plugin's
name (``speculative_ngram_...``, ``deepep_mode``). An optional ``validate(self)`` method checks
what spans fields and raises :class:`~radixserve.config.ConfigError` naming the flag.

This module imports no torch: entry-point modules declare their options with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from radixserve.flags import ConfigError, flag_of

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def option(default: Any, help: str, *, choices: tuple | None = None, minimum: float | None = None,
           maximum: float | None = None) -> Any:
    """A dataclass field that is a flag: its default, help text, allowed values or bounds."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if minimum is not None:
        meta["minimum"] = minimum
    if maximum is not None:
        meta["maximum"] = maximum
    return dataclasses.field(default=default, metadata=meta)


def _base_type(f: dataclasses.Field) -> tuple[type | None, bool]:
    """(the field's scalar type, or a list's item type; whether None is allowed), from its
    annotation's text (``int``, ``float | None``, ``list[int] | None``)."""
    parts = str(f.type).replace(" ", "").split("|")
    for part in parts:
        if part.startswith(("list[", "tuple[")):
            part = part[part.index("[") + 1:].rstrip("]").split(",")[0]
        if part in _TYPES:
            return _TYPES[part], "None" in parts
    return None, "None" in parts


def check_value(f: dataclasses.Field, value: Any) -> None:
    """ConfigError naming the flag when ``value`` does not fit field ``f``."""
    flag = flag_of(f.name)
    typ, optional = _base_type(f)
    if value is None:
        if optional or f.default is None:
            return
        raise ConfigError(f"{flag}: a value is required")
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{flag} is a switch (true/false), got {value!r}")
    elif typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{flag} must be an integer, got {value!r}")
    elif typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ConfigError(f"{flag} must be a number, got {value!r}")
    elif typ is str and not isinstance(value, str):
        raise ConfigError(f"{flag} must be a string, got {value!r}")
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{flag}: invalid value {value!r}; choose from: {', '.join(map(str, choices))}")
    lo, hi = f.metadata.get("minimum"), f.metadata.get("maximum")
    if lo is not None and value < lo:
        raise ConfigError(f"{flag} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ConfigError(f"{flag} must be <= {hi}, got {value}")


def make_options(cls: type, values: dict[str, Any]) -> Any:
    """An instance of the options dataclass ``cls`` from ``values`` (its fields' names; the
    rest take their defaults), every field checked, then ``validate()`` if it has one."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    given = {k: v for k, v in values.items() if k in fields}
    for name, value in given.items():
        check_value(fields[name], value)
    obj = cls(**given)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate()
    return obj


def options_for(args, entry) -> Any:
    """The options instance ``entry`` (a registry entry) gets from the run's flags ``args``
    (their ``plugin_options``); None when it declares none."""
    if entry.options is None:
        return None
    return make_options(entry.options, getattr(args, "plugin_options", None) or {})


def add_field_arguments(group, fields) -> None:
    """One argparse flag per dataclass field (switches for bools, types, choices, nargs)."""
    for f in fields:
        default = f.default if f.default is not dataclasses.MISSING else None
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": f.metadata.get("help")}
        typ, _ = _base_type(f)
        if typ is bool:
            group.add_argument(flag_of(f.name), action="store_true", **kwargs)
            continue
        if "nargs" in f.metadata:
            kwargs["nargs"] = f.metadata["nargs"]
        if typ in (int, float):
            kwargs["type"] = typ
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        group.add_argument(flag_of(f.name), **kwargs)


def describe_fields(cls: type) -> list[dict[str, Any]]:
    """Each option's flag, default and help (for ``radixserve plugins``)."""
    return [{"flag": flag_of(f.name), "default": f.default, "help": f.metadata.get("help", "")}
            for f in dataclasses.fields(cls)]


def is_options_class(cls: Any) -> bool:
    return isinstance(cls, type) and dataclasses.is_dataclass(cls)


__all__ = ["add_field_arguments", "check_value", "describe_fields", "make_options", "option"]

"""What every group of engine flags shares: the field helper and the value checks."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from radixserve.flags import ConfigError, flag_of


def flag(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field that is a flag: ``--field-name``, its help text, and ``choices`` or
    ``nargs`` where it has them."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


def json_object(raw: Any, flag_name: str) -> dict:
    """A flag's JSON-object value (given as JSON text, or as a dict through the Python API)."""
    if isinstance(raw, dict):
        return dict(raw)
    try:
        out = json.loads(raw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{flag_name}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise ConfigError(f"{flag_name}: expected a JSON object, got {type(out).__name__}")
    return out


class Checks:
    """Value checks the groups' ``check_*`` methods use; each error names the flag."""

    def _check_int(self, name: str, *, minimum: int, optional: bool = False) -> None:
        value = getattr(self, name)
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{flag_of(name)} must be an integer, got {value!r}")
        if value < minimum:
            raise ConfigError(f"{flag_of(name)} must be >= {minimum}, got {value}")

    def _check_seconds(self, name: str) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ConfigError(f"{flag_of(name)} must be a positive number of seconds, got {value!r}")

    def _check_name(self, name: str, what: str) -> None:
        value = getattr(self, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"{flag_of(name)}: expected {what}, got {value!r}")

"""Options plugins declare (radixserve.options): checked values, Engine keywords, CLI flags,
and the registry refusing clashing names."""

from __future__ import annotations

import argparse
import types
from dataclasses import dataclass

import pytest
from radixserve.config import ConfigError, ServerArgs
from radixserve.hookspecs import hookimpl
from radixserve.options import make_options, option, options_for
from radixserve.registry import PluginError, Registry


@dataclass
class FooOptions:
    foo_block: int = option(64, "tokens per block", minimum=16, maximum=1024)
    foo_mode: str = option("fast", "kernel flavour", choices=("fast", "exact"))
    foo_scale: float | None = option(None, "a scale")
    foo_trace: bool = option(False, "trace calls")

    def validate(self):
        if self.foo_mode == "exact" and self.foo_block > 128:
            raise ConfigError("--foo-block must be <= 128 with --foo-mode exact")


def _registry(*plugins) -> Registry:
    reg = Registry()
    for i, (dist, fn) in enumerate(plugins):
        reg.add_plugin(types.SimpleNamespace(register_attention_backends=hookimpl(fn)), name=f"p{i}",
                       distribution=dist)
    return reg


def _foo_registry() -> Registry:
    return _registry(("radixserve-attention-foo", lambda register: register("foo", object, options=FooOptions)))


@pytest.mark.parametrize("values,message", [
    ({"foo_block": 8}, "--foo-block must be >= 16, got 8"),
    ({"foo_block": 4096}, "--foo-block must be <= 1024, got 4096"),
    ({"foo_block": "64"}, "--foo-block must be an integer"),
    ({"foo_block": True}, "--foo-block must be an integer"),
    ({"foo_mode": "slow"}, "--foo-mode: invalid value 'slow'; choose from: fast, exact"),
    ({"foo_scale": "x"}, "--foo-scale must be a number"),
    ({"foo_trace": 1}, "--foo-trace is a switch"),
    ({"foo_mode": "exact", "foo_block": 256}, "--foo-block must be <= 128 with --foo-mode exact"),
])
def test_bad_values_are_refused_naming_the_flag(values, message):
    with pytest.raises(ConfigError, match=message):
        make_options(FooOptions, values)


def test_good_values_and_defaults():
    assert make_options(FooOptions, {}) == FooOptions()
    got = make_options(FooOptions, {"foo_block": 32, "foo_scale": 2, "foo_trace": True, "other": 1})
    assert got == FooOptions(foo_block=32, foo_scale=2, foo_trace=True)


def test_engine_keywords_reach_the_plugin():
    reg = _foo_registry()
    args = ServerArgs.from_kwargs(registry=reg, foo_block=32, foo_mode="exact")
    assert args.plugin_options == {"foo_block": 32, "foo_mode": "exact"}
    entry = reg.get("attention", "foo")
    assert options_for(args, entry) == FooOptions(foo_block=32, foo_mode="exact")
    assert options_for(ServerArgs(), entry) == FooOptions()  # declared but unset: the defaults
    with pytest.raises(ConfigError, match="--foo-mode: invalid value"):
        ServerArgs.from_kwargs(registry=reg, foo_mode="slow")
    with pytest.raises(ConfigError, match="unknown engine argument.*: foo_blok; valid: .*foo_block"):
        ServerArgs.from_kwargs(registry=reg, foo_blok=1)
    # the engine's own round trip: Engine(**vars(args)) hands the options back in
    again = ServerArgs.from_kwargs(registry=reg, **vars(args))
    assert again.plugin_options == args.plugin_options


def test_cli_flags_in_the_plugins_group():
    reg = _foo_registry()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser, registry=reg)
    assert "attention foo (radixserve-attention-foo)" in parser.format_help()
    ns = parser.parse_args(["--foo-block", "128", "--foo-trace", "--page-size", "2"])
    args = ServerArgs.from_cli_args(ns, registry=reg)
    assert args.page_size == 2
    assert options_for(args, reg.get("attention", "foo")) == FooOptions(foo_block=128, foo_trace=True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--foo-mode", "slow"])


def test_clashing_names_stop_the_registry():
    core = _registry(("radixserve-attention-bad", lambda register: register("bad", object, options=_Clash)))
    with pytest.raises(PluginError, match="'page_size'.*core flag"):
        ServerArgs.from_kwargs(registry=core, page_size=2, x=1)
    two = _registry(("radixserve-attention-foo", lambda register: register("foo", object, options=FooOptions)),
                    ("radixserve-attention-foo2", lambda register: register("foo2", object, options=FooOptions)))
    with pytest.raises(PluginError, match="'foo_block' is declared by two distributions"):
        two.option_fields()
    with pytest.raises(PluginError, match="must be a dataclass"):
        _registry(("d", lambda register: register("x", object, options=dict))).kind_entries("attention")


@dataclass
class _Clash:
    page_size: int = option(1, "clashes with the core's --page-size")

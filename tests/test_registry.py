"""Unit tests for the plugin registry (radixserve.registry) and ServerArgs validation.

Throwaway plugins are plain objects with hook implementations, registered on a fresh
``Registry()`` (no entry points loaded) and always removed in ``finally``.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import textwrap

import pluggy
import pytest
from radixserve.config import ConfigError, ServerArgs
from radixserve.hookspecs import hookimpl
from radixserve.registry import (
    ALLOWLIST_ENV,
    KINDS,
    BackendUnavailableError,
    PluginError,
    Registry,
    UnknownBackendError,
    get_registry,
)

# ----------------------------------------------------------------------------- helpers


class Attention:
    """A throwaway plugin registering attention backends ``(name, probe)``."""

    def __init__(self, *backends: tuple[str, object]) -> None:
        self.backends = backends

    @hookimpl
    def register_attention_backends(self, register):
        for name, probe in self.backends:
            register(name, lambda ctx: None, probe=probe, description=f"the {name} backend")


def with_plugins(reg: Registry, plugins: dict[str, tuple[str, object]]):
    """Context manager: add ``{plugin_name: (distribution, plugin)}`` and remove them after."""

    class _Ctx:
        def __enter__(self):
            for name, (dist, plugin) in plugins.items():
                reg.add_plugin(plugin, name=name, distribution=dist)
            return reg

        def __exit__(self, *exc):
            for name in plugins:
                if reg.pm.has_plugin(name):
                    reg.remove_plugin(name)

    return _Ctx()


# --------------------------------------------------------------------- every hook kind


class EveryKind:
    """One registration through each hook, so every kind is exercised by a test."""

    @hookimpl
    def register_attention_backends(self, register):
        register("t-attention", "factory")

    @hookimpl
    def register_moe_runners(self, register):
        register("t-moe-runner", "factory")

    @hookimpl
    def register_moe_a2a_backends(self, register):
        register("t-moe-a2a", "factory")

    @hookimpl
    def register_cache_tiers(self, register):
        register("t-cache-tier", "factory")

    @hookimpl
    def register_kv_transfer_backends(self, register):
        register("t-kv-transfer", "factory")

    @hookimpl
    def register_speculative_algorithms(self, register):
        register("t-speculative", "factory")

    @hookimpl
    def register_grammar_backends(self, register):
        register("t-grammar", "factory")

    @hookimpl
    def register_quantization_methods(self, register):
        register("t-quantization", "factory")

    @hookimpl
    def register_lora_backends(self, register):
        register("t-lora", "factory")

    @hookimpl
    def register_model_architectures(self, register):
        register("t-model", "factory")

    @hookimpl
    def register_commands(self, register):
        register("t-command", "factory", add_arguments="adder", description="a command")


def test_each_hook_feeds_its_own_kind():
    reg = Registry()
    with with_plugins(reg, {"every": ("radixserve-every", EveryKind())}):
        expected = {
            "attention": "t-attention", "moe_runner": "t-moe-runner", "moe_a2a": "t-moe-a2a",
            "cache_tier": "t-cache-tier", "kv_transfer": "t-kv-transfer", "speculative": "t-speculative",
            "grammar": "t-grammar",
            "quantization": "t-quantization", "lora": "t-lora", "model": "t-model", "command": "t-command",
        }
        assert set(expected) == set(KINDS)
        for kind, name in expected.items():
            assert reg.names(kind) == [name], kind
            entry = reg.get(kind, name)
            assert entry.kind == kind and entry.distribution == "radixserve-every"
        cmd = reg.get("command", "t-command")
        assert cmd.extra == {"add_arguments": "adder"} and cmd.description == "a command"
    assert all(reg.names(kind) == [] for kind in KINDS)


# ------------------------------------------------------------------------ resolving


def test_unknown_name_lists_the_choices():
    reg = Registry()
    with with_plugins(reg, {"p": ("radixserve-p", Attention(("beta", None), ("alpha", None)))}):
        with pytest.raises(UnknownBackendError) as err:
            reg.get("attention", "gamma", flag="--attention-backend")
        msg = str(err.value)
        assert "--attention-backend" in msg and "'gamma'" in msg and "alpha, beta" in msg
        assert isinstance(err.value, ValueError)


def test_unknown_name_when_none_installed():
    reg = Registry()
    with pytest.raises(UnknownBackendError, match=r"--grammar-backend.*'xg'.*none installed"):
        reg.resolve("grammar", "xg", flag="--grammar-backend")


def test_two_distributions_registering_one_name_is_an_error():
    reg = Registry()
    plugins = {"a": ("radixserve-attention-one", Attention(("same", None))),
               "b": ("radixserve-attention-two", Attention(("same", None)))}
    with with_plugins(reg, plugins), pytest.raises(PluginError) as err:
        reg.names("attention")
    msg = str(err.value)
    assert "'same'" in msg and "radixserve-attention-one" in msg and "radixserve-attention-two" in msg
    assert ALLOWLIST_ENV in msg


def test_removing_a_plugin_forgets_its_entries():
    reg = Registry()
    with with_plugins(reg, {"p": ("radixserve-p", Attention(("x", None)))}):
        assert reg.names("attention") == ["x"]
    assert reg.names("attention") == []


@pytest.mark.parametrize("bad", ["", None, 3])
def test_bad_name_is_an_error(bad):
    reg = Registry()
    with with_plugins(reg, {"p": ("radixserve-bad", Attention((bad, None)))}):
        with pytest.raises(PluginError, match="radixserve-bad"):
            reg.names("attention")


def _boom():
    raise RuntimeError("boom")


def test_availability_probe_none_str_and_raising():
    reg = Registry()
    backends = Attention(("plain", None), ("ok", lambda: None), ("needs-gpu", lambda: "needs CUDA"),
                         ("broken", _boom))
    with with_plugins(reg, {"p": ("radixserve-p", backends)}):
        table = reg.entries["attention"]
        assert table["plain"].is_available and table["plain"].unavailable_reason() is None
        assert table["ok"].is_available
        assert not table["needs-gpu"].is_available
        assert table["needs-gpu"].unavailable_reason() == "needs CUDA"
        assert not table["broken"].is_available
        reason = table["broken"].unavailable_reason()
        assert "RuntimeError" in reason and "boom" in reason


def test_resolve_an_unavailable_backend_names_the_reason():
    reg = Registry()
    backends = Attention(("fast", lambda: "flashinfer is not installed"), ("slow", None))
    with with_plugins(reg, {"p": ("radixserve-attention-fast", backends)}):
        assert reg.resolve("attention", "slow").name == "slow"
        assert reg.get("attention", "fast").name == "fast"  # get does not check availability
        with pytest.raises(BackendUnavailableError) as err:
            reg.resolve("attention", "fast", flag="--decode-attention-backend")
        msg = str(err.value)
        assert "--decode-attention-backend" in msg and "'fast'" in msg
        assert "flashinfer is not installed" in msg and "radixserve-attention-fast" in msg
        assert "Available: slow" in msg


def test_describe():
    reg = Registry()
    backends = Attention(("b-ok", None), ("a-off", lambda: "needs CUDA"), ("c-broken", _boom))
    with with_plugins(reg, {"p": ("radixserve-attention-x", backends)}):
        rows = reg.describe()
        json.dumps(rows)  # the CLI prints it as JSON
        assert [r["name"] for r in rows] == ["a-off", "b-ok", "c-broken"]
        by_name = {r["name"]: r for r in rows}
        assert by_name["b-ok"] == {"kind": "attention", "name": "b-ok", "package": "radixserve-attention-x",
                                   "available": True, "reason": None, "description": "the b-ok backend",
                                   "options": [], "features": []}
        assert by_name["a-off"]["available"] is False and by_name["a-off"]["reason"] == "needs CUDA"
        assert by_name["c-broken"]["available"] is False and "boom" in by_name["c-broken"]["reason"]


def test_throwaway_plugin_on_the_process_registry():
    reg = get_registry()
    with with_plugins(reg, {"throwaway": ("radixserve-throwaway", Attention(("throwaway", None)))}):
        entry = reg.resolve("attention", "throwaway", flag="--attention-backend")
        assert entry.distribution == "radixserve-throwaway"
        assert "torch_native" in reg.names("attention")
    assert "throwaway" not in reg.names("attention")


# --------------------------------------------------------------------- hook checking


class Misspelt:
    @hookimpl
    def register_attention_backend(self, register):  # singular: no such hook
        register("typo", None)


class WrongArgument:
    @hookimpl
    def register_attention_backends(self, reg):  # the host passes ``register``
        pass


def test_check_pending_catches_a_misspelt_hookimpl():
    reg = Registry()
    with with_plugins(reg, {"typo": ("radixserve-typo", Misspelt())}):
        with pytest.raises(pluggy.PluginValidationError, match="register_attention_backend"):
            reg.pm.check_pending()
        assert reg.names("attention") == []


def test_a_hookimpl_with_the_wrong_argument_is_refused():
    reg = Registry()
    try:
        with pytest.raises(pluggy.PluginValidationError):
            reg.add_plugin(WrongArgument(), name="wrong", distribution="radixserve-wrong")
    finally:
        if reg.pm.has_plugin("wrong"):
            reg.remove_plugin("wrong")


# ------------------------------------------------------------------------- allow-list


def _fresh(monkeypatch, value: str | None) -> Registry:
    if value is None:
        monkeypatch.delenv(ALLOWLIST_ENV, raising=False)
    else:
        monkeypatch.setenv(ALLOWLIST_ENV, value)
    reg = Registry()
    reg.load_entry_points()
    return reg


@pytest.mark.parametrize("value,loaded", [
    (None, True),
    ("radixserve-attention-torch", True),  # distribution name
    ("torch_native", True),  # entry-point name
    ("Radixserve_Attention_Torch", True),  # distribution names compare like pip's
    (" something-else , radixserve-attention-torch ", True),
    ("something-else", False),
    ("", False),
])
def test_allowlist(monkeypatch, value, loaded):
    reg = _fresh(monkeypatch, value)
    assert ("torch_native" in reg.names("attention")) is loaded
    # The core's own built-ins always load.
    assert "LlamaForCausalLM" in reg.names("model")
    assert {"plugins", "generate"} <= set(reg.names("command"))


def _fake_entry_points(monkeypatch, tmp_path, module_name: str, source: str) -> None:
    """Make one extra entry point (module ``module_name``) visible to ``load_entry_points``."""
    (tmp_path / f"{module_name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module_name, raising=False)
    real = importlib.metadata.entry_points
    fake = importlib.metadata.EntryPoint(name="fake", value=module_name, group="radixserve")

    def entry_points(**kw):
        return list(real(**kw)) + ([fake] if kw.get("group") == "radixserve" else [])

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.delenv(ALLOWLIST_ENV, raising=False)


def test_load_entry_points_reports_a_misspelt_hook_as_plugin_error(monkeypatch, tmp_path):
    _fake_entry_points(monkeypatch, tmp_path, "radixserve_fake_typo", """
        from radixserve.hookspecs import hookimpl

        @hookimpl
        def register_attention_backend(register):
            pass
    """)
    with pytest.raises(PluginError, match="register_attention_backend.*register_attention_backends"):
        Registry().load_entry_points()


def test_load_entry_points_reports_an_import_failure(monkeypatch, tmp_path):
    _fake_entry_points(monkeypatch, tmp_path, "radixserve_fake_broken", "raise ImportError('no libfoo')\n")
    with pytest.raises(PluginError, match=r"'fake'.*no libfoo.*RADIXSERVE_PLUGINS"):
        Registry().load_entry_points()
    monkeypatch.setenv(ALLOWLIST_ENV, "radixserve-attention-torch")  # leaving it out works
    reg = Registry()
    reg.load_entry_points()
    assert "torch_native" in reg.names("attention")


def test_load_entry_points_adds_a_good_plugin(monkeypatch, tmp_path):
    _fake_entry_points(monkeypatch, tmp_path, "radixserve_fake_good", """
        from radixserve.hookspecs import hookimpl

        @hookimpl
        def register_grammar_backends(register):
            register("fake-grammar", object, probe=lambda: "needs libfake")
    """)
    reg = Registry()
    reg.load_entry_points()
    entry = reg.get("grammar", "fake-grammar")
    assert entry.distribution == "radixserve_fake_good"  # no installed metadata: the module
    assert entry.unavailable_reason() == "needs libfake"


# ------------------------------------------------------------------ ServerArgs checks


@pytest.mark.parametrize("kwargs,flag", [
    ({"page_size": 0}, "--page-size"),
    ({"page_size": -4}, "--page-size"),
    ({"page_size": "16"}, "--page-size"),
    ({"dtype": "fp8"}, "--dtype"),
    ({"device": "tpu"}, "--device"),
    ({"mem_fraction_static": 1.5}, "--mem-fraction-static"),
    ({"mem_fraction_static": 0.0}, "--mem-fraction-static"),
    ({"mem_fraction_static": "half"}, "--mem-fraction-static"),
    ({"mem_fraction_static": True}, "--mem-fraction-static"),
    ({"max_total_tokens": "4096"}, "--max-total-tokens"),
    ({"max_total_tokens": 4096.0}, "--max-total-tokens"),
    ({"max_total_tokens": True}, "--max-total-tokens"),
    ({"max_total_tokens": 0}, "--max-total-tokens"),
    ({"max_running_requests": 0}, "--max-running-requests"),
    ({"max_prefill_tokens": 0}, "--max-prefill-tokens"),
    ({"context_length": 0}, "--context-length"),
    ({"log_level": "loud"}, "--log-level"),
    ({"attention_backend": ""}, "--attention-backend"),
    ({"prefill_attention_backend": 3}, "--prefill-attention-backend"),
    ({"decode_attention_backend": ""}, "--decode-attention-backend"),
    ({"max_total_tokns": 4096}, "max_total_tokns"),  # an unknown keyword names itself
])
def test_server_args_rejects_bad_values(kwargs, flag):
    with pytest.raises(ConfigError) as err:
        ServerArgs.from_kwargs(**kwargs)
    assert flag in str(err.value)


def test_server_args_defaults_and_backend_names():
    args = ServerArgs.from_kwargs()
    assert args.prefill_backend_name == args.decode_backend_name == "torch_native"
    args = ServerArgs.from_kwargs(attention_backend="a", decode_attention_backend="d",
                                  mem_fraction_static=0.5, max_total_tokens=4096, page_size=16)
    assert (args.prefill_backend_name, args.decode_backend_name) == ("a", "d")

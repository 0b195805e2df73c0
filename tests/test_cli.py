"""The ``radixserve`` command, run as a subprocess: ``plugins`` and flag errors.

Bad flags must fail before the model loads: the error cases run the command with checkpoint
loading forbidden (``cli_guard``), so a check that runs after the load fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cli_guard import assert_not_loaded, run_without_loading
from radixserve.registry import ALLOWLIST_ENV, KINDS, get_registry


def radixserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ALLOWLIST_ENV}
    return subprocess.run([sys.executable, "-m", "radixserve.cli", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def refused_before_loading(*args: str) -> subprocess.CompletedProcess:
    proc = run_without_loading(*args)
    assert_not_loaded(proc)
    return proc


def test_plugins_table():
    proc = radixserve("plugins")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for kind in KINDS.values():
        assert kind.title in out
        for flag in kind.flags:
            assert flag in out
    line = next(x for x in out.splitlines() if x.split()[:1] == ["torch_native"])
    assert "radixserve-attention-torch" in line and line.rstrip().endswith("available [mla, target-verify]")
    assert "unavailable" not in line
    model = next(x for x in out.splitlines() if x.split()[:1] == ["LlamaForCausalLM"])
    assert model.split()[1] == "radixserve"


def test_plugins_json():
    proc = radixserve("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert all(set(r) == {"kind", "name", "package", "available", "reason", "description", "options", "features"}
               for r in rows)
    (ngram,) = [r for r in rows if r["kind"] == "speculative" and r["name"] == "ngram"]
    assert "--speculative-ngram-draft-ratio" in [o["flag"] for o in ngram["options"]]
    (torch_native,) = [r for r in rows if r["kind"] == "attention" and r["name"] == "torch_native"]
    assert torch_native["package"] == "radixserve-attention-torch"
    assert torch_native["available"] is True and torch_native["reason"] is None
    assert set(torch_native["features"]) == {"mla", "target-verify"}  # what the backend class declares
    (triton,) = [r for r in rows if r["kind"] == "attention" and r["name"] == "triton"]
    assert set(triton["features"]) == {"mla", "target-verify"}
    fa2 = [r for r in rows if r["kind"] == "attention" and r["name"] == "fa2"]
    assert all("mla" not in r["features"] for r in fa2)  # a backend without MLA lists none
    names = {(r["kind"], r["name"]) for r in rows}
    assert {("command", "plugins"), ("command", "generate"), ("model", "LlamaForCausalLM")} <= names


def test_no_command_prints_help():
    proc = radixserve()
    assert proc.returncode != 0
    assert "plugins" in proc.stdout and "generate" in proc.stdout


def test_unknown_attention_backend_fails_fast():
    proc = refused_before_loading("generate", "x", "--attention-backend", "nope")
    assert proc.returncode != 0
    err = proc.stderr
    assert "--attention-backend" in err and "'nope'" in err and "torch_native" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("args,flag", [
    (["--dtype", "fp8"], "--dtype"),
    (["--page-size", "0"], "--page-size"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
    (["--max-total-tokens", "many"], "--max-total-tokens"),
])
def test_bad_engine_flag_names_the_flag(args, flag):
    proc = refused_before_loading("generate", "x", *args)
    assert proc.returncode != 0
    assert flag in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_moe_runner_names_the_flag():
    proc = refused_before_loading("generate", "x", "--moe-runner-backend", "foo")
    assert proc.returncode != 0
    err = proc.stderr
    assert "--moe-runner-backend" in err and "'foo'" in err and "Traceback" not in err
    installed = get_registry().names("moe_runner")
    if installed:
        assert all(name in err for name in installed)
    else:
        assert "none installed" in err


@pytest.mark.parametrize("args,flag", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "2"], "--top-p"),
    (["--top-k", "-5"], "--top-k"),
    (["--max-new-tokens", "-3"], "--max-new-tokens"),
])
def test_bad_sampling_flag_fails_before_loading(args, flag):
    proc = refused_before_loading("generate", "x", *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"radixserve: error: {flag}: "), proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_engine_commands_show_the_flags_plugins_declare(command):
    """--help lists each plugin's own flags in a group named after it (ngram's and deepep's
    live in their plugins now); a bad value is refused naming the flag."""
    proc = radixserve(command, "--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "speculative ngram (radixserve-speculative-ngram)" in out
    assert "--speculative-ngram-max-bfs-breadth" in out and "--deepep-mode" in out
    proc = refused_before_loading(*([command] if command == "serve" else [command, "x"]),
                                  "--speculative-ngram-min-match-window-size", "5",
                                  "--speculative-ngram-max-match-window-size", "4")
    assert proc.returncode == 2, proc.stderr
    assert "--speculative-ngram-min-match-window-size must not exceed" in proc.stderr


_REPORT_TORCH = """
import atexit, sys
atexit.register(lambda: print("torch imported:", "torch" in sys.modules, file=sys.stderr))
from radixserve.cli import main
sys.argv[0] = "radixserve"
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("args,code", [
    (["--help"], 0),
    ([], 2),
    (["bench", "--help"], 0),
    (["bench", "--bogus"], 2),
])
def test_parsing_and_flag_errors_do_not_import_torch(args, code):
    """Building the parser loads every installed plugin's entry point but runs only the
    command hooks: help and flag errors must not pay for importing torch. (serve and
    generate collect every kind's hooks for the flags plugins declare: they may.)"""
    env = {k: v for k, v in os.environ.items() if k != ALLOWLIST_ENV}
    proc = subprocess.run([sys.executable, "-c", _REPORT_TORCH, *args], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert "torch imported: False" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args", [["plugins", "--json"], ["plugins"]])
def test_closed_stdout_ends_quietly(args):
    """``radixserve plugins --json | head -1``: the reader leaves early; no BrokenPipeError
    traceback, the exit status a shell reports for SIGPIPE."""
    env = {k: v for k, v in os.environ.items() if k != ALLOWLIST_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "radixserve.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before the first write: every write fails
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141, err
    assert err == ""


def test_head_of_plugins_json_is_clean():
    """The same through a real shell pipe, as a user types it."""
    cmd = f"{sys.executable} -m radixserve.cli plugins --json | head -1"
    env = {k: v for k, v in os.environ.items() if k != ALLOWLIST_ENV}
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout == "[\n"
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr

"""A third-party attention plugin, installed the way a user would install one.

``tests/plugins/toy_attention`` is a separate distribution (``radixserve-attention-toy``)
that registers the attention backend ``toy``. It is pip-installed into a temporary
directory (never into site-packages) and used from subprocesses that put that directory
on ``PYTHONPATH``: ``radixserve plugins`` must list it, ``radixserve generate`` must use it
and produce exactly what ``torch_native`` produces, and ``RADIXSERVE_PLUGINS`` must be able
to hide it. The same kind of backend, written from the docs (docs/plugins.md), is checked
against ``torch_native`` on synthetic paged batches.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from radixserve.layers.attention import AttentionContext, AttentionLayer, ForwardBatch, ForwardMode
from radixserve.mem.kv_pool import KVPool
from radixserve.registry import ALLOWLIST_ENV, Registry
from radixserve.testing.install import install_plugin, pythonpath_with
from radixserve_attention_torch import TorchNativeAttention

ROOT = Path(__file__).resolve().parents[1]
TOY_SRC = ROOT / "tests" / "plugins" / "toy_attention"
TOY_MODULE = "radixserve_attention_toy"
TOY_DIST = "radixserve-attention-toy"
LOG_ENV = "RADIXSERVE_TOY_ATTENTION_LOG"
PROMPT = "The capital of France is"
GENERATE = ["generate", PROMPT, "--max-new-tokens", "8", "--max-total-tokens", "4096"]


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory) -> Path:
    """A directory holding the installed toy distribution (module + dist-info)."""
    site = install_plugin(TOY_SRC, tmp_path_factory.mktemp("toy"))
    assert (site / f"{TOY_MODULE}.py").exists()
    return site


def run_cli(site: Path, *args: str, allow: str | None = None, log: Path | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (ALLOWLIST_ENV, LOG_ENV)}
    env["PYTHONPATH"] = pythonpath_with(site)
    if allow is not None:
        env[ALLOWLIST_ENV] = allow
    if log is not None:
        env[LOG_ENV] = str(log)
    return subprocess.run([sys.executable, "-m", "radixserve.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def attention_rows(site: Path, allow: str | None = None) -> dict[str, dict]:
    proc = run_cli(site, "plugins", "--json", allow=allow)
    assert proc.returncode == 0, proc.stderr
    return {r["name"]: r for r in json.loads(proc.stdout) if r["kind"] == "attention"}


# ------------------------------------------------------------------------ isolation


def test_core_does_not_know_the_toy_plugin(toy_site):
    assert importlib.util.find_spec(TOY_MODULE) is None, "the toy plugin leaked into this interpreter"
    core = ROOT / "core" / "src" / "radixserve"
    assert not [str(p) for p in core.rglob("*.py") if TOY_MODULE in p.read_text()]


# ------------------------------------------------------------------ plugins listing


def test_plugins_lists_the_toy_backend(toy_site):
    rows = attention_rows(toy_site)
    assert rows["toy"]["package"] == TOY_DIST
    assert rows["toy"]["available"] is True and rows["toy"]["reason"] is None
    assert rows["torch_native"]["package"] == "radixserve-attention-torch"
    table = run_cli(toy_site, "plugins")
    assert table.returncode == 0
    line = next(x for x in table.stdout.splitlines() if x.split()[:1] == ["toy"])
    assert TOY_DIST in line and line.rstrip().endswith("available")


def test_the_toy_plugin_declares_its_own_flag(toy_site):
    """The plugin's options dataclass becomes a flag of serve and generate (in their --help,
    in its own group), is listed by `radixserve plugins`, and is gone with the plugin."""
    for command in ("serve", "generate"):
        proc = run_cli(toy_site, command, "--help")
        assert proc.returncode == 0, proc.stderr
        assert "attention toy (radixserve-attention-toy)" in proc.stdout
        assert "--toy-attention-log" in proc.stdout and "append one line per step" in proc.stdout
    assert attention_rows(toy_site)["toy"]["options"] == [
        {"flag": "--toy-attention-log", "default": None,
         "help": "--attention-backend toy: append one line per step (extend or decode) to this file"}]
    assert "--toy-attention-log (default None)" in run_cli(toy_site, "plugins").stdout
    hidden = run_cli(toy_site, *GENERATE, "--toy-attention-log", "x.log", allow="radixserve-attention-torch")
    assert hidden.returncode == 2 and "unrecognized arguments: --toy-attention-log" in hidden.stderr


@pytest.mark.parametrize("allow,has_toy,has_torch", [
    ("radixserve-attention-torch", False, True),
    (TOY_DIST, True, False),
    ("toy", True, False),  # the entry-point name
    ("toy,torch_native", True, True),
])
def test_allowlist_controls_the_toy_backend(toy_site, allow, has_toy, has_torch):
    rows = attention_rows(toy_site, allow=allow)
    assert ("toy" in rows) is has_toy
    assert ("torch_native" in rows) is has_torch


def test_hidden_toy_backend_is_an_unknown_name(toy_site):
    proc = run_cli(toy_site, *GENERATE, "--attention-backend", "toy", allow="radixserve-attention-torch")
    assert proc.returncode != 0
    assert "--attention-backend" in proc.stderr and "'toy'" in proc.stderr and "torch_native" in proc.stderr


# ------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def reference_text(toy_site) -> str:
    proc = run_cli(toy_site, *GENERATE, "--attention-backend", "torch_native")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    return proc.stdout


def _steps(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


@pytest.mark.slow
def test_generate_with_the_toy_backend(toy_site, reference_text, tmp_path):
    """Run through the plugin's own flag: the log it names shows every step went to it."""
    log = tmp_path / "toy.log"
    proc = run_cli(toy_site, *GENERATE, "--attention-backend", "toy", "--toy-attention-log", str(log))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference_text
    steps = _steps(log)
    assert steps.count("extend") >= 1 and steps.count("decode") >= 1, steps


@pytest.mark.slow
def test_hybrid_toy_prefill_torch_native_decode(toy_site, reference_text, tmp_path):
    log = tmp_path / "toy.log"
    proc = run_cli(toy_site, *GENERATE, "--prefill-attention-backend", "toy",
                   "--decode-attention-backend", "torch_native", log=log)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference_text
    steps = _steps(log)
    assert steps and set(steps) == {"extend"}, steps  # decode went to torch_native


# ------------------------------------------------- synthetic paged batches (in process)

HEADS, KV_HEADS, DIM = 4, 2, 8


def _batches(page_size: int, seed: int):
    """An extend step (one request with a cached prefix, one without) then a decode step.

    Yields ``(batch, q, k, v)``; the pool and the slot table are shared between the steps.
    """
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    pool = KVPool(num_layers=1, num_pages=32, page_size=page_size, num_kv_heads=KV_HEADS, head_dim=DIM,
                  dtype=torch.float32, device="cpu")
    table = torch.zeros(3, 64, dtype=torch.int64)
    prefix, extend = [5, 0], [3, 6]
    perm = (torch.randperm(31, generator=gen) + 1).tolist()  # pages out of order, never page 0
    pages = [perm[:12], perm[12:24]]
    rows = [2, 0]

    def slots(i: int, start: int, end: int) -> list[int]:
        return [pages[i][p // page_size] * page_size + p % page_size for p in range(start, end)]

    for i, row in enumerate(rows):  # the cached prefix, as an earlier step left it
        s = torch.tensor(slots(i, 0, prefix[i]), dtype=torch.int64)
        table[row, :prefix[i]] = s
        pool.set_kv(0, s, rand(prefix[i], KV_HEADS, DIM), rand(prefix[i], KV_HEADS, DIM))

    def step(mode, pre, ext):
        out = []
        for i, row in enumerate(rows):
            s = slots(i, pre[i], pre[i] + ext[i])
            table[row, pre[i]:pre[i] + ext[i]] = torch.tensor(s, dtype=torch.int64)
            out.extend(s)
        total = sum(ext)
        seq = [p + e for p, e in zip(pre, ext)]
        batch = ForwardBatch(
            mode=mode, batch_size=2, input_ids=torch.zeros(total, dtype=torch.int64),
            positions=torch.cat([torch.arange(p, p + e) for p, e in zip(pre, ext)]),
            req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq),
            out_cache_loc=torch.tensor(out, dtype=torch.int64), seq_lens_cpu=seq, prefix_lens_cpu=list(pre),
            extend_lens_cpu=list(ext), req_to_token=table, kv_pool=pool,
            logits_indices=torch.tensor(ext).cumsum(0) - 1)
        return batch, rand(total, HEADS, DIM), rand(total, KV_HEADS, DIM), rand(total, KV_HEADS, DIM)

    yield step(ForwardMode.EXTEND, prefix, extend)
    seq = [p + e for p, e in zip(prefix, extend)]
    for _ in range(2):
        yield step(ForwardMode.DECODE, seq, [1, 1])
        seq = [n + 1 for n in seq]


def _ctx(page_size: int) -> AttentionContext:
    return AttentionContext(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, num_layers=1,
                            dtype=torch.float32, device=torch.device("cpu"), page_size=page_size,
                            max_context_len=64, max_batch_size=2)


def _matches_torch_native(factory, page_size: int, window: int | None) -> None:
    layer = AttentionLayer(layer_id=0, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                           scaling=DIM ** -0.5, sliding_window=window)
    ours, ref = factory(_ctx(page_size)), TorchNativeAttention(_ctx(page_size))
    for (b1, q, k, v), (b2, *_) in zip(_batches(page_size, 0), _batches(page_size, 0)):
        ours.init_forward_metadata(b1)
        got = ours.forward(q, k, v, layer, b1)
        ref.init_forward_metadata(b2)
        want = ref.forward(q, k, v, layer, b2)
        assert got.shape == want.shape == q.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the new K/V went into the pool at out_cache_loc
        torch.testing.assert_close(b1.kv_pool.k_buffers[0][b1.out_cache_loc], k)
        torch.testing.assert_close(b1.kv_pool.v_buffers[0][b1.out_cache_loc], v)


def _load_toy_from_source() -> types.ModuleType:
    # From its file, under a private name: the module is not put on sys.path, and is in
    # sys.modules only while it runs (its options dataclass looks itself up there).
    spec = importlib.util.spec_from_file_location("_toy_under_test", TOY_SRC / f"{TOY_MODULE}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


@pytest.mark.parametrize("page_size,window", [(1, None), (4, None), (4, 3)])
def test_toy_backend_matches_torch_native(page_size, window):
    toy = _load_toy_from_source()
    _matches_torch_native(toy.ToyAttention, page_size, window)
    assert toy.CALLS["extend"] == 1 and toy.CALLS["decode"] == 2


def _docs_example() -> tuple[str, str]:
    text = (ROOT / "docs" / "plugins.md").read_text()
    section = text.split("## A new attention backend", 1)[1]
    toml = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return toml, code


def test_docs_example_backend_matches_torch_native():
    import tomllib

    toml, code = _docs_example()
    project = tomllib.loads(toml)
    (ep_name, module_name), = project["project"]["entry-points"]["radixserve"].items()
    assert project["tool"]["setuptools"]["py-modules"] == [module_name]
    assert len(code.strip().splitlines()) <= 45, "the example should stay short"
    module = types.ModuleType(module_name)
    exec(compile(code, f"docs/plugins.md:{module_name}", "exec"), module.__dict__)
    reg = Registry()
    reg.add_plugin(module, name=ep_name, distribution=project["project"]["name"])
    try:
        reg.pm.check_pending()
        (name,) = reg.names("attention")
        entry = reg.resolve("attention", name, flag="--attention-backend")
        assert entry.distribution == "radixserve-attention-naive"
        for page_size in (1, 4):
            _matches_torch_native(entry.factory, page_size, None)
    finally:
        reg.remove_plugin(ep_name)

"""scripts/gpu_check.sh dry-run on CPU (issues 17, 41): it prints its plan, every step before
the first GPU call runs (environment, carried wheels, packages, model, plugin listing, one
availability row per GPU backend: pass / FAIL / NOT CARRIED), then it stops with "no CUDA
device" and exit status 3, leaving summary.md and logs.tar.gz in the output directory; with
a broken backend library installed and CUDA simulated (GPU_CHECK_SIMULATE_CUDA=1) it exits 1
naming it. And benchmarks/bench_gpu.py's code paths at toy sizes on CPU."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def test_every_gpu_check_script_parses():
    scripts = [os.path.join(ROOT, "scripts", "gpu_check.sh"),
               *glob.glob(os.path.join(ROOT, "plugins/*/*/scripts/gpu_check.sh"))]
    assert len(scripts) >= 4
    for script in scripts:
        subprocess.run(["bash", "-n", script], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a machine without CUDA does")
def test_dry_run_stops_cleanly_without_cuda(tmp_path):
    out, work, wheels = tmp_path / "out", tmp_path / "work", tmp_path / "wheels"
    wheels.mkdir()
    env = {**os.environ, "GPU_CHECK_WORK": str(work), "GPU_CHECK_WHEELS": str(wheels)}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no CUDA device: gpu_check.sh stops before the first GPU step" in proc.stdout
    summary = (out / "summary.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in summary.splitlines()
            if line.startswith("| ") and not line.startswith("| step")}
    assert rows["model"] == "pass" and rows["plugins"] == "pass", summary
    assert rows["cuda"] == "no CUDA device: stopped here"
    assert "bench_attention" not in rows  # nothing past the CUDA check ran
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "summary.md"]  # few files: a device run returns few
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "./plugins.log" in names and "./env.txt" in names
    # the plugin listing names the GPU backends with the reason they are unavailable here
    listing = (work / "plugins.log").read_text()
    for name in ("flashinfer", "triton", "fa3"):
        assert name in listing
    assert "gpu_check plan (budget 450 s" in proc.stdout and "carried wheels: none" in proc.stdout
    assert "warm (240 s)" in proc.stdout and "moe/deepep" in proc.stdout
    # each GPU backend's row: its library here (no CUDA: a dry run) or not carried, never a pass
    assert rows["availability attention/triton (triton)"] == "no CUDA (dry run)"
    assert rows["availability moe_a2a/deepep (deep_ep)"].startswith("NOT CARRIED")
    assert "FAIL 0 · NOT CARRIED" in summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a machine without CUDA does")
def test_a_broken_backend_library_fails_the_simulated_gpu_dry_run(tmp_path):
    """A flashinfer that is installed but does not import (a broken wheel) on a machine whose
    torch.cuda is simulated: the flashinfer row is a FAIL with the probe's reason, and the
    dry run exits 1, not 3."""
    fake = tmp_path / "fake" / "flashinfer"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "GPU_CHECK_WORK": str(work), "GPU_CHECK_WHEELS": str(tmp_path / "none"),
           "GPU_CHECK_SIMULATE_CUDA": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (out / "summary.md").read_text()
    row = next(line for line in summary.splitlines() if "availability attention/flashinfer" in line)
    assert "FAIL (flashinfer is installed but does not import (ImportError: libcudart.so.13" in row
    assert "| availability attention/triton (triton) | pass |" in summary  # simulated CUDA: triton can run


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), *args],
                          capture_output=True, text=True, timeout=300)


def test_bench_attention_on_cpu(tmp_path):
    proc = _bench("attention", "--quick", "--device", "cpu", "--backends", "torch_native,flashinfer",
                  "--json", str(tmp_path / "a.json"))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "a.json").read_text())
    native = [r for r in rows if r["backend"] == "torch_native"]
    assert len(native) == 2 and all(r["ms"] > 0 and r["sdpa_ms"] > 0 for r in native)
    assert all(r["ms"] is None and r["note"] for r in rows if r["backend"] == "flashinfer")
    assert "| decode b4 ctx64 | torch_native |" in proc.stdout


def test_bench_decode_on_cpu(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_gpu import bench_decode, decode_table
    from tiny_models import build_checkpoint

    build_checkpoint(str(tmp_path), "llama", seed=1)
    rows = bench_decode("cpu", ["torch_native", "no_such_backend"], [1, 2], 3, "float32", str(tmp_path))
    off, on, missing = rows
    from radixserve.kernels import cpu as cpu_kernels

    tapes = cpu_kernels.load() is not None  # on CPU the decode graphs are kernel tapes
    assert off["cuda_graph"] is False and on["cuda_graph"] is True and on["captured"] is tapes
    assert off["bs1"] > 0 and on["bs2"] > 0 and on["same_tokens"] is True
    assert missing["note"] == "not installed"
    table = decode_table(rows, [1, 2])
    assert ("| torch_native | on |" in table) if tapes else ("on (none captured)" in table)


@pytest.mark.parametrize("what", ["moe", "a2a", "warm"])
def test_the_moe_a2a_and_warm_sections_skip_without_cuda(what):
    if torch.cuda.is_available():
        pytest.skip("on a GPU these time kernels (scripts/gpu_check.sh runs them)")
    proc = _bench(what)
    assert proc.returncode == 0 and f"{what}: skipped (torch sees no CUDA device)" in proc.stdout, proc.stderr

"""Which GPU backends this machine can run, as rows of scripts/gpu_check.sh's step table.

Every registered backend that needs a GPU library is one row:

* ``pass``: its library is installed (or was carried in gpu-wheels/) and the backend reports
  itself available;
* ``FAIL (reason)``: its library is installed but the backend reports unavailable on a CUDA
  machine (a broken or too old wheel, a missing function): the probe's reason is the row's;
* ``NOT CARRIED``: its library is not installed here (never a pass);
* ``no CUDA (dry run)``: on a machine without CUDA, unless simulated.

``GPU_CHECK_SIMULATE_CUDA=1`` runs the probes as on a GPU machine (``torch.cuda`` reports one
Hopper device; nothing is launched), so a dry run on CPU shows what a GPU run would refuse: a
wrong wheel installed here then fails the check. Exit status: 1 when a row failed, else 0.

    python scripts/gpu_availability.py [--rows FILE]    # FILE: the markdown rows are appended there
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

# (kind, backend) -> the module its library provides (what "carried" means for it)
LIBRARIES = {
    ("attention", "fa2"): "flash_attn",
    ("attention", "fa3"): "flash_attn_interface",
    ("attention", "flashinfer"): "flashinfer",
    ("attention", "triton"): "triton",
    ("moe_runner", "deep_gemm"): "deep_gemm",
    ("moe_runner", "deep_gemm_bf16"): "deep_gemm",
    ("moe_runner", "triton"): "triton",
    ("moe_a2a", "deepep"): "deep_ep",
    ("lora", "triton"): "triton",
}


def simulate_cuda() -> None:
    """torch.cuda as on a one-GPU Hopper machine, for the probes only (nothing is launched)."""
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_name = lambda device=None: "simulated sm_90 device"


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import: there, but broken
        return True


def rows(simulated: bool) -> list[tuple[str, str]]:
    import torch
    from radixserve.registry import get_registry

    cuda = simulated or torch.cuda.is_available()
    registry = get_registry()
    out = []
    for (kind, name), module in LIBRARIES.items():
        entry = registry.entries[kind].get(name)
        label = f"availability {kind}/{name} ({module})"
        if entry is None:
            out.append((label, "NOT CARRIED (plugin not installed)"))
        elif not installed(module):
            out.append((label, f"NOT CARRIED ({module} not installed)"))
        elif not cuda:
            out.append((label, "no CUDA (dry run)"))
        else:
            reason = entry.unavailable_reason()
            out.append((label, "pass" if reason is None else f"FAIL ({reason})"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="append the markdown step rows to this file")
    args = ap.parse_args(argv)
    simulated = os.environ.get("GPU_CHECK_SIMULATE_CUDA", "") not in ("", "0")
    if simulated:
        simulate_cuda()
    table = rows(simulated)
    lines = [f"| {label} | {result.replace('|', '/')} | 0 |" for label, result in table]
    for line in lines:
        print(line)
    if args.rows:
        with open(args.rows, "a") as fh:
            fh.write("\n".join(lines) + "\n")
    return 1 if any(result.startswith("FAIL") for _, result in table) else 0


if __name__ == "__main__":
    sys.exit(main())

"""How big the KV pool is when ``--max-total-tokens`` is not given: what the device has left
after the weights are loaded, measured, never assumed.

On a GPU that is the memory free after loading (``torch.cuda.mem_get_info``) and
``--mem-fraction-static`` keeps SGLang's meaning: that fraction of the device's total holds
the weights and the pool, the rest stays free for activations, CUDA graphs and the
allocator. On CPU it is what the process may still allocate: the kernel's ``MemAvailable``,
or less when the process's cgroup has a memory limit closer than that (v2 ``memory.max``
less ``memory.current``, v1 ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``); the
pool takes ``--mem-fraction-static`` (default 0.15) of it, the rest is left to activations,
the tokenizer, other processes. A model that leaves too little for a pool of
:data:`MIN_POOL_TOKENS` tokens (or its context, if shorter) stops the start with the numbers
and the flags that change them.
"""

from __future__ import annotations

import os

import torch

MIN_POOL_TOKENS = 2048  # the smallest pool worth serving with (a context's worth when shorter)
CPU_MEM_FRACTION = 0.15  # --mem-fraction-static on CPU: of the memory available after the weights
GPU_MEM_FRACTION = 0.88  # on a GPU: of the device's total, weights and pool together


def total_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2, no limit) reads as None


def _mem_available(meminfo: str) -> int | None:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom(root: str, proc_cgroup: str) -> int | None:
    """Bytes below this process's cgroup memory limit (None: no limit found)."""
    paths = {}
    try:
        with open(proc_cgroup) as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                paths[controllers] = path.lstrip("/")
    except (OSError, ValueError):
        return None
    candidates = []  # (limit file, usage file): the process's own cgroup first, then the mount's root
    if "" in paths:  # v2: "0::/path"
        for d in (os.path.join(root, paths[""]), root):
            candidates.append((os.path.join(d, "memory.max"), os.path.join(d, "memory.current")))
    for controllers, path in paths.items():
        if "memory" in controllers.split(","):  # v1
            base = os.path.join(root, "memory")
            for d in (os.path.join(base, path), base):
                candidates.append((os.path.join(d, "memory.limit_in_bytes"), os.path.join(d, "memory.usage_in_bytes")))
    for limit_file, usage_file in candidates:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes "no limit" as ~2^63
            return max(0, limit - usage)
    return None


def available_memory(device: torch.device, *, meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup",
                     proc_cgroup: str = "/proc/self/cgroup") -> int:
    """Bytes the process may still allocate on ``device`` (see the module docstring)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    found = [m for m in (_mem_available(meminfo), _cgroup_headroom(cgroup_root, proc_cgroup)) if m is not None]
    if not found:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return min(found)


def kv_pool_budget(fraction: float, *, device_type: str, total: int, free: int) -> int:
    """Bytes for the KV pool under ``--mem-fraction-static fraction``, given the device's
    ``total`` memory and what is ``free`` after loading the weights (see the module
    docstring). Raises ValueError when nothing is left for the pool."""
    if device_type == "cuda":
        budget = free - int((1.0 - fraction) * total)
        if budget <= 0:
            raise ValueError(
                f"--mem-fraction-static {fraction}: no memory left for the KV pool ({free / 2**30:.2f} GiB free after "
                f"loading the weights, {(1 - fraction) * total / 2**30:.2f} GiB of {total / 2**30:.2f} GiB kept for "
                "activations and CUDA graphs); raise --mem-fraction-static, or give --max-total-tokens")
        return budget
    return int(fraction * free)


def check_pool_size(tokens: int, *, context_len: int, per_token: int, budget: int, free: int, fraction: float,
                    weight_bytes: int) -> None:
    """Refuse to start with a pool too small to serve (ValueError with the numbers and flags)."""
    need = min(MIN_POOL_TOKENS, context_len)
    if tokens >= need:
        return
    raise ValueError(
        f"the KV pool would hold {tokens} tokens, fewer than the {need} a server needs: "
        f"{free / 2**30:.2f} GiB is available after loading {weight_bytes / 2**30:.2f} GiB of weights, and "
        f"--mem-fraction-static {fraction} of it is {budget / 2**20:.0f} MiB at {per_token / 2**10:.1f} KiB a token; "
        "free memory, raise --mem-fraction-static, choose a narrower --kv-cache-dtype, or give --max-total-tokens")

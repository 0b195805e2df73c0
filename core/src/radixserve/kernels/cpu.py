"""radixserve's CPU kernels (``cpu_kernels.c``): build once per machine, load, call.

The C sources (``cpu_kernels.c`` and every other ``*.c`` beside it, sharing ``cpu_common.h``)
are compiled into one library on first use with the system C compiler (``-O3 -march=native``,
about a second) into ``~/.cache/radixserve/kernels/`` under a name that hashes the source,
the compiler and the CPU, so a later process (or a test run) just loads it, once it has
checked that the file and its directory belong to this user and that no one else may
write them (a library failing that is never loaded: a private copy is built instead). Calls go
through ctypes with raw pointers (ctypes releases the GIL). The kernels parallelise with
OpenMP, which resolves to the runtime torch already loaded, so they run on torch's worker
threads (see the C file for why not a pool of their own).

:func:`load` returns ``None`` (and the callers keep their plain PyTorch path) when there is
no compiler, the build fails, or ``RADIXSERVE_CPU_KERNELS=0``; :func:`status` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from radixserve.kernels import tape
from radixserve.private_files import UnsafeFileError, cache_root, check_private

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent


def _sources() -> list[Path]:
    """The C sources of the library, in a fixed order (each may add its own entry points)."""
    return sorted(_DIR.glob("*.c"))
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]
_status = "not loaded yet"


def status() -> str:
    """Why the kernels are (not) in use: 'loaded from PATH', 'disabled ...', 'build failed ...'."""
    return _status


def cache_dir() -> Path:
    return Path(cache_root()) / "kernels"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            lines = [ln for ln in fh if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build(cc: str) -> Path:
    return build_library(cc, "cpu_kernels", _sources())


def build_library(cc: str, name: str, sources: list[Path]) -> Path:
    """Compile ``sources`` (C, against this directory's ``cpu_common.h``) into one shared
    library ``name-<hash>.so`` in :func:`cache_dir`, unless it is there already: the hash
    covers the sources, the header, the compiler, the flags and the CPU."""
    source = b"\0".join(p.read_bytes() for p in [*sources, *sorted(_DIR.glob("*.h"))])
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(_FLAGS).encode(),
                                     _cpu_signature().encode(), platform.machine().encode()]))
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        try:
            check_private(str(target), "cached kernel library")
            return target
        except UnsafeFileError as e:  # another user could have planted or changed it: never load it
            target = Path(tempfile.mkdtemp(prefix="radixserve-kernels-")) / target.name  # mode 0700
            logger.warning("%s; building a private copy in %s instead", e, target.parent)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Build under a temporary name and rename: concurrent processes never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_FLAGS, f"-I{_DIR}", "-o", tmp, *map(str, sources), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class CpuKernels:
    """Thin typed wrappers over the C entry points. Every tensor argument must be a
    contiguous float32 CPU tensor (positions: int64), which the callers guarantee."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        tape.register_library(lib)
        p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        lib.rs_pack.argtypes = [p, i64, i64, p]
        lib.rs_linear.argtypes = [p, i64, i64, p, p, i64, p]
        lib.rs_rmsnorm.argtypes = [p, p, p, f32, i64, i64, p]
        lib.rs_silu_mul.argtypes = [p, i64, i64, p]
        lib.rs_rope.argtypes = [p, i64, i64, i64, i64, p, p, p]
        lib.rs_argmax_rows.argtypes = [p, i64, i64, i64, p]
        lib.rs_gather_rows.argtypes = [p, i64, i64, p, i64, p]
        lib.rs_head_rmsnorm.argtypes = [p, i64, i64, i64, i64, p, f32]
        lib.rs_tape_run.argtypes = [p, i64, i64]
        for fn in (lib.rs_pack, lib.rs_linear, lib.rs_rmsnorm, lib.rs_silu_mul, lib.rs_rope, lib.rs_argmax_rows,
                   lib.rs_gather_rows, lib.rs_head_rmsnorm, lib.rs_tape_run):
            fn.restype = None
        self.lib = lib
        self.panel_width = lib.rs_panel_width()
        # the most rows the GGUF linears take in registers (the weights decoded once per tile);
        # past it they dequantise panels, and a row costs several times more
        self.gemv_max_rows = lib.rs_gguf_gemv_max()

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` weight -> panels ``[ceil(N / NR), K, NR]`` (zero padded)."""
        n, k = weight.shape
        w = weight.detach().contiguous()
        out = torch.empty(-(-n // self.panel_width), k, self.panel_width, dtype=torch.float32)
        self.lib.rs_pack(w.data_ptr(), n, k, out.data_ptr())
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        """``x  # [M, K]`` -> ``# [M, N]`` against a weight packed by :meth:`pack`."""
        m, k = x.shape
        y = torch.empty(m, n, dtype=torch.float32)
        self.lib.rs_linear(x.data_ptr(), m, k, packed.data_ptr(),
                           None if bias is None else bias.data_ptr(), n, y.data_ptr())
        return y

    def pack_grouped(self, weights: torch.Tensor) -> torch.Tensor:
        """``[G, N, K]`` weights (an MoE layer's experts) -> ``[G, ceil(N / NR), K, NR]``,
        each group packed as :meth:`pack` packs one weight."""
        g, n, k = weights.shape
        w = weights.detach().contiguous()
        out = torch.empty(g, -(-n // self.panel_width), k, self.panel_width, dtype=torch.float32)
        for i in range(g):
            self.lib.rs_pack(w[i].data_ptr(), n, k, out[i].data_ptr())
        return out

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm of ``x  # [M, D]``; with ``residual``, first ``residual += x`` (in place)
        and normalise the sum."""
        m, d = x.shape
        out = torch.empty(m, d, dtype=torch.float32)
        self.lib.rs_rmsnorm(x.data_ptr(), None if residual is None else residual.data_ptr(),
                            weight.data_ptr(), eps, m, d, out.data_ptr())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up  # [M, 2I]`` -> ``# [M, I]``."""
        m, two_i = gate_up.shape
        out = torch.empty(m, two_i // 2, dtype=torch.float32)
        self.lib.rs_silu_mul(gate_up.data_ptr(), m, two_i // 2, out.data_ptr())
        return out

    def rope_(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
              positions: torch.Tensor) -> None:
        """RoPE in place on the first ``heads`` heads of each row of ``x  # [M, W]``;
        ``cos, sin  # [P, D/2]`` tables, ``positions  # [M]`` int64."""
        self.lib.rs_rope(x.data_ptr(), x.shape[0], x.shape[1], heads, head_dim,
                         cos.data_ptr(), sin.data_ptr(), positions.data_ptr())

    def head_rmsnorm_(self, x: torch.Tensor, heads: int, head_dim: int, weight: torch.Tensor, eps: float) -> None:
        """In place on a ``[M, W]`` row view (unit column stride): each of the first ``heads``
        head vectors of each row becomes ``RMSNorm(v) * weight``."""
        self.lib.rs_head_rmsnorm(x.data_ptr(), x.shape[0], x.stride(0), heads, head_dim, weight.data_ptr(), eps)

    def gather_rows(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``table[ids]`` for a contiguous ``table  # [N, D]`` and int64 ``ids  # [T]`` -> ``# [T, D]``
        (an id outside ``[0, N)`` gives zeros: check ids first where that must be an error)."""
        n, d = table.shape
        out = torch.empty(ids.shape[0], d, dtype=table.dtype)
        self.lib.rs_gather_rows(table.data_ptr(), d * table.element_size(), n, ids.data_ptr(), ids.shape[0],
                                out.data_ptr())
        return out

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(dim=-1)`` for ``x  # [M, N]`` float32 with unit column stride -> ``# [M]``
        int64, the same indices as torch (first maximum; first NaN in a row holding NaN)."""
        m, n = x.shape
        out = torch.empty(m, dtype=torch.int64)
        self.lib.rs_argmax_rows(x.data_ptr(), m, n, x.stride(0), out.data_ptr())
        return out


def load_library(name: str, sources: list[Path]) -> ctypes.CDLL | None:
    """A plugin's own CPU kernels: ``sources`` built like the core's (``cpu_common.h`` on the
    include path, the same flags and cache) and loaded; None (logged) where the core's would
    be unavailable: kernels disabled, no compiler, or a build that fails."""
    if os.environ.get("RADIXSERVE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    cc = _compiler()
    if cc is None:
        logger.info("%s kernels unavailable: no C compiler found (set CC)", name)
        return None
    try:
        lib = ctypes.CDLL(str(build_library(cc, name, sources)))
    except Exception as exc:  # any build or load failure: the caller keeps its PyTorch path
        logger.warning("%s kernels unavailable, using PyTorch ops: %s", name, exc)
        return None
    tape.register_library(lib)  # its calls are recorded with the core's (radixserve.kernels.tape)
    return lib


def release_thread_pool() -> bool:
    """Give back the calling thread's OpenMP worker threads (``omp_pause_resource_all``, soft:
    they are made again when this thread next opens a parallel region). Every thread that runs
    parallel torch ops or kernels owns a pool of workers; once a process holds more of them
    than it has CPUs, libgomp stops letting idle workers spin, and each parallel region then
    waits ~50-70 us for its workers to wake (a 57-row index_select took 70 us instead of 7).
    A thread that is done with torch (the one that loaded the model, before another thread
    takes the engine over) calls this so the thread that steps the engine keeps the only pool.
    False when there is nothing to call (no kernels, an OpenMP runtime without it)."""
    kernels = load()
    fn = None if kernels is None else getattr(kernels.lib, "omp_pause_resource_all", None)
    if fn is None:
        return False
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn(1) == 0  # omp_pause_soft


@contextlib.contextmanager
def serial_section():
    """Inside, the calling thread runs its parallel torch ops and kernels on itself alone (its
    own OpenMP thread count set to 1 and restored on leaving; ``torch.set_num_threads`` would
    also set MKL's count for every thread), having first given back the workers it holds. For
    a thread that hands the heavy work to another (the overlap scheduler's stepping thread), so
    that its bookkeeping never gives the process a second pool. A no-op without the kernels."""
    kernels = load()
    lib = None if kernels is None else kernels.lib
    get = None if lib is None else getattr(lib, "omp_get_max_threads", None)
    put = None if lib is None else getattr(lib, "omp_set_num_threads", None)
    if get is None or put is None:
        yield
        return
    torch.get_num_threads()  # torch's per-thread first-use set-up first: it would reset the count
    get.restype, put.argtypes, put.restype = ctypes.c_int, [ctypes.c_int], None
    before = get()
    put(1)
    release_thread_pool()
    try:
        yield
    finally:
        put(before)


def run_and_release(fn) -> None:
    """``fn()`` on a helper thread (HiCache's copies), then that thread's OpenMP workers given
    back (:func:`release_thread_pool`): its parallel copies must not leave a second pool idling
    beside the engine's."""
    try:
        fn()
    finally:
        release_thread_pool()


@functools.cache
def load() -> CpuKernels | None:
    """The kernels for this machine, built on first use; None when unavailable."""
    global _status
    if os.environ.get("RADIXSERVE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        _status = "disabled by RADIXSERVE_CPU_KERNELS"
        return None
    cc = _compiler()
    if cc is None:
        _status = "no C compiler found (set CC)"
        logger.info("radixserve CPU kernels unavailable: %s", _status)
        return None
    try:
        kernels = CpuKernels(_build(cc))
    except Exception as exc:  # any build or load failure: keep the PyTorch path
        _status = f"build failed: {exc}"
        logger.warning("radixserve CPU kernels unavailable, using PyTorch ops: %s", exc)
        return None
    _status = f"loaded from {kernels.path}"
    return kernels

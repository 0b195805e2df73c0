"""Kernel tapes: a decode step recorded once as the kernel calls it makes, replayed from C.

The CPU counterpart of a CUDA graph (:mod:`radixserve.engine.cuda_graph`). On CPU a decode
step of a small batch spends as long in Python between the kernels (~120 linear calls, norms,
RoPE, attention, module dispatch, argument checks) as in the kernels themselves. When every
computing op of the model's decode forward is one of radixserve's compiled kernels (true
for the dense Llama family in float32 with the CPU kernels loaded, whatever the linear
layers' storage: float, GGUF blocks, int8/int4, bf16/f16), the forward is fully described by
the sequence of kernel calls and their arguments, which are the same at every step of one
batch size once the inputs live in fixed buffers. :func:`record` runs the forward once and
keeps that sequence; :meth:`Tape.run` replays it with one call into C (``rs_tape_run`` in
``tape.c``), which calls each kernel's tape twin in order.

How the recording stays honest:

* every kernel library (the core's and each plugin's, :func:`register_library`) has its
  ``rs_*`` functions wrapped while recording, so each call is both run and noted; a kernel
  without a tape twin (``<name>_tape``, see ``cpu_common.h``) or one that returns a value
  Python reads cannot be recorded;
* a :class:`~torch.overrides.TorchFunctionMode` refuses every torch op that computes: only
  views, metadata reads and ``torch.empty``/``empty_like`` may run between the kernels. A
  forward with any other op (a native PyTorch path, an index, a copy) is not recordable and
  the caller keeps it eager (:class:`TapeError` says which op);
* the buffers ``torch.empty`` returns during recording come from an :class:`Arena` that the
  tape keeps alive; tapes that never run at the same time (one per batch size) share one.

Why a tape of kernel calls and not a compiled graph (``torch.compile``): the kernels are
opaque ctypes calls, which the compiler cannot trace (a graph break at each of them leaves
the Python between them in place), and a tape replays the very kernels the eager step runs,
so a replayed step gives the same bits as an eager one.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name

WIDTH = 24  # int64 values per tape row: the twin's address, then up to 23 arguments

_libraries: list[ctypes.CDLL] = []
_recording: _Recorder | None = None
records = 0  # recordings made in this process (a scheduler leaves the steps that recorded out of its cost model)


class TapeError(RuntimeError):
    """The forward cannot be recorded (the reason names the op or kernel)."""


def register_library(lib: ctypes.CDLL) -> None:
    """A kernel library whose ``rs_*`` calls a recording must see (the core's and every
    plugin's, registered as they are loaded)."""
    if all(lib is not other for other in _libraries):
        _libraries.append(lib)


def recording() -> bool:
    """Whether a forward is being recorded now (Python-side checks that read tensor values,
    such as an index range check, are skipped then: the replaying caller checks its inputs)."""
    return _recording is not None


# --------------------------------------------------------------------------- arena
class Arena:
    """Buffers for the tensors a recorded forward allocates, in 64 MiB chunks that grow on
    demand. :meth:`reset` before each recording: tapes recorded one after another reuse the
    same memory (record the largest batch first so the others fit in what it allocated)."""

    CHUNK = 64 << 20

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []
        self.index, self.offset = 0, 0

    def reset(self) -> None:
        self.index, self.offset = 0, 0

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        while True:
            if self.index == len(self.chunks):
                self.chunks.append(torch.empty(max(self.CHUNK, nbytes + 64), dtype=torch.uint8))
            chunk = self.chunks[self.index]
            start = -(-(chunk.data_ptr() + self.offset) // 64) * 64 - chunk.data_ptr()  # 64-byte aligned
            if start + nbytes <= chunk.numel():
                self.offset = start + nbytes
                return chunk[start:start + nbytes].view(dtype).view(shape)
            self.index, self.offset = self.index + 1, 0

    @property
    def nbytes(self) -> int:
        return sum(c.numel() for c in self.chunks)


# --------------------------------------------------------------------------- tape
class Tape:
    """A recorded forward: ``rows  # [n, WIDTH]`` int64 (twin address, arguments), the
    library whose ``rs_tape_run`` replays it, and what must stay alive for it."""

    def __init__(self, rows: list[list[int]], runner: ctypes.CDLL, keep: list[Any]) -> None:
        padded = [row + [0] * (WIDTH - len(row)) for row in rows] or [[0] * WIDTH]
        self.rows = torch.tensor(padded, dtype=torch.int64)
        self.n = len(rows)
        self.keep = keep
        self._run = runner.rs_tape_run

    def run(self) -> None:
        """Replay every recorded kernel call, in order (the GIL is released meanwhile)."""
        self._run(self.rows.data_ptr(), self.n, WIDTH)

    def __len__(self) -> int:
        return self.n


class _Recorded:
    """A kernel function that, while recording, notes its call as a tape row and runs it."""

    def __init__(self, recorder: _Recorder, lib: ctypes.CDLL, name: str, fn: Any) -> None:
        self.recorder, self.name, self.fn = recorder, name, fn
        self.floats = {i for i, t in enumerate(fn.argtypes or ()) if t in (ctypes.c_float, ctypes.c_double)}
        try:
            self.twin = ctypes.cast(getattr(lib, f"{name}_tape"), ctypes.c_void_p).value
        except AttributeError:
            self.twin = None

    def __call__(self, *args):
        if threading.get_ident() != self.recorder.thread:  # another thread's call is not this forward's
            return self.fn(*args)
        if self.fn.restype is not None:
            raise TapeError(f"kernel {self.name} returns a value that Python reads")
        if self.twin is None:
            raise TapeError(f"kernel {self.name} has no tape twin ({self.name}_tape)")
        if len(args) >= WIDTH:
            raise TapeError(f"kernel {self.name} takes {len(args)} arguments, a tape row holds {WIDTH - 1}")
        row = [self.twin]
        for i, a in enumerate(args):
            if i in self.floats:
                row.append(struct.unpack("<q", struct.pack("<d", float(a)))[0])
            elif a is None:
                row.append(0)
            elif isinstance(a, int):
                row.append(a)
            else:
                raise TapeError(f"kernel {self.name}: argument {i} is a {type(a).__name__}, not an int or pointer")
        self.recorder.rows.append(row)
        return self.fn(*args)


@functools.cache
def _wrapping_class(base: type) -> type:
    class Wrapping(base):  # functions first looked up while recording are wrapped too
        def __getattr__(self, name):
            fn = base.__getattr__(self, name)
            if name.startswith("rs_") and not name.endswith("_tape") and _recording is not None:
                fn = _Recorded(_recording, self, name, fn)
                object.__setattr__(self, name, fn)
            return fn
    return Wrapping


# --------------------------------------------------------------------------- the guard
_VIEWS = {"view", "reshape", "split", "chunk", "narrow", "__getitem__", "unsqueeze", "squeeze", "transpose",
          "permute", "expand", "t", "flatten", "unflatten", "contiguous", "to", "float", "detach", "view_as",
          "select", "unbind"}
_METADATA = {"data_ptr", "dim", "stride", "size", "numel", "element_size", "is_contiguous", "__len__",
             "storage_offset", "is_floating_point", "get_device", "shape", "dtype", "device", "ndim", "is_cuda",
             "layout", "requires_grad", "is_cpu", "is_sparse", "is_quantized", "is_meta", "names"}


_short_names: dict[Any, str] = {}  # resolve_name is slow (it enters a warnings filter per call)


def _short(func) -> str:
    try:
        return _short_names[func]
    except (KeyError, TypeError):
        pass
    name = resolve_name(func) or getattr(func, "__name__", repr(func))
    parts = name.split(".")
    short = parts[-2] if parts[-1] == "__get__" else parts[-1]
    try:
        _short_names[func] = short
    except TypeError:  # an unhashable callable: named again next time
        pass
    return short


def _storages(obj) -> set[int]:
    if isinstance(obj, torch.Tensor):
        return {obj.untyped_storage().data_ptr()}
    if isinstance(obj, (list, tuple)):
        return set().union(*(_storages(o) for o in obj)) if obj else set()
    return set()


class _Guard(TorchFunctionMode):
    def __init__(self, arena: Arena) -> None:
        super().__init__()
        self.arena = arena

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _short(func)
        if name in _METADATA:
            return func(*args, **kwargs)
        if name in ("empty", "empty_like") and func in (torch.empty, torch.empty_like):
            return self._alloc(name, args, kwargs)
        if name in _VIEWS:
            out = func(*args, **kwargs)
            src = args[0] if args else None
            if isinstance(src, torch.Tensor) and _storages(out) <= _storages(src):
                return out
            raise TapeError(f"torch op {resolve_name(func)} copied data (only views may run between kernels)")
        raise TapeError(f"torch op {resolve_name(func) or func} computes outside radixserve's kernels")

    def _alloc(self, name: str, args, kwargs) -> torch.Tensor:
        extra = set(kwargs) - {"dtype", "device", "memory_format"}
        if extra:
            raise TapeError(f"torch.{name} with {sorted(extra)} during recording")
        if name == "empty_like":
            like = args[0]
            shape, dtype, device = tuple(like.shape), kwargs.get("dtype") or like.dtype, like.device
        else:
            shape = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            dtype, device = kwargs.get("dtype") or torch.get_default_dtype(), kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            raise TapeError(f"torch.{name} on {device} during recording")
        return self.arena.alloc(tuple(int(s) for s in shape), dtype)


# --------------------------------------------------------------------------- recording
class _Recorder:
    def __init__(self) -> None:
        self.rows: list[list[int]] = []
        self.thread = threading.get_ident()


def record(fn: Callable[[], torch.Tensor], arena: Arena, runner: ctypes.CDLL) -> tuple[torch.Tensor, Tape]:
    """Run ``fn()`` once, recording its kernel calls; returns its output and the tape that
    replays it (``runner``: the core library, which holds ``rs_tape_run``). ``arena`` serves
    the allocations (reset first). Raises :class:`TapeError` when the forward is not made of
    kernel calls only."""
    global _recording, records
    records += 1
    if _recording is not None:
        raise TapeError("a recording is already in progress")
    recorder = _Recorder()
    saved: list[tuple[ctypes.CDLL, type]] = []
    arena.reset()
    _recording = recorder
    try:
        for lib in _libraries:
            cached = {k: v for k, v in vars(lib).items() if k.startswith("rs_") and not k.endswith("_tape")}
            saved.append((lib, type(lib)))
            for k, v in cached.items():
                object.__setattr__(lib, k, _Recorded(recorder, lib, k, v))
            lib.__class__ = _wrapping_class(type(lib))
        with _Guard(arena):
            out = fn()
    finally:
        _recording = None
        for lib, cls in saved:
            lib.__class__ = cls
            for k, v in list(vars(lib).items()):
                if isinstance(v, _Recorded):
                    object.__setattr__(lib, k, v.fn)
    if not recorder.rows:
        raise TapeError("the forward called no kernel")
    return out, Tape(recorder.rows, runner, [arena])

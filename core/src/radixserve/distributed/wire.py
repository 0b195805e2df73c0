"""The step messages' wire format: a small tagged binary encoding that knows only plain
data, so a follower rank never unpickles (never runs code from) bytes off the network.

What it encodes: ``None``, ``bool``, ``int`` (64-bit), ``float``, ``str``, ``bytes``,
``list``, ``tuple``, ``dict``, numpy arrays and CPU torch tensors of the dtypes in
:data:`ARRAY_DTYPES` / :data:`TENSOR_DTYPES`, and members of the enum classes the caller
allows (by class and member name). Anything else is refused when sending
(:class:`WireFormatError`), and a message that does not parse exactly (an unknown tag,
dtype or enum, a length past the end, bytes left over) is refused when receiving.

Layout: one tag byte per value, then: ``I`` int64, ``D`` float64, ``S``/``B`` a uint32
length and the UTF-8 / raw bytes, ``L``/``U``/``M`` a uint32 count and the items (a dict:
key, value, key, value, ...), ``K`` a list of ints as a uint32 count and packed int64s (the
common case, fast), ``A``/``X`` an array or tensor: its dtype name (a short string), a
uint8 rank, int64 dimensions and the raw bytes, ``E`` an enum: class name and member name.
All little-endian.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

import numpy as np
import torch

ARRAY_DTYPES = {np.dtype(t).name: np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8,
                                                       np.float16, np.float32, np.float64)}
TENSOR_DTYPES = {"bfloat16": torch.bfloat16}  # tensors without a numpy dtype travel as tensors
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_DEPTH = 32  # containers nest at most this deep in a message


class WireFormatError(ValueError):
    """A value outside the step messages' schema (sending) or a malformed message (receiving)."""


class Encoder:
    """``Encoder(enums).dumps(value) -> bytes``; ``enums``: the enum classes allowed."""

    def __init__(self, enums: tuple[type[enum.Enum], ...] = ()) -> None:
        self.enums = {cls.__name__: cls for cls in enums}
        self._by_type = {type(None): self._none, bool: self._bool, int: self._int, float: self._float,
                         str: self._str, bytes: self._bytes, list: self._list, tuple: self._tuple, dict: self._dict,
                         np.ndarray: self._ndarray, torch.Tensor: self._tensor}
        self._dtype_names: dict[int, str] = {}  # numpy dtype number -> allowed name

    def dumps(self, value: Any) -> bytes:
        out = bytearray()
        self._put(value, out)
        return bytes(out)

    def _put(self, v: Any, out: bytearray) -> None:
        put = self._by_type.get(type(v))
        if put is None:
            t = type(v)
            if isinstance(v, enum.Enum) and self.enums.get(t.__name__) is t:
                put = self._enum
            elif isinstance(v, torch.Tensor):
                put = self._tensor
            else:
                raise WireFormatError(f"a {t.__module__}.{t.__qualname__} is not part of the step messages' schema")
        put(v, out)

    def _none(self, v: None, out: bytearray) -> None:
        out += b"N"

    def _bool(self, v: bool, out: bytearray) -> None:
        out += b"T" if v else b"F"

    def _int(self, v: int, out: bytearray) -> None:
        if not _INT64_MIN <= v <= _INT64_MAX:
            raise WireFormatError(f"an int outside 64 bits: {v}")
        out += b"I"
        out += _I64.pack(v)

    def _float(self, v: float, out: bytearray) -> None:
        out += b"D"
        out += _F64.pack(v)

    def _str(self, v: str, out: bytearray) -> None:
        data = v.encode()
        out += b"S"
        out += _U32.pack(len(data))
        out += data

    def _bytes(self, v: bytes, out: bytearray) -> None:
        out += b"B"
        out += _U32.pack(len(v))
        out += v

    def _list(self, v: list, out: bytearray) -> None:
        if v and all(type(x) is int for x in v):
            try:
                packed = struct.pack(f"<{len(v)}q", *v)
            except struct.error as e:
                raise WireFormatError(f"an int outside 64 bits in a list: {e}") from None
            out += b"K"
            out += _U32.pack(len(v))
            out += packed
            return
        self._items(b"L", v, out)

    def _tuple(self, v: tuple, out: bytearray) -> None:
        self._items(b"U", v, out)

    def _items(self, tag: bytes, v: list | tuple, out: bytearray) -> None:
        out += tag
        out += _U32.pack(len(v))
        for x in v:
            self._put(x, out)

    def _dict(self, v: dict, out: bytearray) -> None:
        out += b"M"
        out += _U32.pack(len(v))
        for k, x in v.items():
            self._put(k, out)
            self._put(x, out)

    def _enum(self, v: enum.Enum, out: bytearray) -> None:
        out += b"E"
        self._str(type(v).__name__, out)
        self._str(v.name, out)

    def _ndarray(self, v: np.ndarray, out: bytearray) -> None:
        name = self._dtype_names.get(v.dtype.num)
        if name is None:
            if v.dtype.name not in ARRAY_DTYPES:
                raise WireFormatError(f"an array of dtype {v.dtype} (allowed: {', '.join(ARRAY_DTYPES)})")
            name = self._dtype_names[v.dtype.num] = v.dtype.name
        _put_array(b"A", name, v.shape, v.tobytes(), out)

    def _tensor(self, v: torch.Tensor, out: bytearray) -> None:
        name = str(v.dtype).removeprefix("torch.")
        if TENSOR_DTYPES.get(name) is not v.dtype or v.device.type != "cpu":
            raise WireFormatError(f"a {v.device.type} tensor of {v.dtype} (allowed on CPU: "
                                  f"{', '.join(TENSOR_DTYPES)}; others travel as numpy arrays)")
        raw = v.contiguous().view(torch.uint8).numpy().tobytes() if v.numel() else b""
        _put_array(b"X", name, tuple(v.shape), raw, out)


def _put_array(tag: bytes, dtype: str, shape: tuple, raw: bytes, out: bytearray) -> None:
    name = dtype.encode()
    out += tag
    out += bytes((len(name),))
    out += name
    out += bytes((len(shape),))
    out += struct.pack(f"<{len(shape)}q", *shape)
    out += _U32.pack(len(raw))
    out += raw


class Decoder:
    """``Decoder(enums).loads(data)``: the value :meth:`Encoder.dumps` encoded; raises
    :class:`WireFormatError` for anything else."""

    def __init__(self, enums: tuple[type[enum.Enum], ...] = ()) -> None:
        self.enums = {cls.__name__: cls for cls in enums}
        self._by_tag = {ord(t): f for t, f in (
            ("N", self._none), ("T", self._true), ("F", self._false), ("I", self._int), ("D", self._float),
            ("S", self._str), ("B", self._bytes), ("K", self._ints), ("L", self._list), ("U", self._tuple),
            ("M", self._dict), ("A", self._ndarray), ("X", self._tensor), ("E", self._enum))}

    def loads(self, data: bytes) -> Any:
        self.data, self.pos, self.depth = bytes(data), 0, 0
        try:
            value = self._get()
        except WireFormatError:
            raise
        except (IndexError, struct.error, UnicodeDecodeError, ValueError, TypeError, RuntimeError) as e:
            raise WireFormatError(f"malformed step message at byte {self.pos}: {e}") from None
        finally:
            left, self.data = len(self.data) - self.pos, b""
        if left:
            raise WireFormatError(f"malformed step message: {left} bytes after the value")
        return value

    def _get(self) -> Any:
        tag = self.data[self.pos]
        self.pos += 1
        read = self._by_tag.get(tag)
        if read is None:
            raise WireFormatError(f"malformed step message: unknown tag {bytes([tag])!r} at byte {self.pos - 1}")
        return read()

    def _span(self, n: int) -> int:
        """Claim ``n`` bytes at the current position; their start."""
        start = self.pos
        if n < 0 or start + n > len(self.data):
            raise WireFormatError(f"malformed step message: {n} bytes asked at byte {start} of {len(self.data)}")
        self.pos = start + n
        return start

    def _u32(self) -> int:
        return _U32.unpack_from(self.data, self._span(4))[0]

    def _none(self) -> None:
        return None

    def _true(self) -> bool:
        return True

    def _false(self) -> bool:
        return False

    def _int(self) -> int:
        return _I64.unpack_from(self.data, self._span(8))[0]

    def _float(self) -> float:
        return _F64.unpack_from(self.data, self._span(8))[0]

    def _bytes(self) -> bytes:
        n = self._u32()
        start = self._span(n)
        return self.data[start:start + n]

    def _str(self) -> str:
        return self._bytes().decode()

    def _ints(self) -> list[int]:
        n = self._u32()
        return list(struct.unpack_from(f"<{n}q", self.data, self._span(8 * n)))

    def _items(self, n: int) -> list:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise WireFormatError(f"malformed step message: nested deeper than {MAX_DEPTH}")
        out = [self._get() for _ in range(n)]
        self.depth -= 1
        return out

    def _list(self) -> list:
        return self._items(self._u32())

    def _tuple(self) -> tuple:
        return tuple(self._items(self._u32()))

    def _dict(self) -> dict:
        flat = self._items(2 * self._u32())
        return dict(zip(flat[::2], flat[1::2]))

    def _enum(self) -> enum.Enum:
        cls_name, name = self._items(2)
        cls = self.enums.get(cls_name) if isinstance(cls_name, str) else None
        if cls is None or not isinstance(name, str) or name not in cls.__members__:
            raise WireFormatError(f"malformed step message: an enum outside {sorted(self.enums)}")
        return cls[name]

    def _shape(self) -> tuple[str, tuple[int, ...], int, int]:
        """dtype name, shape, start and length of the raw bytes of an array or tensor."""
        n = self.data[self.pos]
        start = self._span(n + 1)
        name = self.data[start + 1:start + 1 + n].decode("ascii")
        rank = self.data[self.pos]
        shape = struct.unpack_from(f"<{rank}q", self.data, self._span(8 * rank + 1) + 1)
        size = self._u32()
        return name, shape, self._span(size), size

    def _ndarray(self) -> np.ndarray:
        name, shape, start, size = self._shape()
        dtype = ARRAY_DTYPES.get(name)
        if dtype is None:
            raise WireFormatError(f"malformed step message: array dtype {name!r} not allowed")
        return np.frombuffer(self.data, dtype=dtype, count=size // dtype.itemsize, offset=start).reshape(shape).copy()

    def _tensor(self) -> torch.Tensor:
        name, shape, start, size = self._shape()
        dtype = TENSOR_DTYPES.get(name)
        if dtype is None:
            raise WireFormatError(f"malformed step message: tensor dtype {name!r} not allowed")
        if not size:
            return torch.empty(shape, dtype=dtype)
        raw = bytearray(self.data[start:start + size])
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)

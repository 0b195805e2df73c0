"""A fast reader for GGUF headers: metadata values, tensor infos, tensor data as memory maps.

gguf-py's ``GGUFReader`` builds a NumPy view for every part of every metadata value, which
takes ~6 s for a vocabulary of 49 k tokens and merges (the default model's tokenizer lives in
its metadata); a checkpoint is opened by the server and again by its engine process, so that
was most of a server's start-up. This reader walks the same header with ``struct`` over a
memory map and decodes numeric arrays with one ``np.frombuffer`` each (tens of ms), and
exposes what the loader uses: ``fields`` (key -> decoded value) and ``tensors`` (name, GGUF
shape, type and a NumPy view of the data laid out as gguf-py lays it out, so that
``gguf.dequantize`` takes it unchanged).

Loading reads tensor data with :meth:`GGUFHeader.read` (``pread`` into a fresh array), not
through the memory map: pages read through a map stay in the process's resident set (RssFile)
as long as the map lives (the engine keeps its checkpoint open), so a quantized model that
copies its blocks out held the whole file twice, once mapped and once copied. Read with
``pread``, the file's pages are only the kernel's page cache, which the kernel may drop.

Format (GGUF v2/v3, llama.cpp's ``docs/gguf.md``): magic ``GGUF``, u32 version, u64 tensor
count, u64 metadata count; metadata entries (string key, u32 value type, value); tensor infos
(string name, u32 dims, u64 dims..., u32 ggml type, u64 offset); padding to
``general.alignment`` (32 by default); tensor data. Strings are a u64 length and UTF-8 bytes.
A file written big-endian is recognised by its byte-swapped version, as gguf-py does.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
# metadata value types -> (struct code, NumPy dtype); 8 = string, 9 = array
_SCALARS = {0: ("B", np.uint8), 1: ("b", np.int8), 2: ("H", np.uint16), 3: ("h", np.int16),
            4: ("I", np.uint32), 5: ("i", np.int32), 6: ("f", np.float32), 7: ("?", np.bool_),
            10: ("Q", np.uint64), 11: ("q", np.int64), 12: ("d", np.float64)}
_STRING, _ARRAY = 8, 9
# ggml types whose data gguf-py exposes as typed elements; every other type as raw bytes
_TYPED_DATA = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
               28: np.float64}


class GGUFFormatError(ValueError):
    pass


@dataclass
class GGUFTensorInfo:
    name: str
    shape: np.ndarray  # GGUF order: the fastest-varying dimension first
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # [reversed shape] typed, or [rows..., bytes per row] uint8 for block types
    offset: int = 0  # of the data in the file, bytes


class GGUFHeader:
    """``fields`` and ``tensors`` of one GGUF file; the data stay memory-mapped."""

    def __init__(self, path: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        self._map = np.memmap(path, mode="r")
        buf = memoryview(self._map)
        if bytes(buf[:4]) != MAGIC:
            raise GGUFFormatError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version = int.from_bytes(buf[4:8], "little")
        self._e = "<" if version & 0xFFFF else ">"
        if self._e == ">":
            version = int.from_bytes(buf[4:8], "big")
        if version not in (2, 3):
            raise GGUFFormatError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        self._buf, self._pos = buf, 8
        n_tensors, n_fields = self._unpack("QQ")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            (vtype,) = self._unpack("I")
            self.fields[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("I")
            dims = self._unpack("Q" * n_dims)
            ggml_type, offset = self._unpack("IQ")
            infos.append((name, dims, ggml_type, offset))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors: list[GGUFTensorInfo] = []
        for name, dims, ggml_type, offset in infos:
            qtype = GGMLQuantizationType(ggml_type)
            np_dims = tuple(reversed(dims))
            count = int(np.prod(dims, dtype=np.int64))
            if ggml_type in _TYPED_DATA:
                dtype = np.dtype(_TYPED_DATA[ggml_type]).newbyteorder(self._e)
                nbytes, shape = count * dtype.itemsize, np_dims
            else:
                block, type_size = GGML_QUANT_SIZES[qtype]
                if dims[0] % block:
                    raise GGUFFormatError(f"{path}: tensor {name!r} has {dims[0]} columns, not a multiple "
                                          f"of its type's block of {block}")
                dtype = np.dtype(np.uint8)
                nbytes, shape = count // block * type_size, (*np_dims[:-1], np_dims[-1] // block * type_size)
            if start + offset + nbytes > len(self._map):
                raise GGUFFormatError(f"{path}: tensor {name!r} runs past the end of the file")
            view = self._map[start + offset:start + offset + nbytes].view(dtype).reshape(shape)
            self.tensors.append(GGUFTensorInfo(name, np.array(dims, dtype=np.uint64), qtype, view, start + offset))
        del self._buf

    def read(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """A fresh, writable copy of ``tensor.data`` read with ``pread``: no page of the map
        becomes resident in this process."""
        out = np.empty(tensor.data.shape, dtype=tensor.data.dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < len(buf):  # pread may return fewer bytes (large reads, signals)
                n = os.preadv(fd, [buf[done:]], tensor.offset + done)
                if n <= 0:
                    raise GGUFFormatError(f"{self.path}: tensor {tensor.name!r} ends early (at byte {done})")
                done += n
        finally:
            os.close(fd)
        return out

    def _unpack(self, codes: str) -> tuple:
        fmt = self._e + codes
        out = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = self._unpack("Q")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype][0])[0]
        if vtype != _ARRAY:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {vtype} at byte {self._pos}")
        etype, n = self._unpack("IQ")
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1]).newbyteorder(self._e)
            arr = np.frombuffer(self._buf, dtype=dtype, count=n, offset=self._pos)
            self._pos += n * dtype.itemsize
            return arr.tolist()
        if etype == _STRING:
            buf, pos, order = self._buf, self._pos, "little" if self._e == "<" else "big"
            out = []
            for _ in range(n):
                size = int.from_bytes(buf[pos:pos + 8], order)
                out.append(bytes(buf[pos + 8:pos + 8 + size]).decode("utf-8", errors="replace"))
                pos += 8 + size
            self._pos = pos
            return out
        return [self._value(etype) for _ in range(n)]  # arrays of arrays

"""radixserve's GGUF header reader against gguf-py's ``GGUFReader``: the same metadata values,
tensor names, shapes, types and data, on the default model and on a file holding every
metadata value type and several tensor types; malformed files are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter, dequantize, quantize
from radixserve.model_loader.gguf_reader import GGUFFormatError, GGUFHeader

GGUF_OWN = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # gguf-py's pseudo-fields


def _assert_same(path: str) -> GGUFHeader:
    ours, ref = GGUFHeader(path), GGUFReader(path)
    expected = {k: f.contents() for k, f in ref.fields.items() if k not in GGUF_OWN}
    assert ours.fields == expected
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.shape.tolist() == b.shape.tolist(), a.name
        assert a.tensor_type == b.tensor_type, a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
    return ours


def test_default_model_reads_as_gguf_py_reads_it(default_model_file):
    import os

    ours = _assert_same(os.path.join(*default_model_file))
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert {int(t.tensor_type) for t in ours.tensors} >= {int(T.Q4_1), int(T.F32)}


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_type(tmp_path, alignment):
    path = str(tmp_path / "all.gguf")
    w = GGUFWriter(path, "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 1 << 40)
    w.add_int64("t.i64", -(1 << 40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.strs", ["a", "", "日本"])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 8)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    for qtype in (T.Q8_0, T.Q4_0, T.Q5_1):
        src = rng.standard_normal((2, 64)).astype(np.float32)
        w.add_tensor(f"q_{qtype.name}", quantize(src, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = _assert_same(path)
    assert ours.fields["t.strs"] == ["a", "", "日本"] and ours.fields["t.u64"] == 1 << 40
    q8 = next(t for t in ours.tensors if t.name == "q_Q8_0")
    assert dequantize(q8.data, q8.tensor_type).shape == (2, 64)


def test_malformed_files_are_refused(tmp_path, default_model_file):
    import os

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFHeader(str(bad))
    bad.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(16))
    with pytest.raises(GGUFFormatError, match="version 7"):
        GGUFHeader(str(bad))
    with open(os.path.join(*default_model_file), "rb") as fh:
        head = fh.read(4_000_000)  # the whole header, a fraction of the tensor data
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(GGUFFormatError, match="runs past the end of the file"):
        GGUFHeader(str(cut))

"""Loading a GGUF file reads its tensors with ``pread``: the blocks a quantized model keeps are
copies, and the file's pages must not stay mapped into the process besides them (which held
every quantized model twice in resident memory: RssFile + RssAnon)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402


def _rss_file() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssFile in /proc/self/status")


def _write(path: str, vocab: int, hidden: int) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(hidden)
    w.add_head_count(8)
    w.add_vocab_size(vocab)
    tensors = {"token_embd.weight": (rng.standard_normal((vocab, hidden), dtype=np.float32), T.Q8_0),
               "blk.0.attn_q.weight": (rng.standard_normal((hidden, hidden), dtype=np.float32), T.Q4_0),
               "blk.0.ffn_down.weight": (rng.standard_normal((hidden, 4 * hidden), dtype=np.float32), T.F16),
               "output_norm.weight": (np.ones(hidden, dtype=np.float32), T.F32)}
    for name, (data, qtype) in tensors.items():
        if qtype == T.F32:
            w.add_tensor(name, data)
        elif qtype == T.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_read_copies_the_tensor_data(tmp_path):
    from radixserve.model_loader.gguf_reader import GGUFHeader

    path = str(tmp_path / "small.gguf")
    _write(path, 512, 64)
    header = GGUFHeader(path)
    for t in header.tensors:
        copy = header.read(t)
        assert copy.flags.writeable and copy.flags.owndata and not np.shares_memory(copy, t.data)
        assert copy.dtype == t.data.dtype and np.array_equal(copy, t.data), t.name


def test_loading_kept_blocks_does_not_map_the_file_in(tmp_path):
    from radixserve.model_loader.gguf_file import GGUFCheckpoint

    cfg = SimpleNamespace(num_attention_heads=8, num_key_value_heads=8)
    small, big = str(tmp_path / "small.gguf"), str(tmp_path / "big.gguf")
    _write(small, 512, 64)
    _write(big, 16384, 1024)  # ~27 MB: a Q8_0 embedding, Q4_0 and F16 linear weights, a float32 norm
    list(GGUFCheckpoint(small).weights(cfg, keep_gguf_blocks=True))  # imports and lazy set-up happen here
    size = sum(t.data.nbytes for t in GGUFCheckpoint(big).reader.tensors)
    for keep in (True, False):
        ck = GGUFCheckpoint(big)  # kept open, as the engine keeps its checkpoint
        before = _rss_file()
        loaded = list(ck.weights(cfg, keep_gguf_blocks=keep))  # held, as a model holds its weights
        grown = _rss_file() - before
        assert len(loaded) == 4
        # mapped reads made every data page resident: grown ~ size; pread leaves them to the page cache
        assert grown < 0.2 * size, (keep, grown, size)

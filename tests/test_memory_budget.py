"""The KV pool sized by the memory actually available after the weights (engine/memory.py):
MemAvailable or a closer cgroup limit, v1 and v2, and a clear refusal to start when too
little is left, instead of a pool of a few tokens that refuses every request."""

from __future__ import annotations

import pytest
import torch
from engine_checks import leak_checked_engine
from radixserve.engine import memory
from tiny_models import build_checkpoint

GIB = 2**30


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


@pytest.fixture()
def meminfo(tmp_path):
    return write(tmp_path / "meminfo", f"MemTotal: {64 * GIB // 1024} kB\nMemAvailable: {20 * GIB // 1024} kB\n")


def available(tmp_path, meminfo, cgroup_lines):
    return memory.available_memory(torch.device("cpu"), meminfo=meminfo, cgroup_root=str(tmp_path / "cg"),
                                   proc_cgroup=write(tmp_path / "self_cgroup", cgroup_lines))


def test_mem_available_without_a_cgroup_limit(tmp_path, meminfo):
    write(tmp_path / "cg" / "memory.max", "max\n")
    write(tmp_path / "cg" / "memory.current", str(GIB))
    assert available(tmp_path, meminfo, "0::/\n") == 20 * GIB


def test_a_closer_cgroup_v2_limit_wins(tmp_path, meminfo):
    write(tmp_path / "cg" / "job" / "memory.max", str(6 * GIB))
    write(tmp_path / "cg" / "job" / "memory.current", str(2 * GIB))
    assert available(tmp_path, meminfo, "0::/job\n") == 4 * GIB


def test_a_closer_cgroup_v1_limit_wins(tmp_path, meminfo):
    write(tmp_path / "cg" / "memory" / "box" / "memory.limit_in_bytes", str(8 * GIB))
    write(tmp_path / "cg" / "memory" / "box" / "memory.usage_in_bytes", str(3 * GIB))
    assert available(tmp_path, meminfo, "4:memory:/box\n1:cpu:/\n") == 5 * GIB
    # v1 writes "no limit" as a number near 2^63
    write(tmp_path / "cg" / "memory" / "box" / "memory.limit_in_bytes", str(2**63 - 4096))
    assert available(tmp_path, meminfo, "4:memory:/box\n") == 20 * GIB


def test_the_pool_comes_from_what_is_available(tmp_path, monkeypatch):
    build_checkpoint(str(tmp_path), "llama", seed=1, max_position_embeddings=512)
    monkeypatch.setattr(memory, "available_memory", lambda device: 64 << 20)
    with leak_checked_engine(str(tmp_path), max_total_tokens=None, mem_fraction_static=0.25) as engine:
        runner = engine.runner
        per_token = runner.kv_pool.buffer.nbytes // (runner.max_total_tokens + runner.kv_pool.page_size)
        assert runner.kv_pool.buffer.nbytes <= 16 << 20  # a quarter of what is available, scratch page included
        assert runner.max_total_tokens == pytest.approx((16 << 20) // per_token, rel=0.01)
        assert engine.generate(input_ids=[5] * 20, sampling_params={"max_new_tokens": 2})["output_ids"]


def test_too_little_memory_stops_the_start_naming_the_flags(tmp_path, monkeypatch):
    build_checkpoint(str(tmp_path), "llama", seed=1, max_position_embeddings=512)
    monkeypatch.setattr(memory, "available_memory", lambda device: 64 << 10)  # 64 KiB
    with pytest.raises(ValueError) as e, leak_checked_engine(str(tmp_path), max_total_tokens=None):
        pass
    message = str(e.value)
    assert "KV pool would hold" in message and "--mem-fraction-static" in message and "--max-total-tokens" in message

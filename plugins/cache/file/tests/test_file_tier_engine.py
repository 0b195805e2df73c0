"""The file tier under a real engine (HiCache-SSD): a restarted engine is served from the
directory with identical tokens; corrupted, truncated and foreign page files are rejected
by the core and recomputed; a size bound holds; a directory that refuses writes (full or
read-only) degrades to recomputation with one warning. Tiny random-weight Llama."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import radixserve
from engine_checks import wait_until_idle  # noqa: E402 - tests/ is on sys.path (conftest)
from radixserve_cache_file.store import FileTier
from tiny_models import build_checkpoint, random_prompts  # noqa: E402

PAGE = 4
PARAMS = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def prompts(num=4, length=96, seed=0):
    return random_prompts(num, length, seed)


def engine(path, storage_dir, **kw):
    kw.setdefault("hicache_storage_prefetch_policy", "wait_complete")
    return radixserve.Engine(path, dtype="float32", page_size=PAGE, max_total_tokens=512, enable_leak_check=True,
                             enable_hierarchical_cache=True, hicache_storage_backend="file",
                             hicache_storage_dir=str(storage_dir), **kw)


def run(path, storage_dir, ps, **kw):
    e = engine(path, storage_dir, **kw)
    try:
        outs = e.generate(input_ids=ps, sampling_params=PARAMS)
        wait_until_idle(e)
        return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs], e.get_stats()
    finally:
        e.shutdown()  # pending writes land before it returns


def page_files(d):
    return sorted(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if f.endswith(".kv"))


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    e = radixserve.Engine(tiny, dtype="float32", page_size=PAGE, max_total_tokens=4096)
    try:
        return [o["output_ids"] for o in e.generate(input_ids=prompts(), sampling_params=PARAMS)]
    finally:
        e.shutdown()


def test_a_restarted_engine_is_served_from_the_directory(tiny, tmp_path, reference):
    outs, cached, stats = run(tiny, tmp_path, prompts())
    assert outs == reference and sum(cached) == 0
    assert len(page_files(tmp_path)) >= 4 * 96 // PAGE  # written through, landed by shutdown
    outs, cached, stats = run(tiny, tmp_path, prompts())  # a new engine: its device and host tiers are empty
    assert outs == reference
    assert stats["hicache_storage_hit_tokens"] >= 4 * (96 - PAGE)
    assert all(c >= 96 - PAGE for c in cached)
    assert stats["num_prefill_tokens"] <= 4 * PAGE


def test_corrupted_truncated_and_foreign_files_are_recomputed(tiny, tmp_path, reference, caplog):
    run(tiny, tmp_path / "ours", prompts())
    other = str(tmp_path / "other-model")
    build_checkpoint(other, "llama", seed=9, max_position_embeddings=512)  # same shapes, other weights
    run(other, tmp_path / "theirs", prompts())
    ours, theirs = page_files(tmp_path / "ours"), page_files(tmp_path / "theirs")
    assert ours and theirs and not {os.path.basename(f) for f in ours} & {os.path.basename(f) for f in theirs}
    for i, path in enumerate(ours):
        with open(path, "r+b") as f:
            data = f.read()
            f.seek(0)
            if i % 3 == 0:  # one flipped byte in the K/V
                f.write(data[:-5] + bytes([data[-5] ^ 0x40]) + data[-4:])
            elif i % 3 == 1:  # cut short
                f.truncate(len(data) // 2)
            else:  # another model's page under our key
                f.write(open(theirs[i % len(theirs)], "rb").read())
                f.truncate()
    with caplog.at_level(logging.WARNING):
        outs, cached, stats = run(tiny, tmp_path / "ours", prompts())
    assert outs == reference
    assert stats["hicache_storage_errors"] > 0
    assert stats["hicache_storage_hit_tokens"] == 0 and sum(cached) == 0
    assert "rejected" in caplog.text


def test_the_size_bound_holds_under_an_engine(tiny, tmp_path, reference):
    outs, _, stats = run(tiny, tmp_path, prompts())
    page_bytes = os.path.getsize(page_files(tmp_path)[0])
    bound = 10 * page_bytes
    outs, _, stats = run(tiny, tmp_path, prompts(seed=1), hicache_storage_size=bound)
    assert sum(os.path.getsize(f) for f in page_files(tmp_path)) <= bound
    assert len(page_files(tmp_path)) == 10


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_a_directory_that_refuses_writes_degrades_with_one_warning(tiny, tmp_path, reference, monkeypatch,
                                                                    caplog, err):
    def refuse(self, path, value):
        raise OSError(err, os.strerror(err), path)

    monkeypatch.setattr(FileTier, "_write", refuse)
    with caplog.at_level(logging.WARNING):
        outs, _, stats = run(tiny, tmp_path, prompts())
    assert outs == reference
    assert not page_files(tmp_path)
    assert stats["hicache_storage_store_pages"] == 0
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("cannot store pages" in m for m in messages) == 1, messages  # the tier: once, not per page
    assert sum("not stored" in m for m in messages) == 1, messages  # the core: once a minute at most

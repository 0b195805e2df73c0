"""HiCache with ``--tp-size 2`` (gloo on CPU): each rank keeps its own KV head's pages in its own
host pool and storage, repeating rank 0's copies page for page.

* A device pool too small for the conversations demotes them to the host and loads them back
  (pages of 1 and 16): the tokens equal one rank's with a large pool (pages of 4), the host tier
  served prompt tokens, nothing leaks (every write policy that copies).
* The file tier: a restarted TP 2 engine is served from what the first one stored (both ranks'
  pages), with one rank's tokens; with rank 1's stored values deleted a TP 2 engine reads none
  of rank 0's either and still gives those tokens (a prefix counts only as far as every rank
  has it, never with one rank's half);
  a one-rank engine over the same directory reads none of those pages (another layout).
"""

from __future__ import annotations

import pytest
from test_hicache import PARAMS, SMALL, conversations, engine_for, run_rounds

TP = dict(tp_size=2, max_total_tokens=SMALL, disable_mixed_chunk=True, enable_hierarchical_cache=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tiny_models import build_checkpoint

    path = str(tmp_path_factory.mktemp("hicache_tp_llama"))
    build_checkpoint(path, "llama", seed=5, max_position_embeddings=512)  # 2 KV heads: one per rank
    return path


@pytest.fixture(scope="module")
def reference(tiny_path):
    with engine_for(tiny_path) as engine:
        return run_rounds(engine, conversations())


@pytest.mark.parametrize("policy,page", [("write_through", 1), ("write_back", 16)])
def test_host_tier_with_tp2_gives_one_ranks_tokens(tiny_path, reference, policy, page):
    with engine_for(tiny_path, hicache_ratio=8, hicache_write_policy=policy, page_size=page, **TP) as hi:
        assert run_rounds(hi, conversations()) == reference
        stats = hi.get_stats()
    assert stats["hicache_host_hit_tokens"] > 0 and stats["hicache_demoted_pages"] > 0


def storage(tmp_path, **kw):
    return dict(hicache_ratio=4, hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete",
                hicache_storage_dir=str(tmp_path / "kv"), **kw)


def test_file_tier_with_tp2_serves_a_restart_and_keeps_layouts_apart(tiny_path, reference, tmp_path):
    rounds = conversations()
    last = rounds[-1]
    want = reference[-len(last):]
    with engine_for(tiny_path, **TP, **storage(tmp_path)) as first:
        assert run_rounds(first, rounds) == reference
        assert first.get_stats()["hicache_storage_store_pages"] > 0
        rank0_salt = bytes.fromhex(first.scheduler.cache.storage.salt)
    with engine_for(tiny_path, **TP, **storage(tmp_path)) as second:
        outs = second.generate(input_ids=last, sampling_params=PARAMS)
        stats = second.get_stats()
    assert [o["output_ids"] for o in outs] == want
    assert stats["hicache_storage_hit_tokens"] > 0
    assert stats["num_prefill_tokens"] < sum(len(p) for p in last) / 2
    # rank 1's stored values gone, rank 0's kept: a prefix is read only as far as both ranks
    # have it, so nothing is read and everything recomputed, with the same tokens
    files = [p for p in (tmp_path / "kv").rglob("*.kv")]
    theirs = [f for f in files if f.read_bytes()[6:38] != rank0_salt]  # the frame names its layout's salt
    assert 0 < len(theirs) < len(files)
    for f in theirs:
        f.unlink()
    with engine_for(tiny_path, **TP, **storage(tmp_path)) as third:
        outs = third.generate(input_ids=last, sampling_params=PARAMS)
        assert [o["output_ids"] for o in outs] == want
        assert third.get_stats()["hicache_storage_hit_tokens"] == 0
    # one rank over the same directory: TP 2's pages are another layout, never read
    with engine_for(tiny_path, max_total_tokens=SMALL, disable_mixed_chunk=True, enable_hierarchical_cache=True,
                    **storage(tmp_path)) as one:
        outs = one.generate(input_ids=last, sampling_params=PARAMS)
        assert [o["output_ids"] for o in outs] == want
        assert one.get_stats()["hicache_storage_hit_tokens"] == 0

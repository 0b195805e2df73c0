"""The ``standalone`` speculative method and the DraftModel machinery, on tiny random models.

Greedy outputs must equal plain decoding (one batch, one at a time with the radix cache
warm, chunked prefill, pages of 4), every draft must equal the one a reference built from
full forward passes of the draft model proposes (so the draft's K/V, kept at the target's
slots, mirror the tokens exactly, also after prefix-cache hits and retraction), and the
target drafting for itself must have (nearly) every draft token accepted.
"""

from __future__ import annotations

import json
import os

import pytest
import radixserve
import torch
from radixserve.speculative import Draft, Proposer
from radixserve.speculative.draft_model import DraftModel
from radixserve.testing import speculative_conformance as sc

GREEDY = {"temperature": 0.0, "max_new_tokens": 24}
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],
    [40, 41, 42, 40, 41, 42, 40, 41],
    [100, 3, 77, 100, 3, 77, 100, 3, 77, 100],
    list(range(20, 60)),
    [11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13],
]


def _engine(tiny, draft, **kw):
    kw.setdefault("max_total_tokens", 4096)
    return radixserve.Engine(tiny, speculative_algorithm="STANDALONE", speculative_draft_model_path=draft,
                             speculative_disable_by_batch_size=sc.ALWAYS, enable_leak_check=True, **kw)


@pytest.fixture(scope="module")
def plain(tiny):
    with radixserve.Engine(tiny, max_total_tokens=4096, enable_leak_check=True) as eng:
        return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


# ------------------------------------------------------------------ greedy parity
@pytest.mark.parametrize("draft,topk", [("self", 1), ("layerskip", 1), ("other", 1), ("self", 2), ("layerskip", 2)])
def test_greedy_parity(tiny, drafts, draft, topk):
    """Through the conformance suite: one batch, one at a time (cache warm), chunked prefill."""
    stats = sc.check_greedy_parity("standalone", tiny, PROMPTS, max_new_tokens=24, max_total_tokens=4096,
                                   speculative_draft_model_path=drafts[draft], speculative_eagle_topk=topk)
    assert stats["spec_num_draft_tokens"] > 0, stats
    if draft == "self" and topk == 1:
        assert stats["spec_acceptance_rate"] > 0.97, stats
        assert stats["spec_accept_length"] > 3.5, stats  # 3 drafts + the bonus token per step


def test_pages_and_small_chunks(tiny, drafts, plain):
    for topk in (1, 3):
        with _engine(tiny, drafts["layerskip"], page_size=4, chunked_prefill_size=5,
                     speculative_eagle_topk=topk) as eng:
            outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outs] == plain, topk
            alone = [eng.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]
            assert alone == plain, topk


def test_self_draft_accepts_nearly_everything(tiny, drafts):
    """The target as its own draft: every chain token is accepted; a tree keeps the greedy
    path among its candidates, so whole runs are accepted there too."""
    with _engine(tiny, drafts["self"]) as eng:
        outs = eng.generate(input_ids=PROMPTS, sampling_params={**GREEDY, "max_new_tokens": 40})
        stats = eng.get_stats()
    assert stats["spec_acceptance_rate"] > 0.97, stats
    for o in outs:
        assert o["meta_info"]["spec_accept_length"] > 3.5, o["meta_info"]
    # a tree holding every candidate: the greedy path is the frontier's best branch
    with _engine(tiny, drafts["self"], speculative_eagle_topk=2, speculative_num_draft_tokens=11) as eng:
        eng.generate(input_ids=PROMPTS, sampling_params={**GREEDY, "max_new_tokens": 40})
        stats = eng.get_stats()
    assert stats["spec_accept_length"] > 3.0, stats


# ------------------------------------------------------------------ drafts equal a reference
class Recorder(Proposer):
    """Delegates to the method's proposer and keeps (tokens so far, max_tokens, draft)."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.hidden_layers = inner.hidden_layers
        self.seen: list[tuple[list[int], int, Draft | None]] = []

    def propose(self, reqs, max_tokens):
        out = self.inner.propose(reqs, max_tokens)
        self.seen.extend((list(r.all_ids), k, d) for r, k, d in zip(reqs, max_tokens, out))
        return out

    def observe(self, steps):
        self.inner.observe(steps)

    def release(self, req):
        self.inner.release(req)


def reference_draft(logits_of, ids: list[int], want: int, steps: int, topk: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the best-first tree, from full forwards: ``logits_of(ids)`` is
    the draft model's ``# [V]`` logits after ``ids``."""
    def expand(prefix_score: float, path: list[int]):
        s, t = torch.log_softmax(logits_of(ids + path), dim=-1).topk(topk)
        return [(prefix_score + a, b) for a, b in zip(s.tolist(), t.tolist())]

    cands = [(s, t, -1) for s, t in expand(0.0, [])]  # (score, token, parent)

    def path_of(c: int) -> list[int]:
        out = []
        while c >= 0:
            out.append(cands[c][1])
            c = cands[c][2]
        return out[::-1]

    frontier = list(range(topk))
    for _ in range(1, min(steps, want)):
        first = len(cands)
        for f in frontier:
            cands += [(s, t, f) for s, t in expand(cands[f][0], path_of(f))]
        block = range(first, len(cands))
        frontier = sorted(block, key=lambda c: -cands[c][0])[:topk]
    chosen = sorted(sorted(range(len(cands)), key=lambda c: -cands[c][0])[:want])
    at = {c: i for i, c in enumerate(chosen)}
    return [cands[c][1] for c in chosen], [at[cands[c][2]] if cands[c][2] >= 0 else -1 for c in chosen]


def _check_against_reference(recorded, logits_of, steps, topk, num_draft_tokens):
    assert recorded, "no drafts were proposed"
    bad = []
    for ids, k, d in recorded:
        want = min(num_draft_tokens - 1, k)
        tokens, parents = reference_draft(logits_of, ids, want, steps, topk)
        got = (d.tokens, d.parents if d.parents is not None else list(range(-1, len(d.tokens) - 1)))
        if got != (tokens, parents):
            bad.append((len(ids), k, got, (tokens, parents)))
    assert not bad, f"{len(bad)} of {len(recorded)} drafts differ from the reference, e.g. {bad[0]}"


@pytest.mark.parametrize("topk,num_draft_tokens", [(1, 4), (2, 7), (3, 6)])
def test_drafts_equal_the_reference(tiny, drafts, plain, topk, num_draft_tokens):
    """Prompts cached by requests that ended at their prefill, then batched, then a second
    turn over each first turn's output (whose last steps' draft K/V are computed at
    release), then under a KV pool small enough to retract: every draft is the
    reference's."""
    draft_path = drafts["layerskip"]
    with radixserve.Engine(draft_path, max_total_tokens=4096) as ref_engine:
        def logits_of(ids):
            return ref_engine.runner.prompt_logits(ids)[-1]

        with _engine(tiny, draft_path, speculative_eagle_topk=topk, speculative_num_steps=3,
                     speculative_num_draft_tokens=num_draft_tokens) as eng:
            rec = eng.scheduler.spec.proposer = Recorder(eng.scheduler.spec.proposer)
            # ended by their prefill: never observed, their prompts cached all the same (twice
            # each, so a second copy's queued positions are the first's)
            eng.generate(input_ids=[p + [250, 251] for p in PROMPTS] * 2,
                         sampling_params={**GREEDY, "max_new_tokens": 1})
            outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outs] == plain
            for p, o in zip(PROMPTS, outs):
                eng.generate(input_ids=p + o["output_ids"] + [7, 8], sampling_params=GREEDY)
            _check_against_reference(rec.seen, logits_of, 3, topk, num_draft_tokens)
        with _engine(tiny, draft_path, speculative_eagle_topk=topk, speculative_num_draft_tokens=num_draft_tokens,
                     max_total_tokens=176, page_size=4) as eng:
            rec = eng.scheduler.spec.proposer = Recorder(eng.scheduler.spec.proposer)
            eng.generate(input_ids=PROMPTS * 3, sampling_params={**GREEDY, "max_new_tokens": 48, "ignore_eos": True})
            assert eng.get_stats()["num_retractions"] > 0
            _check_against_reference(rec.seen, logits_of, 3, topk, num_draft_tokens)


def test_draft_kv_lives_at_the_target_slots(tiny, drafts):
    """A prompt whose prefix another request computed: the draft K/V of the cached pages is
    read, not recomputed, and equals what computing it afresh gives."""
    with _engine(tiny, drafts["layerskip"], page_size=4) as eng:
        dm: DraftModel = eng.scheduler.spec.proposer
        pool = dm.kv_pool
        assert pool.page_size == 4 and pool.num_slots >= eng.runner.kv_pool.num_slots
        assert len(pool.k_buffers) == 2  # the draft's layers, not the target's 4
        eng.generate(input_ids=PROMPTS[3], sampling_params=GREEDY)
        before = dm.num_tokens
        eng.generate(input_ids=PROMPTS[3][:36] + [9, 9, 9], sampling_params={**GREEDY, "max_new_tokens": 2})
        assert 0 < dm.num_tokens - before < 36  # the cached 36 positions were not run again
        cached = eng.scheduler.cache.match_prefix(PROMPTS[3][:36])
        slots = torch.tensor([p * 4 + o for p in cached.pages for o in range(4)])
        k_cached = pool.k_buffers[1][slots].clone()
        fresh = radixserve.Engine(drafts["layerskip"], max_total_tokens=4096)
        try:
            # the draft model run as a target over the same tokens: layer 1's keys
            rows, pool_rows = [], fresh.runner.req_to_token_pool
            alloc = pool_rows.alloc
            pool_rows.alloc = lambda: rows.append(alloc()) or rows[-1]
            fresh.runner.prompt_logits(PROMPTS[3][:36])
            table = pool_rows.req_to_token
            k_fresh = fresh.runner.kv_pool.k_buffers[1][table[rows[-1], :36]]  # the row it borrowed
        finally:
            fresh.shutdown()
    torch.testing.assert_close(k_cached, k_fresh, rtol=1e-4, atol=1e-4)


def test_prepare_hook_sees_every_forward(tiny, drafts, plain):
    """``prepare`` (the hook for extra per-token inputs) runs before every forward, with the
    batch kind and, on draft levels, each token's parent row in the previous forward."""
    seen = []

    def prepare(batch):
        kind = batch.extra["draft_kind"]
        if kind == "draft":
            prev, rows = batch.extra["draft_prev"], batch.extra["draft_parent_rows"]
            assert rows.shape[0] == batch.input_ids.shape[0]
            assert 0 <= int(rows.min()) and int(rows.max()) < prev.logits_indices.shape[0]
        seen.append(kind)

    with _engine(tiny, drafts["layerskip"], speculative_eagle_topk=2) as eng:
        inner: DraftModel = eng.scheduler.spec.proposer
        inner.prepare = prepare
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain
    assert "extend" in seen and "draft" in seen and len(seen) == inner.num_forwards


# ------------------------------------------------------------------ leaks and errors
@pytest.mark.parametrize("topk", [1, 2])
def test_no_leaks_under_abort_and_retraction(tiny, drafts, topk):
    sc.check_no_leaks("standalone", tiny, PROMPTS, speculative_draft_model_path=drafts["layerskip"],
                      speculative_eagle_topk=topk)


def test_bad_draft_paths_name_the_flag(tiny, drafts, tmp_path):
    with pytest.raises(ValueError, match="standalone needs --speculative-draft-model-path"):
        radixserve.Engine(tiny, speculative_algorithm="standalone", max_total_tokens=1024)
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=f"--speculative-draft-model-path '{missing}' does not exist"):
        _engine(tiny, missing, max_total_tokens=1024)
    with pytest.raises(ValueError, match=r"--speculative-draft-model-path .*: vocab size 320 != target's 300"):
        _engine(tiny, drafts["vocab"], max_total_tokens=1024)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="--speculative-draft-model-path .*has no config.json"):
        _engine(tiny, str(empty), max_total_tokens=1024)


# ------------------------------------------------------------------ the layer-skip writer
def test_layerskip_draft_is_the_targets_first_layers(tiny, drafts):
    """The written directory loads in transformers as the target truncated to its first
    layers (final norm and LM head kept), and our engine computes the same logits."""
    from transformers import AutoModelForCausalLM

    out = drafts["layerskip"]
    with open(os.path.join(out, "config.json")) as fh:
        assert json.load(fh)["num_hidden_layers"] == 2
    full = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32).eval()
    full.model.layers = full.model.layers[:2]
    full.config.num_hidden_layers = 2
    cut = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        want = full(ids).logits[0]
        torch.testing.assert_close(cut(ids).logits[0], want)
    with radixserve.Engine(out, max_total_tokens=1024) as eng:
        torch.testing.assert_close(eng.runner.prompt_logits(PROMPTS[0]), want, rtol=1e-4, atol=1e-4)
        assert eng.tokenizer.encode("w5 w6", add_special_tokens=False) == [5, 6]
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 4\]"):
        from radixserve_speculative_standalone import write_layerskip_draft

        write_layerskip_draft(tiny, out + "-bad", 5)


def test_sampling_matches_plain_sampling(tiny, drafts):
    """Tree drafts under sampling: the first tokens follow plain sampling's distribution."""
    pvalues = sc.check_distribution("standalone", tiny, [7, 8, 9, 7, 8, 9, 7, 8], num_samples=1000, positions=3,
                                    params_list=({"temperature": 1.0},), max_total_tokens=8192,
                                    max_running_requests=256, speculative_draft_model_path=drafts["self"],
                                    speculative_eagle_topk=2)
    assert min(pvalues) > 0


def test_greedy_parity_with_tp2(tiny, drafts, plain):
    """--tp-size 2: the draft is whole on rank 0 and runs there alone (no collective), the
    target is split over two ranks; greedy tokens equal one rank's plain decoding, and the
    target drafting for itself keeps nearly every draft (the draft really runs)."""
    kw = dict(tp_size=2, max_total_tokens=2048)
    stats = sc.check_greedy_parity("standalone", tiny, PROMPTS, max_new_tokens=24,
                                   speculative_draft_model_path=drafts["self"], **kw)
    assert stats["spec_acceptance_rate"] > 0.97, stats
    with _engine(tiny, drafts["layerskip"], speculative_eagle_topk=2, page_size=16, **kw) as eng:  # pages of 16
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == plain
        assert eng.get_stats()["spec_num_draft_tokens"] > 0

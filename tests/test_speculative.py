"""Speculative decoding in the core: draft trees, lossless acceptance, the verify step.

Engines here run a tiny random model; the default model's parity lives in
``test_speculative_default.py``. Test proposers are registered on a private registry:
``oracle`` knows each prompt's plain greedy continuation and hides the right token on a
side branch of its tree (so accepted nodes' K/V must move onto the path), ``failing``
raises, ``junk`` returns drafts that break the contract.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import radixserve
import torch
from radixserve.hookspecs import hookimpl
from radixserve.registry import Registry
from radixserve.speculative import Draft, Proposer, TargetModel
from radixserve.speculative import runtime as spec_runtime
from radixserve.speculative.tree import DraftError, ancestor_mask, depths, validate
from radixserve.speculative.verify import accept_greedy, accept_sampled
from radixserve.testing import speculative_conformance as sc
from tiny_models import build_checkpoint

GREEDY = {"temperature": 0.0, "max_new_tokens": 24}
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],
    [40, 41, 42, 40, 41, 42, 40, 41],
    [100, 3, 77, 100, 3, 77, 100, 3, 77, 100],
    list(range(20, 60)),
    [11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13],
]


# ------------------------------------------------------------------ trees and acceptance
def test_tree_helpers():
    parents = [-1, 0, 0, 1, 1, 3]
    assert depths(parents) == [0, 1, 1, 2, 2, 3]
    mask = ancestor_mask(parents)
    assert mask[5].tolist() == [True, True, False, True, False, True]
    assert mask[2].tolist() == [True, False, True, False, False, False]
    d = Draft([7, 8, 9], [-1, -1, 1])
    assert d.node_parents() == [-1, 0, 0, 2]
    assert Draft([1, 2]).node_parents() == [-1, 0, 1]


def test_validate_cuts_and_rejects():
    assert validate(Draft([1, 2, 3, 4]), 10, 2).tokens == [1, 2]
    cut = validate(Draft([1, 2, 3], [-1, 0, -1]), 10, 2)
    assert cut.tokens == [1, 2] and cut.parents is None  # a chain after the cut
    with pytest.raises(DraftError, match="not a token id"):
        validate(Draft([1, 10]), 10, 5)
    with pytest.raises(DraftError, match="parent"):
        validate(Draft([1, 2], [-1, 1]), 10, 5)
    with pytest.raises(DraftError, match="parents"):
        validate(Draft([1, 2], [-1]), 10, 5)


def test_accept_greedy_walks_the_tree():
    # root -> {a=5 (node 1), b=6 (node 2)}; node 2 -> {7 (node 3)}
    parents, tokens = [-1, 0, 0, 2], [0, 5, 6, 7]
    acc = accept_greedy(parents, tokens, argmax=[6, 1, 7, 9])
    assert acc.nodes == [2, 3] and acc.tokens == [6, 7, 9] and acc.rows == [0, 2, 3]
    acc = accept_greedy(parents, tokens, argmax=[4, 0, 0, 0])
    assert acc.nodes == [] and acc.tokens == [4]


def _empirical(parents, tokens, probs, n, rule=accept_sampled):
    gen = torch.Generator().manual_seed(0)
    firsts, seconds = Counter(), Counter()
    for _ in range(n):
        acc = rule(parents, tokens, probs, gen)
        firsts[acc.tokens[0]] += 1
        if len(acc.tokens) > 1:
            seconds[(acc.tokens[0], acc.tokens[1])] += 1
    return firsts, seconds


def test_accept_sampled_is_lossless():
    """Every emitted first token follows the root's distribution exactly, and the token
    after an accepted draft follows that node's distribution."""
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(4, 6) * 1.5, dim=-1)  # [nodes, V]
    parents, tokens = [-1, 0, 0, 1], [0, 2, 4, 3]  # root -> 2, 4; 2 -> 3
    n = 20000
    firsts, seconds = _empirical(parents, tokens, probs, n)
    expected = probs[0] * n
    chi2 = sum((firsts[t] - expected[t].item()) ** 2 / expected[t].item() for t in range(6))
    assert chi2 < 25, (chi2, firsts, expected)  # 5 df: p ~ 1e-4
    # after accepting token 2 (node 1) the next token follows node 1's row
    after = Counter({b: c for (a, b), c in seconds.items() if a == 2})
    total = sum(after.values())
    exp1 = probs[1] * total
    chi2 = sum((after[t] - exp1[t].item()) ** 2 / exp1[t].item() for t in range(6))
    assert chi2 < 25, (chi2, after, exp1)


def test_a_broken_acceptance_rule_is_detected():
    """Accepting a draft child with probability 1 (a classic bug) skews the distribution
    far past the bound the lossless test uses."""
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(4, 6) * 1.5, dim=-1)
    parents, tokens = [-1, 0, 0, 1], [0, 2, 4, 3]

    def always(parents, tokens, probs, gen):
        return accept_greedy(parents, tokens, [tokens[1], tokens[3], 0, 0])

    n = 20000
    firsts, _ = _empirical(parents, tokens, probs, n, rule=always)
    expected = probs[0] * n
    chi2 = sum((firsts[t] - expected[t].item()) ** 2 / max(expected[t].item(), 1e-9) for t in range(6))
    assert chi2 > 1000


def test_chi2_two_sample():
    a = Counter({0: 500, 1: 300, 2: 200})
    assert sc.chi2_two_sample(a, Counter({0: 510, 1: 290, 2: 200}))[2] > 0.5
    assert sc.chi2_two_sample(a, Counter({0: 300, 1: 300, 2: 400}))[2] < 1e-10


# ------------------------------------------------------------------ test proposers
class OracleProposer(Proposer):
    """Drafts the plain greedy continuation, hiding each right token as the second child
    of a node whose first child is wrong; every other request gets nothing."""

    refs: dict[tuple, list[int]] = {}

    def __init__(self, ctx) -> None:
        self.vocab = ctx.vocab_size
        self.released: list[str] = []

    def propose(self, reqs, max_tokens):
        out = []
        for req, k in zip(reqs, max_tokens):
            ref = self.refs.get(tuple(req.input_ids))
            if ref is None:
                out.append(None)
                continue
            done = len(req.output_ids)
            right = ref[done:done + k // 2]
            tokens, parents, parent = [], [], -1
            for tok in right:
                tokens += [(tok + 1) % self.vocab, tok]  # wrong first, right second
                parents += [parent, parent]
                parent = len(tokens) - 1
            out.append(Draft(tokens, parents) if tokens else None)
        return out

    def release(self, req):
        self.released.append(req.rid)


class AlternatingProposer(Proposer):
    """The plain greedy continuation as a chain on every other call, nothing in between."""

    refs: dict[tuple, list[int]] = {}

    def __init__(self, ctx) -> None:
        self.calls = self.drafts = 0

    def propose(self, reqs, max_tokens):
        out = []
        for req, k in zip(reqs, max_tokens):
            self.calls += 1
            done = len(req.output_ids)
            right = self.refs[tuple(req.input_ids)][done:done + k] if self.calls % 2 else []
            self.drafts += bool(right)
            out.append(Draft(right, list(range(-1, len(right) - 1))) if right else None)
        return out


class FailingProposer(Proposer):
    def __init__(self, ctx) -> None:
        pass

    def propose(self, reqs, max_tokens):
        raise RuntimeError("proposer bug")


class JunkProposer(Proposer):
    def __init__(self, ctx) -> None:
        self.vocab = ctx.vocab_size

    def propose(self, reqs, max_tokens):
        return [Draft([self.vocab + 5]), Draft([1, 2], [-1, 3])] * len(reqs)


def _width_from_target(target) -> int:
    """A default computed from the target: records what it was called with."""
    _width_from_target.seen = target
    return 3 if target.device.type == "cpu" else 99


class _Plugin:
    @staticmethod
    @hookimpl
    def register_speculative_algorithms(register):
        register("oracle", OracleProposer, defaults={"speculative_num_draft_tokens": 9})
        register("computed", AlternatingProposer, defaults={"speculative_num_draft_tokens": _width_from_target})
        register("alternating", AlternatingProposer, defaults={"speculative_num_draft_tokens": 4})
        register("failing", FailingProposer)
        register("junk", JunkProposer)


@pytest.fixture(scope="module")
def registry():
    reg = Registry()
    reg.load_entry_points()
    reg.add_plugin(_Plugin, name="spec-test", distribution="tests")
    yield reg
    reg.remove_plugin("spec-test")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spec_llama"))
    build_checkpoint(path, "llama", seed=3, max_position_embeddings=512)
    return path


@pytest.fixture(scope="module")
def plain_refs(tiny):
    with radixserve.Engine(tiny, max_total_tokens=4096) as eng:
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    return [o["output_ids"] for o in outs]


def _spec_engine(tiny, registry, algorithm, **kw):
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("speculative_disable_by_batch_size", sc.ALWAYS)
    return radixserve.Engine(tiny, registry=registry, speculative_algorithm=algorithm,
                             enable_leak_check=True, **kw)


@pytest.mark.parametrize("page_size", [1, 4])
def test_oracle_tree_accepts_side_branches_exactly(tiny, registry, plain_refs, page_size):
    """Every right token sits on a side branch: whole runs are accepted, their K/V moved
    onto the path, and the output is plain greedy decoding's, batched and alone."""
    OracleProposer.refs = {tuple(p): r for p, r in zip(PROMPTS, plain_refs)}
    with _spec_engine(tiny, registry, "ORACLE", page_size=page_size) as eng:
        outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == plain_refs
        stats = eng.get_stats()
        assert stats["spec_accept_length"] > 3.0, stats  # 4 right tokens per step + the bonus
        assert stats["spec_num_accepted_tokens"] > 0
        for o in outs:
            assert o["meta_info"]["spec_verify_ct"] < len(o["output_ids"])
            assert o["meta_info"]["spec_accept_length"] > 1.0
        alone = [eng.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]
        assert alone == plain_refs
        assert len(eng.scheduler.spec.proposer.released) == 2 * len(PROMPTS)


def test_drafted_accept_length_counts_only_steps_with_a_draft(tiny, registry, plain_refs):
    """spec_accept_length counts a step without a draft as one token;
    spec_drafted_accept_length is over the steps that verified a draft only."""
    AlternatingProposer.refs = {tuple(p): r for p, r in zip(PROMPTS, plain_refs)}
    with _spec_engine(tiny, registry, "alternating") as eng:
        out = eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
        assert out == plain_refs[0]
        proposer, stats = eng.scheduler.spec.proposer, eng.get_stats()
    steps = proposer.calls  # alone in its batch: one proposal per decode step
    undrafted = steps - proposer.drafts
    assert 0 < undrafted < steps
    decoded = len(out) - 1  # the first token came from the prefill
    assert stats["spec_accept_length"] == pytest.approx(decoded / steps)
    assert stats["spec_drafted_accept_length"] == pytest.approx((decoded - undrafted) / proposer.drafts)
    assert stats["spec_drafted_accept_length"] > stats["spec_accept_length"]


def test_finish_inside_an_accepted_run(tiny, registry, plain_refs):
    """max_new_tokens, stop tokens and stop strings inside a run of accepted drafts end the
    output exactly where plain decoding ends it."""
    OracleProposer.refs = {tuple(p): r for p, r in zip(PROMPTS, plain_refs)}
    ref = plain_refs[0]
    stop_tok = ref[6]
    cases = [
        {"temperature": 0.0, "max_new_tokens": 7},
        {"temperature": 0.0, "max_new_tokens": 24, "stop_token_ids": [stop_tok]},
        {"temperature": 0.0, "max_new_tokens": 24, "stop": [f"w{ref[5]} w{ref[6]}"]},
    ]
    with radixserve.Engine(tiny, max_total_tokens=4096) as plain:
        want = [plain.generate(input_ids=PROMPTS[0], sampling_params=sp) for sp in cases]
    with _spec_engine(tiny, registry, "oracle") as eng:
        got = [eng.generate(input_ids=PROMPTS[0], sampling_params=sp) for sp in cases]
    for w, g, sp in zip(want, got, cases):
        assert g["output_ids"] == w["output_ids"], sp
        assert g["text"] == w["text"], sp
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"], sp
    assert len(got[0]["output_ids"]) == 7


def test_logit_bias_applies_to_verified_drafts(tiny, registry, plain_refs):
    """The oracle drafts the unbiased greedy continuation; verify must see the biased logits
    and reject the token a -100 bias forbids, exactly as plain decoding does."""
    OracleProposer.refs = {tuple(p): r for p, r in zip(PROMPTS, plain_refs)}
    ref = plain_refs[3]
    sp = {**GREEDY, "logit_bias": {str(ref[4]): -100, "7": 5.0}}
    with radixserve.Engine(tiny, max_total_tokens=4096) as plain:
        want = plain.generate(input_ids=PROMPTS[3], sampling_params=sp)["output_ids"]
    assert ref[4] not in want and want != ref
    with _spec_engine(tiny, registry, "oracle") as eng:
        got = eng.generate(input_ids=PROMPTS[3], sampling_params=sp)["output_ids"]
        assert eng.get_stats()["spec_num_draft_tokens"] > 0
    assert got == want


def test_a_failing_or_lying_proposer_costs_only_its_drafts(tiny, registry, plain_refs):
    for name in ("failing", "junk"):
        with _spec_engine(tiny, registry, name) as eng:
            outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outs] == plain_refs, name
            stats = eng.get_stats()
            assert stats["spec_num_proposer_errors"] > 0 and stats["num_aborted_reqs"] == 0, stats


def test_backend_without_verify_is_refused(tiny):
    reg = Registry()
    reg.load_entry_points()
    reg.add_plugin(_Plugin, name="spec-test", distribution="tests")
    from radixserve.layers.attention import AttentionBackend

    class NoVerify(AttentionBackend):
        def __init__(self, ctx):
            pass

        def init_forward_metadata(self, batch):
            pass

        def forward_extend(self, *a):
            raise AssertionError

        def forward_decode(self, *a):
            raise AssertionError

    class P:
        @staticmethod
        @hookimpl
        def register_attention_backends(register):
            register("noverify", NoVerify)

    reg.add_plugin(P, name="noverify", distribution="tests")
    with pytest.raises(ValueError, match="--attention-backend noverify.*target verify"):
        radixserve.Engine(tiny, registry=reg, attention_backend="noverify", speculative_algorithm="ngram",
                          max_total_tokens=1024)


def test_a_default_may_be_computed_from_the_target(tiny, registry, plain_refs):
    AlternatingProposer.refs = {tuple(p): r for p, r in zip(PROMPTS, plain_refs)}
    with _spec_engine(tiny, registry, "computed") as eng:
        seen = _width_from_target.seen  # the TargetModel view of the runner, not the runner
        assert isinstance(seen, TargetModel) and seen.kv_pool is eng.runner.kv_pool
        assert seen.device == eng.runner.device and seen.context_len == eng.runner.context_len
        assert eng.scheduler.spec.num_draft_tokens == 3
        assert eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"] == plain_refs[0]
    with _spec_engine(tiny, registry, "computed", speculative_num_draft_tokens=5) as eng:
        assert eng.scheduler.spec.num_draft_tokens == 5  # the flag wins


def test_ngram_default_verify_width_is_the_kernels_in_register_rows(tiny):
    from radixserve.kernels import cpu

    kernels = cpu.load()
    with radixserve.Engine(tiny, speculative_algorithm="ngram", max_total_tokens=1024) as eng:
        assert eng.scheduler.spec.num_draft_tokens == (kernels.gemv_max_rows if kernels else 8)
        assert eng.scheduler.spec.num_draft_tokens in (8, 16)


def test_unknown_method_names_the_flag(tiny):
    with pytest.raises(ValueError, match="--speculative-algorithm.*nope.*ngram"):
        radixserve.Engine(tiny, speculative_algorithm="NOPE", max_total_tokens=1024)


# ------------------------------------------------------------------ ngram through the suite
def test_ngram_greedy_parity(tiny):
    stats = sc.check_greedy_parity("NGRAM", tiny, PROMPTS, max_new_tokens=24, max_total_tokens=4096,
                                   constrained=(PROMPTS[0], {"max_new_tokens": 16, "regex": "(w5 |w6 |w7 )+w8"}))
    assert stats["spec_num_draft_tokens"] > 0


@pytest.fixture(scope="module")
def dist_prompt():
    return [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]


def test_ngram_sampling_matches_plain_sampling(tiny, dist_prompt):
    pvalues = sc.check_distribution("ngram", tiny, dist_prompt, num_samples=2000, positions=3,
                                    max_total_tokens=8192, max_running_requests=256)
    assert min(pvalues) > 0


def test_the_distribution_check_catches_a_broken_rule(tiny, dist_prompt, monkeypatch):
    """Accept every draft path the target's argmax agrees with, regardless of sampling:
    the suite must call that wrong."""
    def broken(parents, tokens, probs, generator):
        return accept_greedy(parents, tokens, probs.argmax(dim=-1).tolist())

    monkeypatch.setattr(spec_runtime, "accept_sampled", broken)
    with pytest.raises(AssertionError, match="differs from plain sampling"):
        sc.check_distribution("ngram", tiny, dist_prompt, num_samples=2000, positions=3,
                              params_list=({"temperature": 1.0},),
                              max_total_tokens=8192, max_running_requests=256)


def test_ngram_no_leaks_under_abort_and_retraction(tiny):
    sc.check_no_leaks("ngram", tiny, PROMPTS)


def test_ngram_with_grammar_in_the_batch(tiny, registry, plain_refs):
    """A constrained request drafts and verifies under its grammar's mask per tree node;
    its output matches plain constrained decoding, and its neighbours are untouched."""
    regex = "(w5 |w6 |w7 )+w8"
    sp_c = {"temperature": 0.0, "max_new_tokens": 16, "regex": regex}
    with radixserve.Engine(tiny, max_total_tokens=4096) as plain:
        want = plain.generate(input_ids=PROMPTS[0], sampling_params=sp_c)
    with _spec_engine(tiny, registry, "ngram") as eng:
        outs = eng.generate(input_ids=[PROMPTS[0]] + PROMPTS, sampling_params=[sp_c] + [GREEDY] * len(PROMPTS))
    assert outs[0]["output_ids"] == want["output_ids"]
    assert [o["output_ids"] for o in outs[1:]] == plain_refs


def test_random_trees_keep_greedy_parity(tiny, registry, plain_refs):
    """Random drafts with random shapes (mostly rejected, sometimes right) never change a
    greedy output."""
    rng = random.Random(0)

    class RandomTree(Proposer):
        def __init__(self, ctx):
            self.refs = {tuple(p): r for p, r in zip(PROMPTS, plain_refs)}

        def propose(self, reqs, max_tokens):
            out = []
            for req, k in zip(reqs, max_tokens):
                ref = self.refs[tuple(req.input_ids)]
                n = rng.randint(0, k)
                parents = [rng.randint(-1, i - 1) for i in range(n)]
                tokens = []
                for p in parents:
                    depth = 0
                    while p >= 0:
                        depth, p = depth + 1, parents[p]
                    pos = len(req.output_ids) + depth
                    right = ref[pos] if pos < len(ref) else 3
                    tokens.append(right if rng.random() < 0.5 else rng.randrange(3, 300))
                out.append(Draft(tokens, parents))
            return out

    class P:
        @staticmethod
        @hookimpl
        def register_speculative_algorithms(register):
            register("randomtree", RandomTree)

    registry.add_plugin(P, name="randomtree", distribution="tests")
    try:
        for page in (1, 4):
            with _spec_engine(tiny, registry, "randomtree", page_size=page, speculative_num_draft_tokens=8) as eng:
                outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
                assert [o["output_ids"] for o in outs] == plain_refs
                assert eng.get_stats()["spec_num_accepted_tokens"] > 0
    finally:
        registry.remove_plugin("randomtree")


def test_disable_by_batch_size_turns_speculation_off_above_it(tiny, registry, plain_refs):
    OracleProposer.refs = {tuple(p): r for p, r in zip(PROMPTS, plain_refs)}
    with _spec_engine(tiny, registry, "oracle", speculative_disable_by_batch_size=1) as eng:
        outs = eng.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY)  # two decode together
        assert [o["output_ids"] for o in outs] == plain_refs[:2]
        assert eng.get_stats()["spec_num_draft_tokens"] == 0
        eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)  # alone: it speculates
        assert eng.get_stats()["spec_num_draft_tokens"] > 0

"""The n-gram proposer alone: its index, its matching and every ``--speculative-ngram-*`` knob."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from radixserve.config import ConfigError, ServerArgs
from radixserve.speculative.tree import validate
from radixserve_speculative_ngram import NgramOptions, NgramProposer


def proposer(**knobs) -> NgramProposer:
    """A proposer with the options these flags give (checked as the engine checks them)."""
    args = ServerArgs.from_kwargs(**{f"speculative_ngram_{k}": v for k, v in knobs.items()})
    options = args.plugin_options and NgramOptions(**args.plugin_options)
    return NgramProposer(SimpleNamespace(options=options or None))


def req(ids, rid="r"):
    return SimpleNamespace(rid=rid, all_ids=list(ids))


def draft(p, ids, k=7, rid="r"):
    (d,) = p.propose([req(ids, rid)], [k])
    return d


def test_copies_what_followed_the_suffix_before():
    d = draft(proposer(), [1, 2, 3, 4, 5, 9, 1, 2, 3], k=3)
    assert d.tokens == [4, 5, 9] and d.parents == [-1, 0, 1]
    assert draft(proposer(), [1, 2, 3, 4], rid="x") is None  # nothing repeats


def test_one_token_matches_draft_only_when_the_min_window_allows():
    ids = [1, 2, 3, 9, 4, 3]  # only the last token, 3, occurred before (followed by 9)
    assert draft(proposer(min_match_window_size=2), ids) is None
    assert draft(proposer(), ids, rid="one").tokens == [9]  # the default shortest window is one token


def test_draft_length_grows_with_the_match_length():
    # "5 6 7 8 9 10 11 12" repeats; the suffix matched before the draft is 1, 2 or 3 tokens long
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    for n, tail in ((1, [50, 5]), (2, [51, 5, 6]), (3, [52, 5, 6, 7])):
        ids = text + tail
        d = draft(proposer(), ids, k=15, rid=f"r{n}")
        assert len(d.tokens) == 2 * n - 1, (n, d.tokens)  # the default ratio, 2
        assert d.tokens == text[n:3 * n - 1] and d.parents == list(range(-1, 2 * n - 2))
        assert len(draft(proposer(draft_ratio=3), ids, k=15, rid=f"t{n}").tokens) == 3 * n - 1
        # 0: only the verify width bounds it (here the whole continuation up to the end of ids)
        assert len(draft(proposer(draft_ratio=0), ids, k=15, rid=f"z{n}").tokens) == len(ids) - n
        assert len(draft(proposer(), ids, k=2, rid=f"k{n}").tokens) == min(2, 2 * n - 1)
    assert draft(proposer(draft_ratio=1), text + [50, 5], rid="none") is None  # 1 * 1 - 1 = 0 tokens


def test_longest_window_wins_and_min_window_is_honoured():
    ids = [7, 2, 3, 50, 8, 2, 3, 60, 7, 2, 3]  # "2 3" -> 50 or 60; "7 2 3" -> 50 only
    assert draft(proposer(min_match_window_size=2), ids, k=1).tokens == [50]
    assert draft(proposer(min_match_window_size=2, max_match_window_size=2), ids, k=1, rid="b").tokens[0] in (50, 60)
    assert draft(proposer(min_match_window_size=4, max_match_window_size=4), ids, k=1, rid="c") is None


def test_bfs_breadth_and_branch_length():
    # "1" was followed by 10, 20, 30 and 40: the first level holds at most max_bfs_breadth
    ids = [1, 10, 11, 1, 20, 21, 1, 30, 31, 1, 40, 41, 1]
    wide = draft(proposer(min_match_window_size=1, max_match_window_size=1, draft_ratio=0, max_bfs_breadth=4), ids, k=8)
    first = [t for t, p in zip(wide.tokens, wide.parents) if p == -1]
    assert sorted(first) == [10, 20, 30, 40]
    narrow = draft(proposer(min_match_window_size=1, max_match_window_size=1, draft_ratio=0, max_bfs_breadth=2,
                            min_bfs_breadth=1), ids, k=8, rid="n")
    assert len([p for p in narrow.parents if p == -1]) == 2
    short = draft(proposer(min_match_window_size=1, max_match_window_size=1, draft_ratio=0, max_bfs_breadth=1,
                           branch_length=1), ids, k=8, rid="s")
    assert len(short.tokens) == 1  # continuations are one token long
    validate(wide, 100, 8)


def test_prob_takes_the_most_frequent_continuations_first():
    ids = [1, 5, 1, 5, 1, 5, 1, 6, 1]  # after "1": 5 three times, 6 once
    d = draft(proposer(min_match_window_size=1, max_match_window_size=1, draft_ratio=0, match_type="PROB"), ids, k=1)
    assert d.tokens == [5]
    both = draft(proposer(min_match_window_size=1, max_match_window_size=1, draft_ratio=0, match_type="PROB"),
                 ids, k=8, rid="b")
    assert both.tokens.index(5) < both.tokens.index(6)


def test_capacity_bounds_the_index_and_release_drops_it():
    p = proposer(capacity=5)
    draft(p, list(range(50)) + [0, 1])
    assert p._index["r"].size == 5
    p.release(req([], "r"))
    assert "r" not in p._index


@pytest.mark.parametrize("knobs,match", [
    ({"draft_ratio": -1}, "--speculative-ngram-draft-ratio must be >= 0, got -1"),
    ({"draft_ratio": 1.5}, "--speculative-ngram-draft-ratio must be an integer"),
    ({"min_match_window_size": 0}, "--speculative-ngram-min-match-window-size must be >= 1"),
    ({"min_match_window_size": 5, "max_match_window_size": 4},
     "must not exceed --speculative-ngram-max-match-window-size"),
])
def test_bad_knobs_are_refused_naming_the_flag(knobs, match):
    with pytest.raises(ConfigError, match=match):
        proposer(**knobs)

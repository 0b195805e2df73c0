"""Routing policies and the approximate prefix tree, without servers."""

from __future__ import annotations

import random

import pytest
from radixserve.config import ConfigError
from radixserve_server.router.dp import DataParallelClient, combine_stats, replica_gpus
from radixserve_server.router.policy import (
    CacheAware,
    PolicyArgs,
    RoundRobin,
    ShortestQueue,
    make_policy,
)
from radixserve_server.router.tree import PrefixTree, common_prefix_len, ids_key


def test_common_prefix_len():
    assert common_prefix_len("abcdef", "abcxef") == 3
    assert common_prefix_len("abc", "abcdef") == 3
    assert common_prefix_len("", "abc") == 0
    assert common_prefix_len("xbc", "abc") == 0
    rng = random.Random(0)
    for _ in range(200):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(30)))
        b = "".join(rng.choice("ab") for _ in range(rng.randrange(30)))
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix_len(a, b) == n


def test_tree_insert_and_match_split_edges():
    t = PrefixTree()
    t.insert("hello world")
    assert t.match("hello world") == 11
    assert t.match("hello there") == 6  # a partial edge counts
    assert t.match("goodbye") == 0
    t.insert("hello there")  # splits the edge at "hello "
    assert t.size == len("hello world") + len("there")
    assert t.num_nodes == 3
    assert t.match("hello there!") == 11 and t.match("hello world") == 11
    t.insert("hello")  # a key ending inside an edge adds nothing
    assert t.size == 16 and t.match("hello") == 5


def test_tree_matches_a_brute_force_reference():
    rng = random.Random(1)
    t = PrefixTree()
    keys: list[str] = []
    for _ in range(300):
        key = "".join(rng.choice("abc") for _ in range(rng.randrange(1, 12)))
        t.insert(key)
        keys.append(key)
        probe = "".join(rng.choice("abc") for _ in range(rng.randrange(12)))
        expect = max(common_prefix_len(k, probe) for k in keys)
        assert t.match(probe) == expect
    assert t.size == sum(len(n.key) for n in _nodes(t))


def _nodes(t: PrefixTree):
    stack = list(t.root.children.values())
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        yield n


def test_tree_prunes_least_recently_used_leaves_to_its_bound():
    t = PrefixTree(max_size=30)
    t.insert("a" * 10)  # oldest
    t.insert("b" * 10)
    t.insert("c" * 10)
    assert t.size == 30 and t.match("a" * 10) == 10  # match does not refresh
    t.insert("b" * 10)  # refreshed
    t.insert("d" * 5)  # over the bound: prune to 27 -> drop the least recently used leaf, "a..."
    assert t.size <= 30
    assert t.match("a" * 10) == 0
    assert t.match("b" * 10) == 10 and t.match("d" * 5) == 5
    # a shared prefix survives while a recently used branch below it does
    t2 = PrefixTree(max_size=100)
    t2.insert("system-prompt:" + "x" * 20)
    t2.insert("system-prompt:" + "y" * 20)
    assert t2.prune(t2.size - 1) == 20  # one leaf goes, the older "x" branch
    assert t2.match("system-prompt:" + "y" * 20) == 34 and t2.match("system-prompt:" + "x" * 20) == 14
    t2.prune(0)
    assert t2.size == 0 and t2.num_nodes == 0 and t2.match("system") == 0


def test_ids_key_is_one_char_per_id():
    key = ids_key([1, 2, 150000])
    assert len(key) == 3 and ord(key[2]) == 150000


def test_round_robin_and_shortest_queue():
    rr = RoundRobin()
    assert [rr.select(["a", "b", "c"], [0, 0, 0], "") for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    sq = ShortestQueue()
    assert sq.select(["a", "b"], [3, 1], "") == 1
    assert [sq.select(["a", "b"], [0, 0], "") for _ in range(4)] == [0, 0, 1, 0]  # ties: the less chosen (b had 1)


def test_cache_aware_sticks_to_the_worker_holding_the_prefix():
    p = CacheAware(PolicyArgs())
    ids, loads = ["w0", "w1"], [0, 0]
    sys_a, sys_b = "You are a pirate. " * 20, "You are a lawyer. " * 20
    first = p.select(ids, loads, sys_a + "question 1")
    other = p.select(ids, loads, sys_b + "question 1")
    assert other != first  # no match: the smaller tree (the empty worker) gets it
    for q in range(2, 6):
        assert p.select(ids, loads, sys_a + f"question {q}") == first
        assert p.select(ids, loads, sys_b + f"question {q}") == other
    assert p.worker_stats("w0")["tree_size"] > 0


def test_cache_aware_threshold_is_strictly_more_than():
    p = CacheAware(PolicyArgs(cache_threshold=0.5))
    ids = ["w0", "w1"]
    assert p.select(ids, [0, 0], "aaaa") == 0  # both trees empty: the first
    assert p.select(ids, [0, 0], "zzzzzzzzzz") == 1  # no match: the smaller tree
    assert p.select(ids, [0, 0], "aaaacccccccccccc") == 0  # 4/16 matched: the smaller tree, w0 (4 < 10)
    assert p.trees["w0"].size == 16 and p.trees["w1"].size == 10
    assert p.select(ids, [0, 0], "aaaabbbb") == 1  # 4/8 on w0 is not more than 0.5: the smaller tree
    assert p.select(ids, [0, 0], "aaaacccccx") == 0  # 9/10 on w0: the worker holding the prefix


def test_cache_aware_load_overrides_the_cache_when_imbalanced():
    p = CacheAware(PolicyArgs(balance_abs_threshold=32, balance_rel_threshold=1.0001))
    ids = ["w0", "w1"]
    key = "shared system prompt " * 10
    assert p.select(ids, [0, 0], key) == 0
    assert p.select(ids, [32, 0], key) == 0  # a gap of 32 is not above 32: the cache wins
    assert p.select(ids, [33, 0], key) == 1  # imbalanced: the least loaded
    assert p.trees["w1"].match(key) == len(key)  # ... which now records the prefix too
    # the relative threshold: max must exceed rel x min as well
    q = CacheAware(PolicyArgs(balance_abs_threshold=2, balance_rel_threshold=2.0))
    q.select(ids, [0, 0], key)
    assert q.select(ids, [10, 6], key) == 0  # 10 - 6 > 2 but 10 <= 2 x 6: balanced
    assert q.select(ids, [13, 6], key) == 1


def test_cache_aware_forgets_a_removed_worker():
    p = CacheAware(PolicyArgs())
    p.select(["w0", "w1"], [0, 0], "abc" * 50)
    p.remove_worker("w0")
    assert p.worker_stats("w0")["tree_size"] == 0
    assert p.select(["w1"], [0], "abc" * 50) == 0


def test_policy_args_are_checked():
    with pytest.raises(ConfigError, match="--cache-threshold"):
        PolicyArgs(cache_threshold=1.5)
    with pytest.raises(ConfigError, match="--policy"):
        PolicyArgs(policy="fastest")
    with pytest.raises(ConfigError, match="--balance-rel-threshold"):
        PolicyArgs(balance_rel_threshold=0.5)
    for name in ("cache_aware", "round_robin", "shortest_queue", "random"):
        assert make_policy(PolicyArgs(policy=name), seed=0).name == name


def test_combined_stats_sum_counts_and_recompute_ratios():
    a = {"num_running_reqs": 1, "max_total_num_tokens": 100, "num_used_tokens": 50, "token_usage": 0.5,
         "num_prompt_tokens": 10, "num_cached_prompt_tokens": 10, "cache_hit_rate": 1.0,
         "new_token_ratio": 0.4, "moe_expert_tokens": {"1": [1]}}
    b = dict(a, num_running_reqs=2, num_used_tokens=0, token_usage=0.0, num_prompt_tokens=30,
             num_cached_prompt_tokens=0, cache_hit_rate=0.0, new_token_ratio=0.6)
    s = combine_stats([a, b])
    assert s["num_running_reqs"] == 3 and s["max_total_num_tokens"] == 200
    assert s["token_usage"] == 0.25 and s["cache_hit_rate"] == 0.25
    assert s["new_token_ratio"] == pytest.approx(0.5)
    assert s["moe_expert_tokens"] == {"1": [1]}


def test_replicas_get_their_own_gpus_or_share_only_when_told():
    assert replica_gpus(2, 1, ["0", "1"], shared_ok=False) == [["0"], ["1"]]
    assert replica_gpus(2, 2, ["4", "5", "6", "7"], shared_ok=False) == [["4", "5"], ["6", "7"]]
    with pytest.raises(ConfigError, match="needs 2 GPUs, 1 visible.*--mem-fraction-static"):
        replica_gpus(2, 1, ["0"], shared_ok=False)
    assert replica_gpus(3, 1, ["0", "1"], shared_ok=True) == [["0"], ["1"], ["0"]]


def test_dp_refuses_multi_node_replicas():
    with pytest.raises(ConfigError, match="radixserve router"):
        DataParallelClient({"device": "cpu", "nnodes": 2}, 2)
    with pytest.raises(ConfigError, match="--dist-init-addr"):
        DataParallelClient({"device": "cpu", "dist_init_addr": "127.0.0.1:5000"}, 2)

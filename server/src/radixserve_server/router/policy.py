"""Routing policies: which worker (an engine replica or a server) gets a request.

A policy sees the workers that can take requests now, as ids with their current loads
(requests in flight there), and the request's routing key (see :mod:`.tree`); it answers
an index into that list. It is called on the event loop, once per request.

``cache_aware`` follows SGLang's router:

1. The load is *imbalanced* when ``max - min > balance_abs_threshold`` and
   ``max > balance_rel_threshold * min`` over the workers' loads; then the least loaded
   worker gets the request (the prefix is still recorded in its tree).
2. Otherwise the worker whose tree holds the longest prefix of the key gets it when that
   prefix is more than ``cache_threshold`` of the key (matched / key length).
3. Otherwise the worker with the smallest tree (the most room for a new prefix) gets it,
   the less loaded one on a tie.

The chosen worker's tree then records the key.
"""

from __future__ import annotations

import argparse
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.config import ConfigError

from radixserve_server.router.tree import PrefixTree

POLICIES = ("cache_aware", "round_robin", "shortest_queue", "random")


@dataclass
class PolicyArgs:
    """The policy flags, shared by ``radixserve serve --dp-size`` and ``radixserve router``."""

    policy: str = "cache_aware"
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    max_tree_size: int = 2**24

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy: invalid value {self.policy!r}; choose from: {', '.join(POLICIES)}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ConfigError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ConfigError(f"--balance-abs-threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            raise ConfigError(f"--balance-rel-threshold must be >= 1, got {self.balance_rel_threshold}")
        if self.max_tree_size < 1:
            raise ConfigError(f"--max-tree-size must be >= 1, got {self.max_tree_size}")


def add_policy_arguments(parser: argparse.ArgumentParser, *flags: str) -> None:
    """The policy flags; ``flags`` names the policy choice (``--policy``, or
    ``--load-balance-method`` first for ``serve``, SGLang's name there)."""
    group = parser.add_argument_group("routing")
    group.add_argument(*(flags or ("--policy",)), dest="policy", default="cache_aware", choices=POLICIES,
                       help="how requests are spread over the workers (default: cache_aware)")
    group.add_argument("--cache-threshold", type=float, default=0.5,
                       help="cache_aware: send a request to the worker holding its longest prefix when that "
                            "prefix is more than this fraction of it (default: 0.5)")
    group.add_argument("--balance-abs-threshold", type=int, default=32,
                       help="cache_aware: the load is imbalanced (and the least loaded worker is chosen) when "
                            "max - min load exceeds this and max > --balance-rel-threshold x min (default: 32)")
    group.add_argument("--balance-rel-threshold", type=float, default=1.0001,
                       help="cache_aware: see --balance-abs-threshold (default: 1.0001)")
    group.add_argument("--max-tree-size", type=int, default=2**24,
                       help="cache_aware: most characters (or token ids) remembered per worker; the least "
                            "recently used prefixes are dropped beyond it (default: 2^24)")


def policy_args_from(ns: argparse.Namespace) -> PolicyArgs:
    return PolicyArgs(policy=ns.policy, cache_threshold=ns.cache_threshold,
                      balance_abs_threshold=ns.balance_abs_threshold,
                      balance_rel_threshold=ns.balance_rel_threshold, max_tree_size=ns.max_tree_size)


class RoutingPolicy(ABC):
    """Chooses a worker per request. ``ids`` and ``loads`` are parallel and non-empty."""

    name: str

    @abstractmethod
    def select(self, ids: Sequence[str], loads: Sequence[int], key: str) -> int:
        """The index (into ``ids``) of the worker that gets this request."""

    def remove_worker(self, wid: str) -> None:
        """Forget what the policy knows of ``wid`` (it died, or its cache was flushed)."""
        return None

    def worker_stats(self, wid: str) -> dict[str, int]:
        """Numbers to show per worker in /metrics and server info."""
        return {}


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, ids, loads, key):
        i = self._next % len(ids)
        self._next += 1
        return i


class Random(RoutingPolicy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, ids, loads, key):
        return self._rng.randrange(len(ids))


class ShortestQueue(RoutingPolicy):
    """The least loaded worker; ties go to the worker that was chosen least often."""

    name = "shortest_queue"

    def __init__(self) -> None:
        self._chosen: dict[str, int] = {}

    def select(self, ids, loads, key):
        i = min(range(len(ids)), key=lambda k: (loads[k], self._chosen.get(ids[k], 0)))
        self._chosen[ids[i]] = self._chosen.get(ids[i], 0) + 1
        return i

    def remove_worker(self, wid):
        self._chosen.pop(wid, None)


class CacheAware(RoutingPolicy):
    """SGLang's cache-aware policy (see the module docstring), one :class:`PrefixTree` per worker."""

    name = "cache_aware"

    def __init__(self, args: PolicyArgs) -> None:
        self.args = args
        self.trees: dict[str, PrefixTree] = {}

    def tree(self, wid: str) -> PrefixTree:
        t = self.trees.get(wid)
        if t is None:
            t = self.trees[wid] = PrefixTree(self.args.max_tree_size)
        return t

    def is_imbalanced(self, loads: Sequence[int]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.args.balance_abs_threshold and hi > self.args.balance_rel_threshold * lo

    def select(self, ids, loads, key):
        n = len(ids)
        if self.is_imbalanced(loads):
            i = min(range(n), key=lambda k: loads[k])
        else:
            matched = [self.tree(w).match(key) for w in ids]
            best = max(range(n), key=lambda k: (matched[k], -loads[k]))
            if key and matched[best] / len(key) > self.args.cache_threshold:
                i = best
            else:
                i = min(range(n), key=lambda k: (self.tree(ids[k]).size, loads[k]))
        self.tree(ids[i]).insert(key)
        return i

    def remove_worker(self, wid):
        self.trees.pop(wid, None)

    def worker_stats(self, wid):
        t = self.trees.get(wid)
        return {"tree_size": t.size if t else 0, "tree_nodes": t.num_nodes if t else 0}


def make_policy(args: PolicyArgs, seed: int | None = None) -> RoutingPolicy:
    if args.policy == "cache_aware":
        return CacheAware(args)
    if args.policy == "round_robin":
        return RoundRobin()
    if args.policy == "shortest_queue":
        return ShortestQueue()
    return Random(seed)

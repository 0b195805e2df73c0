"""An approximate radix tree of what was sent to one worker, for cache-aware routing.

The router cannot see a worker's KV cache; it remembers instead which prompts it sent
there. Keys are strings: the request text (the standalone router), or token ids mapped
one per character with :func:`ids_key` (``--dp-size``, which routes on token ids), so one
compact, C-compared type serves both.

Invariants:

- Edges hold non-empty slices of inserted keys; a node's children differ in their first
  character (the dict key).
- ``size`` is the number of characters on all edges (what ``max_size`` bounds).
- ``last_used`` of a node is at least that of each of its descendants: an insert stamps
  every node on its path, so a leaf is always the least recently used node of its branch
  and pruning leaves in ``last_used`` order is LRU.
- After an insert, ``size <= max_size``: going over it prunes the least recently used
  leaves down to ``max_size - max_size // 10`` (a margin, so pruning is not paid on every
  insert once full).
"""

from __future__ import annotations

import heapq
import itertools


def ids_key(ids) -> str:
    """Token ids as a key: one character per id (ids are below 0x110000)."""
    return "".join(map(chr, ids))


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (slice compares, in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _Node:
    __slots__ = ("key", "children", "parent", "last_used")

    def __init__(self, key: str, parent: _Node | None, last_used: int) -> None:
        self.key = key
        self.children: dict[str, _Node] = {}
        self.parent = parent
        self.last_used = last_used


class PrefixTree:
    """Prefixes sent to one worker, bounded by ``max_size`` characters, LRU-pruned."""

    def __init__(self, max_size: int = 2**24) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self.max_size = max_size
        self._clock = itertools.count(1)
        self.clear()

    def clear(self) -> None:
        self.root = _Node("", None, 0)
        self.size = 0
        self.num_nodes = 0

    def match(self, key: str) -> int:
        """How many leading characters of ``key`` the tree holds (no LRU stamp: only what is
        sent to this worker counts as used)."""
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            c = common_prefix_len(child.key, key[i:i + len(child.key)])
            i += c
            if c < len(child.key):
                break
            node = child
        return i

    def insert(self, key: str) -> None:
        """Remember ``key`` as sent now (stamping its whole path), then prune to the bound."""
        now = next(self._clock)
        node, i = self.root, 0
        node.last_used = now
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = _Node(key[i:], node, now)
                node.children[key[i]] = leaf
                self.size += len(leaf.key)
                self.num_nodes += 1
                break
            c = common_prefix_len(child.key, key[i:i + len(child.key)])
            if c < len(child.key):  # split the edge: node -> mid (the shared part) -> child
                mid = _Node(child.key[:c], node, child.last_used)
                child.key = child.key[c:]
                child.parent = mid
                mid.children[child.key[0]] = child
                node.children[mid.key[0]] = mid
                self.num_nodes += 1
                child = mid
            child.last_used = now
            node = child
            i += c
        if self.size > self.max_size:
            self.prune(self.max_size - self.max_size // 10)

    def prune(self, target: int) -> int:
        """Drop least recently used leaves until ``size <= target``; returns the characters dropped."""
        before = self.size
        heap = [(n.last_used, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        while self.size > target and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.size -= len(leaf.key)
            self.num_nodes -= 1
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return before - self.size

    def _leaves(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                yield n

"""radixserve speculative method ``ngram``: drafts from earlier text of the same request.

Text that repeats itself (code being edited, a document quoted back, a JSON structure,
a list) is cheap to predict: if the last few tokens occurred before in the prompt or the
output, what followed them then is a good guess for what follows now. Per request an
index maps every n-gram of ``--speculative-ngram-min-match-window-size`` to
``--speculative-ngram-max-match-window-size`` tokens to the positions right after its
occurrences, kept up to date incrementally as tokens arrive (no model, no GPU).

To propose, the longest window whose suffix occurred before wins; the continuations after
its most recent occurrences (up to ``--speculative-ngram-branch-length`` tokens each) are
merged into a trie, and the draft tree is taken from that trie breadth first:

* ``BFS``: the first level keeps up to ``--speculative-ngram-max-bfs-breadth`` children
  and the breadth shrinks level by level down to ``--speculative-ngram-min-bfs-breadth``;
* ``PROB``: the nodes with the highest frequency along their path, best first;

either way at most ``num_draft_tokens - 1`` tokens, and after a match of ``n`` tokens at most
``--speculative-ngram-draft-ratio * n - 1`` (a one-token match drafts one token, a two-token
match three, ...: a short match says little about how far the text repeats, and every draft
token is a row of the verify forward). ``--speculative-ngram-capacity`` bounds the index size
of one request.

The default verify width is the most rows the CPU's quantized linear kernels take in
registers (16 with AVX-512, else 8): past it a row costs several times more.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.plugin_api import ConfigError, hookimpl, option
from radixserve.plugin_api.speculative import Draft, Proposer, SpeculativeContext

MAX_OCCURRENCES = 8  # most recent occurrences of the matched suffix merged into the trie


@dataclass
class _Index:
    """One request's n-gram index over its token list."""

    ids: list[int] = field(default_factory=list)
    # n-gram (tuple) -> positions right after its occurrences, most recent last
    after: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    size: int = 0

    def extend(self, ids: Sequence[int], lo: int, hi: int, capacity: int) -> None:
        start = len(self.ids)
        self.ids.extend(ids[start:])
        for end in range(max(start, 1), len(self.ids)):
            # every n-gram ending at position end - 1 is followed by position end
            for n in range(lo, min(hi, end) + 1):
                if self.size >= capacity:
                    return
                key = tuple(self.ids[end - n:end])
                self.after.setdefault(key, []).append(end)
                self.size += 1


@dataclass
class _TrieNode:
    token: int
    count: int = 0
    kids: dict[int, _TrieNode] = field(default_factory=dict)


@dataclass
class NgramOptions:
    """The ``--speculative-ngram-*`` flags (SGLang's names)."""

    speculative_ngram_min_match_window_size: int = option(1, "NGRAM: shortest suffix matched against earlier "
                                                          "text", minimum=1)
    speculative_ngram_max_match_window_size: int = option(12, "NGRAM: longest suffix matched against earlier "
                                                          "text", minimum=1)
    speculative_ngram_min_bfs_breadth: int = option(1, "NGRAM (BFS): fewest branches per tree level", minimum=1)
    speculative_ngram_max_bfs_breadth: int = option(10, "NGRAM (BFS): most branches per tree level", minimum=1)
    speculative_ngram_match_type: str = option("BFS", "NGRAM: BFS (breadth shrinking with depth) or PROB (most "
                                               "frequent continuations)", choices=("BFS", "PROB"))
    speculative_ngram_branch_length: int = option(18, "NGRAM: most tokens of a continuation kept in the index",
                                                  minimum=1)
    speculative_ngram_capacity: int = option(10_000_000, "NGRAM: most index nodes per request", minimum=1)
    speculative_ngram_draft_ratio: int = option(2, "NGRAM: a draft after a match of n tokens holds at most "
                                                "ratio * n - 1 tokens (the longer the matched suffix, the further "
                                                "its continuation is trusted); 0: no cap", minimum=0)

    def validate(self) -> None:
        for lo, hi in (("min_match_window_size", "max_match_window_size"), ("min_bfs_breadth", "max_bfs_breadth")):
            if getattr(self, f"speculative_ngram_{lo}") > getattr(self, f"speculative_ngram_{hi}"):
                raise ConfigError(f"--speculative-ngram-{lo.replace('_', '-')} must not exceed "
                                  f"--speculative-ngram-{hi.replace('_', '-')}")


class NgramProposer(Proposer):
    def __init__(self, ctx: SpeculativeContext) -> None:
        a = ctx.options if ctx.options is not None else NgramOptions()
        self.lo = a.speculative_ngram_min_match_window_size
        self.hi = a.speculative_ngram_max_match_window_size
        self.min_breadth = a.speculative_ngram_min_bfs_breadth
        self.max_breadth = a.speculative_ngram_max_bfs_breadth
        self.match_type = a.speculative_ngram_match_type
        self.branch_length = a.speculative_ngram_branch_length
        self.capacity = a.speculative_ngram_capacity
        self.draft_ratio = a.speculative_ngram_draft_ratio
        self._index: dict[str, _Index] = {}
        self.num_matched = 0
        self.num_proposed = 0

    def release(self, req) -> None:
        self._index.pop(req.rid, None)

    def propose(self, reqs, max_tokens):
        out: list[Draft | None] = []
        for req, k in zip(reqs, max_tokens):
            self.num_proposed += 1
            index = self._index.get(req.rid)
            ids = req.all_ids
            if index is None or index.ids != ids[:len(index.ids)]:  # new, or resumed differently
                index = self._index[req.rid] = _Index()
            index.extend(ids, self.lo, self.hi, self.capacity)
            draft = self._draft(index, k)
            if draft is not None:
                self.num_matched += 1
            out.append(draft)
        return out

    def _draft(self, index: _Index, k: int) -> Draft | None:
        ids = index.ids
        n_ids = len(ids)
        for n in range(min(self.hi, n_ids), self.lo - 1, -1):
            starts = index.after.get(tuple(ids[n_ids - n:]))
            if not starts:
                continue
            starts = [p for p in starts if p < n_ids][-MAX_OCCURRENCES:]
            if not starts:
                continue
            root = _TrieNode(-1)
            for p in reversed(starts):  # most recent first: ties keep its order
                node = root
                for tok in ids[p:p + self.branch_length]:
                    node = node.kids.setdefault(tok, _TrieNode(tok))
                    node.count += 1
            if self.draft_ratio:
                k = min(k, self.draft_ratio * n - 1)
            return self._select(root, k) if k > 0 else None
        return None

    def _select(self, root: _TrieNode, k: int) -> Draft | None:
        tokens: list[int] = []
        parents: list[int] = []
        if self.match_type == "PROB":
            heap = [(-c.count, i, c, -1) for i, c in enumerate(root.kids.values())]
            heapq.heapify(heap)
            seq = len(heap)
            while heap and len(tokens) < k:
                _, _, node, parent = heapq.heappop(heap)
                tokens.append(node.token)
                parents.append(parent)
                me = len(tokens) - 1
                for c in node.kids.values():
                    seq += 1
                    heapq.heappush(heap, (-c.count, seq, c, me))
        else:  # BFS with the breadth shrinking per level
            level = [(root, -1)]
            breadth = self.max_breadth
            while level and len(tokens) < k:
                nxt = []
                for node, idx in level:
                    for c in sorted(node.kids.values(), key=lambda c: -c.count):
                        nxt.append((c, idx))
                nxt = nxt[:breadth]
                level = []
                for c, parent in nxt:
                    if len(tokens) >= k:
                        break
                    tokens.append(c.token)
                    parents.append(parent)
                    level.append((c, len(tokens) - 1))
                breadth = max(self.min_breadth, breadth // 2)
        if not tokens:
            return None
        return Draft(tokens, parents)

    def stats(self):
        return {"ngram_match_rate": self.num_matched / self.num_proposed if self.num_proposed else 0.0}


def default_num_draft_tokens(target) -> int:
    """Verify width: the most rows the target's CPU kernels take in registers (16 with
    AVX-512, else 8; 8 on other devices)."""
    if target.device.type != "cpu":
        return 8
    from radixserve.plugin_api.kernels import cpu_kernels as cpu

    kernels = cpu.load()
    return kernels.gemv_max_rows if kernels is not None else 8


@hookimpl
def register_speculative_algorithms(register):
    register("ngram", NgramProposer, options=NgramOptions,
             description="drafts copied from earlier text of the same request (suffix index); no model",
             # measured over the default model's GGUF blocks (BENCHMARKS.md, "NGRAM drafts sized by
             # match length"): with drafts of at most 2n - 1 tokens after an n-token match, 16
             # verify tokens beat 8 on AVX-512 and 8 beat 16 on AVX2; from batch 2 speculation loses
             defaults={"speculative_num_draft_tokens": default_num_draft_tokens,
                       "speculative_disable_by_batch_size": 1})

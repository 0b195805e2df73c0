"""Lossless acceptance of a draft tree against the target model's distributions.

The verify forward gives one row of target logits per tree node (node 0 the root, the
request's last token). Rows are processed exactly as plain decoding would process the
next-token logits at that node: penalties and ``min_new_tokens`` over the history *along
the node's path*, the grammar's mask at the node, then temperature and top-k/top-p/min-p.
Walking from the root:

* greedy: the child whose token is the row's argmax is accepted and the walk goes on; when
  no child matches, the argmax is the bonus token. The output is exactly plain greedy
  decoding's.
* sampling (tree rejection sampling with deterministic candidates): the children of the
  current node are tried in order; child ``x`` is accepted with probability ``p(x)`` under
  the current distribution ``p``, and on rejection ``p`` becomes ``p`` with ``x`` removed,
  renormalised. When every child is rejected the bonus token is drawn from what is left.
  Each emitted token is therefore distributed exactly as ``p``: the method is lossless
  whatever the drafts are and however they were chosen (they only have to be fixed before
  the draws, which they are).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.speculative.tree import children


@dataclass
class Acceptance:
    """One request's outcome: the accepted draft nodes (root excluded, in path order) and the
    tokens it emits, which are the accepted nodes' tokens followed by the bonus token.
    ``rows[k]`` is the node whose distribution produced ``tokens[k]`` (for logprobs)."""

    nodes: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)


def accept_greedy(node_parents: list[int], node_tokens: list[int], argmax: list[int]) -> Acceptance:
    """``argmax[n]``: the target's choice at node ``n`` (after penalties and masks)."""
    kids = children(node_parents)
    out = Acceptance()
    node = 0
    while True:
        want = argmax[node]
        out.rows.append(node)
        out.tokens.append(want)
        nxt = next((c for c in kids[node] if node_tokens[c] == want), None)
        if nxt is None:
            return out
        out.nodes.append(nxt)
        node = nxt


def accept_sampled(node_parents: list[int], node_tokens: list[int], probs: torch.Tensor,
                   generator: torch.Generator | None) -> Acceptance:
    """``probs  # [N, V]``: the target's sampling distribution at every node."""
    kids = children(node_parents)
    out = Acceptance()
    node = 0
    while True:
        p = probs[node]
        out.rows.append(node)
        accepted = None
        residual = None
        for c in kids[node]:
            x = node_tokens[c]
            q = p if residual is None else residual
            px = float(q[x])
            if px > 0.0 and float(torch.rand((), generator=generator, device=q.device)) < px:
                accepted = c
                break
            if px > 0.0:  # remove x and renormalise what is left
                residual = q.clone()
                residual[x] = 0.0
                total = residual.sum()
                if float(total) <= 0.0:  # x held all the mass (a rounding corner)
                    residual = None
                    accepted = c
                    break
                residual /= total
        if accepted is None:
            q = p if residual is None else residual
            out.tokens.append(int(torch.multinomial(q, 1, generator=generator)))
            return out
        out.tokens.append(node_tokens[accepted])
        out.nodes.append(accepted)
        node = accepted

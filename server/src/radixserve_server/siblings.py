"""The sequences of one prompt (``n > 1``) sharing what only one of them computes.

With prompt logprobs asked for, :meth:`~radixserve_server.generation.Generator.expand` lets
the first sequence compute them and the others ask for none (so their prompt comes from the
prefix cache); :func:`share_prompt_logprobs` hands the first one's to the others.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve_server.generation import Delta, SeqSpec


async def share_prompt_logprobs(deltas: AsyncIterator[Delta], specs: list[SeqSpec]) -> AsyncIterator[Delta]:
    """``deltas`` with each sequence that reports a sibling's prompt logprobs
    (``prompt_logprobs_from``) given them on its first delta; its deltas are held back until
    the sibling's prompt logprobs have arrived."""
    index = {id(s): i for i, s in enumerate(specs)}
    source = {i: index[id(s.prompt_logprobs_from)] for i, s in enumerate(specs) if s.prompt_logprobs_from}
    if not source:
        async for d in deltas:
            yield d
        return
    known: dict[int, Delta] = {}  # source index -> its delta with the prompt logprobs
    held: dict[int, list[Delta]] = {}  # sequence index -> deltas waiting for its source's
    given: set[int] = set()

    def release(d: Delta) -> Delta:
        if d.index not in given:
            given.add(d.index)
            src = known[source[d.index]]
            d.input_token_logprobs, d.input_top_logprobs = src.input_token_logprobs, src.input_top_logprobs
        return d

    async for d in deltas:
        if d.index in source:
            if source[d.index] in known:
                yield release(d)
            else:
                held.setdefault(d.index, []).append(d)
            continue
        if d.input_token_logprobs is not None:
            known[d.index] = d
        yield d
        for j in [j for j in held if source[j] in known]:
            for h in held.pop(j):
                yield release(h)
    for waiting in held.values():  # the source ended without prompt logprobs
        for h in waiting:
            yield h

"""SGLang's ``return_hidden_states``: a request's final (normed) hidden states, in SGLang's
layout. ``req.hidden_states[0]`` holds the prompt's rows (``[prompt_len, hidden]``, filled
chunk by chunk); entry ``k >= 1`` is the row of the step that produced output token ``k``
(position ``prompt_len + k - 1``), so a finished request has one entry per output token.
A position computed again (a retracted request resumed) is not captured twice.
"""

from __future__ import annotations

from radixserve.layers.attention import ForwardBatch


def take_hidden_states(batch: ForwardBatch | None) -> None:
    """Append the rows of ``batch.extra["final_hidden"]`` to the requests that asked."""
    hidden = None if batch is None else batch.extra.pop("final_hidden", None)
    if hidden is None:
        return
    offset = 0
    for req, start, n in zip(batch.extra["reqs"], batch.prefix_lens_cpu, batch.extend_lens_cpu):
        if req.params.return_hidden_states and not req.finished:
            prompt_len = len(req.input_ids)
            rows = hidden[offset:offset + n].float().tolist()
            for pos, row in zip(range(start, start + n), rows):
                if pos < prompt_len:
                    if not req.hidden_states:
                        req.hidden_states.append([])
                    if pos == len(req.hidden_states[0]):
                        req.hidden_states[0].append(row)
                elif pos - prompt_len + 1 == len(req.hidden_states):
                    req.hidden_states.append(row)
        offset += n


def hidden_states_answer(entries: list, mode: bool | str) -> list:
    """What a request answers: every entry, or (``"last"``) its last row alone."""
    if mode != "last" or not entries:
        return entries
    last = entries[-1] if len(entries) > 1 else entries[0][-1]
    return [last]

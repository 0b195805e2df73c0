"""radixserve plugins that fail on purpose, on marked requests only.

* attention backend ``faulty``: torch_native, except that an extend batch holding the
  token :data:`METADATA_FAULT_TOKEN` in a request's new tokens raises in
  ``init_forward_metadata``, and a request whose new tokens hold :data:`NAN_TOKEN` gets
  NaN attention output (so NaN logits). An extend batch of two or more requests, one of
  them holding :data:`BATCH_FAULT_TOKEN`, raises; each of its requests runs fine alone,
  so the failure has no single culprit.
* grammar backend ``faulty``: a ``regex`` of ``fill:<ids>`` or ``accept:<ids>`` forces
  those token ids, then raises in ``fill_bitmask`` / ``accept_token`` after them;
  ``ok:<ids>`` just forces them, and ``gate:<ids>`` also waits for :data:`GATE` to compile.
* sampler: choosing the ``faulty`` attention backend wraps ``SamplingBatchInfo.build`` so that a batch holding
  a request with ``top_k == SAMPLER_FAULT_TOP_K`` raises (the scheduler then samples row
  by row, and only that row raises).

The marker tokens can be changed with ``RADIXSERVE_FAULT_TOKENS=metadata,nan,batch``.
"""

from __future__ import annotations

import os
import threading

import torch
from radixserve.plugin_api import hookimpl
from radixserve.plugin_api.grammar import GrammarBackend
from radixserve.sampling import SamplingBatchInfo
from radixserve.testing.forced_grammar import ForcedMatcher
from radixserve_attention_torch import TorchNativeAttention

_tokens = [int(x) for x in os.environ.get("RADIXSERVE_FAULT_TOKENS", "7,8,9").split(",")]
METADATA_FAULT_TOKEN, NAN_TOKEN, BATCH_FAULT_TOKEN = _tokens
SAMPLER_FAULT_TOP_K = 4242
GATE = threading.Event()  # ``gate:`` grammars compile once it is set


class InjectedFault(RuntimeError):
    pass


def _new_tokens(batch) -> list[list[int]]:
    ids = batch.input_ids.tolist()
    out, start = [], 0
    for n in batch.extend_lens_cpu:
        out.append(ids[start:start + n])
        start += n
    return out


class FaultyAttention(TorchNativeAttention):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._nan_rows = None
        install_sampler_fault()

    def init_forward_metadata(self, batch) -> None:
        self._nan_rows = None
        if not batch.is_decode:
            per_req = _new_tokens(batch)
            if any(METADATA_FAULT_TOKEN in t for t in per_req):
                raise InjectedFault("injected fault in init_forward_metadata")
            if len(per_req) > 1 and any(BATCH_FAULT_TOKEN in t for t in per_req):
                raise InjectedFault("injected batch fault")
            rows, start = [], 0
            for t in per_req:
                if NAN_TOKEN in t:
                    rows.extend(range(start, start + len(t)))
                start += len(t)
            if rows:
                self._nan_rows = torch.tensor(rows, device=batch.input_ids.device)
        super().init_forward_metadata(batch)

    def forward_extend(self, q, k, v, layer, batch):
        return self._poison(super().forward_extend(q, k, v, layer, batch))

    def forward_mixed(self, q, k, v, layer, batch):
        # a marked prompt that joins running decodes is prefilled in a mixed step
        return self._poison(super().forward_mixed(q, k, v, layer, batch))

    def _poison(self, out):
        if self._nan_rows is not None:
            out[self._nan_rows] = float("nan")
        return out


class _FaultyMatcher(ForcedMatcher):
    """Forces ``ids``, then raises in ``fill_bitmask`` or ``accept_token`` (``where``)."""

    def __init__(self, where: str, ids: list[int], eos: list[int]) -> None:
        super().__init__(ids, eos)
        self.where = where

    def fill_bitmask(self, bitmask, row):
        if self.where == "fill" and self.pos >= len(self.ids):
            raise InjectedFault("injected fault in fill_bitmask")
        super().fill_bitmask(bitmask, row)

    def accept_token(self, token_id):
        if self.where == "accept" and self.pos >= len(self.ids):
            raise InjectedFault("injected fault in accept_token")
        return super().accept_token(token_id)


class FaultyGrammar(GrammarBackend):
    name = "faulty"

    def __init__(self, tokenizer, vocab_size, eos_token_ids):
        self.eos = list(eos_token_ids)

    def compile(self, kind, text):
        where, _, ids = text.partition(":")
        if where == "gate":
            GATE.wait(60)
        return where, [int(x) for x in ids.split(",") if x]

    def new_matcher(self, compiled):
        where, ids = compiled
        return _FaultyMatcher(where, ids, self.eos)


def install_sampler_fault() -> None:
    """Make ``SamplingBatchInfo.build`` raise for batches holding a marked request."""
    build = SamplingBatchInfo.build.__func__
    if getattr(build, "faulty", False):
        return

    def faulty_build(cls, params, *args, **kwargs):
        if any(p.top_k == SAMPLER_FAULT_TOP_K for p in params):
            raise InjectedFault("injected fault in the sampler")
        return build(cls, params, *args, **kwargs)

    faulty_build.faulty = True
    SamplingBatchInfo.build = classmethod(faulty_build)


@hookimpl
def register_attention_backends(register):
    register("faulty", FaultyAttention, description="torch_native that fails on marked requests (tests only)")


@hookimpl
def register_grammar_backends(register):
    register("faulty", FaultyGrammar, description="forced tokens, then a failure (tests only)")

"""Sampling: per-request parameters and the batched sampler.

:class:`SamplingParams` (and its error) import no torch; the sampler's names load on first
use, so validating a request's or a flag's sampling fields stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.sampling.params import InvalidSamplingParams, SamplingParams

if TYPE_CHECKING:
    from radixserve.sampling.batch_info import PenaltyState, SamplingBatchInfo
    from radixserve.sampling.sampler import SampleOutput, Sampler, make_generator

__all__ = [
    "InvalidSamplingParams",
    "PenaltyState",
    "SampleOutput",
    "Sampler",
    "SamplingBatchInfo",
    "SamplingParams",
    "make_generator",
]

_LAZY = {"PenaltyState": "batch_info", "SamplingBatchInfo": "batch_info", "SampleOutput": "sampler",
         "Sampler": "sampler", "make_generator": "sampler"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

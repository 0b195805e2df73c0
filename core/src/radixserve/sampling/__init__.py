"""Sampling: per-request parameters and the batched sampler.

:class:`SamplingParams` (and its error) import no torch; the sampler's names load on first
use, so validating a request's or a flag's sampling fields stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.sampling.params import InvalidSamplingParams, SamplingParams

if TYPE_CHECKING:
    from radixserve.sampling.sampler import (
        PenaltyState,
        SampleOutput,
        Sampler,
        SamplingBatchInfo,
        make_generator,
    )

__all__ = [
    "InvalidSamplingParams",
    "PenaltyState",
    "SampleOutput",
    "Sampler",
    "SamplingBatchInfo",
    "SamplingParams",
    "make_generator",
]

_SAMPLER_NAMES = frozenset({"PenaltyState", "SampleOutput", "Sampler", "SamplingBatchInfo", "make_generator"})


def __getattr__(name: str):
    if name in _SAMPLER_NAMES:
        from radixserve.sampling import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

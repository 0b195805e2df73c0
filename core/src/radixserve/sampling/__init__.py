"""Sampling: per-request parameters and the batched sampler."""

from radixserve.sampling.params import InvalidSamplingParams, SamplingParams
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

"""Incremental detokenisation of a request's output (the core's, shared with the scheduler's
stop-string check)."""

from radixserve.detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer"]

"""The scheduler: continuous batching over the paged KV pool with RadixAttention prefix reuse.

:class:`Scheduler` (``core.py``) runs one forward pass per :meth:`~Scheduler.step`, over parts
that each have one job:

============== ===============================================================================
``admission``  intake: context and pool checks, ``--max-queued-requests``, grammar compiles, abort
``planner``    the prefill plan: policy order, chunking, prompt-logprob rows, mixed-chunk riders
``kv``         the KV manager: match, admit, grow, reserve, release (pages stay in there)
``preemption`` retraction for memory, priority preemption, HiCache's first-token rule
``drivers``    the prefill step and the plain decode step
``output``     sampling, stop checks, grammar advance, telling each request's owner
``faults``     forward passes that fail end only the requests to blame
``state``      the queues and counters the parts share
============== ===============================================================================

Speculative decoding is the other decode driver (:mod:`radixserve.speculative.runtime`);
overlapped scheduling pipelines decode steps ahead of the loop (:mod:`radixserve.engine.scheduler.overlap`).
"""

from radixserve.engine.scheduler.admission import RequestRejected
from radixserve.engine.scheduler.core import Scheduler
from radixserve.engine.scheduler.faults import EngineFailure
from radixserve.engine.scheduler.state import SchedulerStats

__all__ = ["EngineFailure", "RequestRejected", "Scheduler", "SchedulerStats"]

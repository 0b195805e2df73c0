"""Priority scheduling (``--enable-priority-scheduling``): the policy, apart from the mechanism.

Lower ``priority`` values are served first, as in vLLM (SGLang's own default is the
reverse; ``--schedule-low-priority-values-first`` is accepted and states this order).
Requests that give no priority get ``--default-priority-value`` (0).

Rules the scheduler relies on:

* The waiting queue is ordered by priority first, then by ``--schedule-policy``; the sort
  is stable, so requests of equal priority keep the policy's order (arrival for fcfs).
* A waiting request may preempt a running one only when its priority value is lower by
  *more than* ``--priority-scheduling-preemption-threshold`` (>= 0). Preemption therefore
  only ever flows from a strictly more urgent request to a less urgent one: a preempted
  request can never preempt its preemptor back, and no cycle is possible.
* Victims are the least urgent first; among equals, the one with the least progress
  (fewest output tokens: the least work to redo if its pages are evicted).

The scheduler owns the mechanism: preemption is retraction (the victim's computed pages
enter the prefix cache, the rest go back to the pool, and it waits to be resumed with its
stream intact), and it preempts only while the most urgent waiting request does not fit.
"""

from __future__ import annotations

from radixserve.engine.request import Req


class PriorityRejected(ValueError):
    """A ``priority`` that cannot be used (its type, or priority scheduling is off and
    ``--abort-on-priority-when-disabled`` is set); ``param`` is ``"priority"``."""

    param = "priority"


def resolve_priority(args, priority) -> int:
    """The priority a request runs with: ``priority`` when priority scheduling is on,
    ``--default-priority-value`` when it is not given or scheduling is off (raises
    PriorityRejected with ``--abort-on-priority-when-disabled``, or for a non-integer)."""
    if priority is None:
        return args.default_priority_value
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise PriorityRejected(f"priority must be an integer, got {priority!r}")
    if not args.enable_priority_scheduling:
        if args.abort_on_priority_when_disabled:
            raise PriorityRejected("priority: priority scheduling is off on this server (start it with "
                                   "--enable-priority-scheduling), and --abort-on-priority-when-disabled "
                                   "refuses requests that give one; omit priority")
        return args.default_priority_value
    return priority


def order_by_priority(reqs: list[Req]) -> list[Req]:
    """``reqs`` (in the schedule policy's order) with lower priority values first, stable."""
    return sorted(reqs, key=lambda r: r.priority)


def preemption_victims(req: Req, running: list[Req], threshold: int) -> list[Req]:
    """The running requests ``req`` may preempt (priority value higher than ``req``'s by
    more than ``threshold``), in the order to preempt them: least urgent first, then least
    progress first."""
    victims = [r for r in running if r.priority - req.priority > threshold]
    return sorted(victims, key=lambda r: (-r.priority, len(r.output_ids), -len(r.input_ids)))

"""Helpers shared by tests in this folder (a module of its own: every package's tests have a
``conftest.py``, so importing from ``conftest`` would pick whichever was loaded last)."""

from __future__ import annotations

import time


def wait_until_idle(engine, timeout: float = 10.0) -> None:
    """Wait for the scheduler thread to drain, then check the idle invariant.

    ``generate`` returns as soon as the last request reports it has finished; the
    scheduler thread may still be dropping it from its running list for a moment.
    """
    deadline = time.monotonic() + timeout
    while engine.scheduler.has_work and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.check_idle_invariant()

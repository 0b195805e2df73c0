"""Helpers shared by tests in this folder (a module of its own: every package's tests have a
``conftest.py``, so importing from ``conftest`` would pick whichever was loaded last)."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def leak_checked_engine(path: str, **kw):
    """A float32 engine on ``path`` with the leak check on (``max_total_tokens`` 4096 unless
    given), checked idle when the block ends and always shut down."""
    import radixserve

    kw.setdefault("max_total_tokens", 4096)
    engine = radixserve.Engine(path, dtype="float32", enable_leak_check=True, **kw)
    try:
        yield engine
        wait_until_idle(engine)
    finally:
        engine.shutdown()

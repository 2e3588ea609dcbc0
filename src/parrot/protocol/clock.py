"""Time as the code serving a workload reads it.

The manager reads time only through :func:`monotonic` (deadlines, queueing,
heartbeats, idle sessions) and :func:`wall` (the timestamps it reports).  Both
follow the running event loop's clock: on an ordinary loop that clock is
``time.monotonic()``, so :func:`monotonic` is exactly it and :func:`wall` is
``time.time()``; on the simulator's loop (:class:`parrot.sim.clock.VirtualTimeLoop`)
the clock is virtual and jumps to the next timer, and the manager, unchanged,
runs a whole workload in virtual time.  Outside any loop they are the system's.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["TIME_HEADER", "monotonic", "wall"]

_EPOCH_MINUS_MONOTONIC = time.time() - time.monotonic()
"""``wall() - monotonic()``, fixed once: timestamps then never go backwards within a process
(and drift from ``time.time()`` by as much as the system clock is stepped while it runs)."""

TIME_HEADER = "X-Parrot-Time"
"""Response header carrying :func:`wall` as the manager answers (``GET .../graph``): what a
client subtracts the calls' timestamps from to place them on its own clock."""


def monotonic() -> float:
    """Seconds on the running event loop's clock (``time.monotonic()`` outside a loop)."""
    loop = asyncio._get_running_loop()
    return time.monotonic() if loop is None else loop.time()


def wall() -> float:
    """Seconds since the epoch, on the running event loop's clock."""
    return _EPOCH_MINUS_MONOTONIC + monotonic()

"""An asyncio event loop in virtual time.

:class:`VirtualTimeLoop` is an ordinary selector event loop whose clock
(``loop.time()``) is a number it keeps: whenever nothing is ready to run and no
file descriptor has an event, the clock jumps to the next timer instead of
waiting for it.  Code that sleeps, uses ``call_later`` or reads the clock through
the loop (:mod:`parrot.protocol.clock`) then runs as it would, in virtual time,
as fast as the CPU allows.

Work handed to threads (``run_in_executor``, ``asyncio.to_thread``) runs at
once, on the loop's thread, taking no virtual time: a thread finishing at a real
moment would make the order of events depend on the machine, and a simulation
must not.  So a run is deterministic: the same program gives the same events at
the same virtual times.

Invariant: the clock never goes backwards, and it moves only when the loop has
nothing else to do.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable
from typing import Any

__all__ = ["VirtualTimeLoop", "run"]

REAL_WAIT_S = 0.05
"""With no timer at all, the loop polls its file descriptors this often (real time):
only another thread or a socket can then give it work."""


class _JumpingSelector(selectors.BaseSelector):
    """The real selector, except that a wait with a timeout advances the loop's clock."""

    def __init__(self, advance: Callable[[float], None]) -> None:
        self._real = selectors.DefaultSelector()
        self._advance = advance

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = self._real.select(0)
        if events:
            return events
        if timeout is None:  # nothing scheduled: wait for a descriptor, in real time
            return self._real.select(REAL_WAIT_S)
        if timeout > 0:
            self._advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        super().__init__(selector=_JumpingSelector(self._advance))

    def _advance(self, seconds: float) -> None:
        self._now += seconds

    def time(self) -> float:
        return self._now

    def run_in_executor(self, executor: Any, func: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run ``func`` now, on this thread, in no virtual time (see the module docstring)."""
        future = self.create_future()
        try:
            future.set_result(func(*args))
        except BaseException as exc:  # delivered through the future, as from a thread
            future.set_exception(exc)
        return future


def run(main: Any, *, start: float = 0.0) -> Any:
    """Run the coroutine ``main`` to completion on a fresh :class:`VirtualTimeLoop`."""
    loop = VirtualTimeLoop(start)
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

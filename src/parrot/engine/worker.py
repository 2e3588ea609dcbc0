"""The engine's worker thread: one thread that runs the commands other threads send
it and steps while there is work.

Invariants: everything a subclass's steps touch (contexts, tensors) is touched only on
this thread, so no locks guard it; other threads talk to it only through
:meth:`Worker.call` (run a function there and hear the result) and :meth:`Worker.post`
(queue a command).  Every command queued before a step runs before it (the inbox is
drained first), and a step that raises fails the work in hand (:meth:`Worker._fail_all`)
but never the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Self

from parrot.protocol.errors import ParrotError

log = logging.getLogger(__name__)


class Worker:
    """The thread, its inbox and its step loop; subclasses say what a step is
    (:meth:`_step_once`), whether there is work (:meth:`has_work`) and how to fail the
    work in hand (:meth:`_fail_all`)."""

    def __init__(self) -> None:
        self._stepping = False  # inside _step: see after_step
        self._after_step: list[Callable[[], None]] = []
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = False

    # ------------------------------------------------------------ subclass hooks
    def has_work(self) -> bool:
        """Whether the loop should step rather than wait for a command."""
        raise NotImplementedError

    def _step_once(self) -> None:
        """One step of the work in hand (worker thread)."""
        raise NotImplementedError

    def _fail_all(self, error: ParrotError) -> None:
        """End all the work in hand with ``error`` (worker thread)."""
        raise NotImplementedError

    # ------------------------------------------------------------ other threads
    @classmethod
    def start_on_own_thread(cls, make: Callable[[], Self]) -> Self:
        """Run ``make`` (e.g. load the model and build the runner) on a new thread that then
        runs the worker's loop; returns the worker once built, or raises what ``make`` raised.

        All of the engine's torch work then happens on one thread, so PyTorch's OpenMP
        runtime keeps one thread team (it keeps one per thread that starts parallel
        work) instead of a second one left behind by the thread that loaded the model.
        """
        built: list[Self] = []
        failed: list[BaseException] = []
        ready = threading.Event()

        def main() -> None:
            try:
                worker = make()
                worker._thread = threading.current_thread()
                built.append(worker)
            except BaseException as exc:  # handed to the caller below
                failed.append(exc)
                return
            finally:
                ready.set()
            worker._loop()

        threading.Thread(target=main, name="parrot-engine", daemon=True).start()
        ready.wait()
        if failed:
            raise failed[0]
        return built[0]

    def stop(self) -> None:
        self._stopped = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)

    def call(self, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        """Run ``fn`` on the worker thread; ``done(result, error)`` is called there."""

        def command() -> None:
            try:
                result = fn()
            except BaseException as exc:  # delivered to the caller, never kills the worker
                done(None, exc)
            else:
                done(result, None)

        self._inbox.put(command)

    def post(self, command: Callable[[], None]) -> None:
        """Queue ``command`` to run on the worker thread before its next step."""
        self._inbox.put(command)

    # ------------------------------------------------------------ worker thread
    def after_step(self, fn: Callable[[], None]) -> bool:
        """Worker thread: run ``fn`` once the step in progress has ended (after its
        tokens are sampled and its time recorded) and return True; False, and nothing
        queued, outside a step.  How :class:`~parrot.engine.local.LocalEngine` wakes an
        event loop once per step for all the tokens it streams there."""
        if not self._stepping:
            return False
        self._after_step.append(fn)
        return True

    def _loop(self) -> None:
        """Wait for a command while idle; else drain the inbox and step; until stopped,
        when the work in hand fails with ``engine_stopped``."""
        while not self._stopped:
            idle = not self.has_work()
            try:
                command = self._inbox.get() if idle else self._inbox.get_nowait()
            except queue.Empty:
                command = None
                if not self._stopped:
                    self._step_safely()
                continue
            if command is None:
                continue
            command()
            while True:  # drain everything queued before stepping
                try:
                    more = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    break
                more()
            if not self._stopped and self.has_work():
                self._step_safely()
        self._fail_all(ParrotError("engine stopped", code="engine_stopped"))

    def _step_safely(self) -> None:
        try:
            self._step()
        except ParrotError as exc:
            self._fail_all(exc)
        except Exception as exc:  # a bug or OOM in the step: fail the batch, keep serving
            log.exception("engine step failed")
            self._fail_all(ParrotError(f"engine step failed: {exc}", code="engine_error"))

    def _step(self) -> None:
        """One step, then the callbacks :meth:`after_step` queued during it."""
        self._stepping = True
        try:
            self._step_once()
        finally:
            self._stepping = False
            deferred, self._after_step = self._after_step, []
            for fn in deferred:
                try:
                    fn()
                except Exception:  # one caller's closed loop must not keep the others waiting
                    log.exception("after-step callback failed")

"""The deduced objectives of queued calls, deduced again only where a session changed.

Deduction (:func:`parrot.manager.dag.objectives.deduce`) runs per session over its
unfinished calls.  :meth:`ObjectiveCache.refresh` runs it for the sessions that
have a queued call and were changed since (a call submitted, a criterion
arriving: :meth:`ObjectiveCache.mark_changed`) or never deduced; other sessions
keep their results.  A changed session without queued calls only loses its
results: it is deduced again when one of its calls is queued.  A call not
deduced yet, or whose deduction failed (a bug, logged), gets
:data:`LATENCY_DEFAULT` and is still scheduled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from parrot.manager.dag.graph import Call
from parrot.manager.dag.objectives import CallObjective, deduce

__all__ = ["LATENCY_DEFAULT", "ObjectiveCache"]

log = logging.getLogger(__name__)

LATENCY_DEFAULT = CallObjective("latency", reason="not deduced yet")


class ObjectiveCache:
    def __init__(self, calls_of_session: Callable[[str], Iterable[Call]] | None = None):
        """``calls_of_session``: a session's calls (its whole DAG); without it, deduction
        sees only the queued calls."""
        self._calls_of_session = calls_of_session
        # session id -> call id -> objective, for sessions whose graph did not change since
        self.known: dict[str, dict[str, CallObjective]] = {}
        self.dirty: set[str] = set()  # sessions whose DAG or criteria changed since deduction

    def mark_changed(self, session_id: str) -> None:
        self.dirty.add(session_id)

    def of(self, call: Call) -> CallObjective:
        """The call's objective as last deduced (after :meth:`refresh`)."""
        return self.known.get(call.session_id, {}).get(call.call_id, LATENCY_DEFAULT)

    def refresh(self, queued: list[Call]) -> None:
        """Deduce again where needed for these queued calls (see the module docstring)."""
        dirty = self.dirty
        known = self.known
        stale: set[str] = set()
        for call in queued:
            sid = call.session_id
            if sid in dirty or call.call_id not in known.get(sid, ()):
                stale.add(sid)
        for sid in dirty:
            if sid not in stale:
                known.pop(sid, None)
        dirty.clear()
        for sid in stale:
            known[sid] = self._deduce_session(sid, queued)

    def forget(self, call: Call) -> None:
        """A call ended: drop its objective (and its session's entry once empty)."""
        of_session = self.known.get(call.session_id)
        if of_session is not None:
            of_session.pop(call.call_id, None)
            if not of_session:
                del self.known[call.session_id]

    def _deduce_session(self, sid: str, queued: list[Call]) -> dict[str, CallObjective]:
        if self._calls_of_session is None:
            calls = [c for c in queued if c.session_id == sid]
        else:
            calls = list(self._calls_of_session(sid))
        try:
            return deduce(calls)
        except Exception:  # kept until the session changes again: no retry every round
            log.exception("objective deduction failed for session %s; its calls keep the default", sid)
            return {c.call_id: LATENCY_DEFAULT for c in calls}

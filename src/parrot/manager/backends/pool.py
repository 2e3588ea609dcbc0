"""The pool of engines the manager can place calls on.

An engine is registered either in-process (the embedded engine of
``parrot serve``), over HTTP by a separate ``parrot engine`` process, which
then heartbeats its stats, or as an external OpenAI-compatible backend
(:mod:`parrot.manager.backends.openai_backend`, which has a URL but sends nothing).
The manager polls the stats of in-process and external engines (``polled``)
on the heartbeat interval instead (and once when they register), so every
kind reaches the scheduler the same way: through :meth:`EnginePool.heartbeat`.
A remote engine whose heartbeats stop for ``heartbeat_timeout_s`` is dropped;
listeners learn of registrations (to poll) and drops (so the executor can
re-run the calls it had there).
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from parrot.protocol import clock
from parrot.protocol.engine_api import EngineAPI
from parrot.protocol.errors import NotFound
from parrot.protocol.schemas import EngineStats

_engine_ids = itertools.count(1)
_CONTEXT_ID_BITS = 62
"""Context ids are random 62-bit integers: nobody can guess another call's context on an
engine, and ids do not repeat (across managers sharing an engine, as in tests, or after a
manager restart) but with probability ~n²/2**63 for n ids."""


@dataclass(eq=False)
class EngineHandle:
    engine_id: str
    api: EngineAPI
    name: str | None = None
    url: str | None = None  # None: in-process
    polled: bool = False  # the manager asks for its stats (in-process and external engines)
    alive: bool = True
    down_reason: str = ""  # why it was last suspected (cleared when it answers again)
    last_heartbeat: float = field(default_factory=clock.monotonic)
    stats: EngineStats = field(default_factory=EngineStats)

    @property
    def model(self) -> str:
        return self.api.model_name

    @property
    def max_seq_len(self) -> int:
        return self.api.max_seq_len

    @staticmethod
    def new_context_id() -> int:
        return secrets.randbits(_CONTEXT_ID_BITS)


def _scheduling_stats(stats: EngineStats) -> tuple[int, int, float]:
    """What of an engine's stats the scheduler's snapshots read from the pool."""
    return stats.token_capacity, stats.latency_cap_tokens, stats.prefill_tokens_per_decode_step


class EnginePool:
    def __init__(self, heartbeat_timeout_s: float = 15.0):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._engines: dict[str, EngineHandle] = {}
        self._drop_listeners: list[Callable[[EngineHandle, str], None]] = []
        self._register_listeners: list[Callable[[EngineHandle], None]] = []
        # bumped whenever an engine joins, leaves, is suspected or answers again, or reports
        # other scheduling stats: who reads the pool per call or per round rescans it only then
        self.version = 0
        self._longest: dict[str | None, tuple[int, EngineHandle | None]] = {}  # model -> (version, engine)

    def __iter__(self):
        return iter(list(self._engines.values()))

    def __len__(self) -> int:
        return len(self._engines)

    def on_drop(self, listener: Callable[[EngineHandle, str], None]) -> None:
        self._drop_listeners.append(listener)

    def on_register(self, listener: Callable[[EngineHandle], None]) -> None:
        self._register_listeners.append(listener)

    def register(
        self, api: EngineAPI, *, name: str | None = None, url: str | None = None, polled: bool | None = None
    ) -> EngineHandle:
        """Add an engine; ``polled`` (default: in-process, i.e. no ``url``) when the manager
        polls its stats instead of waiting for its heartbeats."""
        polled = url is None if polled is None else polled
        handle = EngineHandle(f"engine-{next(_engine_ids)}", api, name=name, url=url, polled=polled)
        self._engines[handle.engine_id] = handle
        self.version += 1
        for listener in self._register_listeners:
            listener(handle)
        return handle

    def get(self, engine_id: str) -> EngineHandle:
        handle = self._engines.get(engine_id)
        if handle is None:
            raise NotFound(f"engine {engine_id} is not registered", code="engine_not_found")
        return handle

    def heartbeat(self, engine_id: str, stats: EngineStats) -> EngineHandle:
        """Record an engine's stats (a remote engine's heartbeat, or a poll of an
        in-process one); raises NotFound for an engine that is not registered."""
        handle = self.get(engine_id)
        handle.last_heartbeat = clock.monotonic()
        if not handle.alive or _scheduling_stats(handle.stats) != _scheduling_stats(stats):
            self.version += 1
        handle.stats = stats
        handle.alive, handle.down_reason = True, ""  # it answers again, if it had been suspected
        return handle

    def suspect(self, engine_id: str, reason: str = "") -> None:
        """An engine failed a request: place nothing new on it until it heartbeats (a
        remote engine), answers a poll (an external one) or is dropped.  In-process
        engines are never suspected."""
        handle = self._engines.get(engine_id)
        if handle is not None and handle.url is not None:
            if handle.alive:
                self.version += 1
            handle.alive, handle.down_reason = False, reason

    def drop(self, engine_id: str, reason: str) -> None:
        handle = self._engines.pop(engine_id, None)
        if handle is None:
            return
        self.version += 1
        handle.alive = False
        for listener in self._drop_listeners:
            listener(handle, reason)

    def drop_stale(self, now: float | None = None) -> list[str]:
        """Drop remote engines whose last heartbeat is too old; returns their ids."""
        now = clock.monotonic() if now is None else now
        stale = [
            h.engine_id
            for h in self._engines.values()
            if h.url is not None and not h.polled and now - h.last_heartbeat > self.heartbeat_timeout_s
        ]
        for eid in stale:
            self.drop(eid, f"no heartbeat for more than {self.heartbeat_timeout_s:g}s")
        return stale

    def candidates(self, model: str | None) -> list[EngineHandle]:
        return [h for h in self._engines.values() if h.alive and (model is None or h.model == model)]

    def down(self, model: str | None) -> str:
        """`` (engines not answering: ...)`` naming the suspected engines of ``model`` and
        why, to end an error message with ("" if none)."""
        down = "; ".join(
            f"{h.engine_id} at {h.url}: {h.down_reason or 'not answering'}"
            for h in self._engines.values()
            if not h.alive and (model is None or h.model == model)
        )
        return f" (engines not answering: {down})" if down else ""

    def longest_context(self, model: str | None) -> EngineHandle | None:
        """The live engine for ``model`` with the longest context (None if there is none):
        what a value or prompt must fit to be servable at all.  Kept until the pool changes
        (every call asks; a pool of a thousand engines would be scanned per call)."""
        kept = self._longest.get(model)
        if kept is not None and kept[0] == self.version:
            return kept[1]
        longest = max(self.candidates(model), key=lambda h: h.max_seq_len, default=None)
        self._longest[model] = (self.version, longest)
        return longest

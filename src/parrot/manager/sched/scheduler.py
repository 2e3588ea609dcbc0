"""Application-centric scheduling: Algorithm 1 of the paper as a pure function.

``schedule(queue, engines, config)`` decides, for one scheduling round, which
queued calls go to which engine.  It reads plain snapshots and returns
placements; calls it does not place stay queued.  No I/O, no asyncio, no
engine imports, so the manager and the simulator run the same decisions.
:class:`Scheduler` is the same round over engine state kept between rounds,
so a busy manager pays only for the engines that changed.

The round is one loop for every policy: the queue in ``topo_rank`` order
(stable: producers first, then arrival), and per call the policy's decisions
(:mod:`parrot.manager.sched.policies`, one object per ``config.policy``,
built once from the :class:`SchedulerConfig`) over the engines' working copies
(:mod:`parrot.manager.sched.engine_index`).

Invariants:

- a call goes only to a live engine that serves its model and takes its
  length, and only where it has room under the policy's cap or the engine is
  idle (a call larger than the cap runs alone: it is never starved);
- each placement is seen by the round's later decisions; the round's own
  bookkeeping is undone when it ends (placements are not remembered: the
  caller reports each engine's new load in its next snapshot);
- the result depends only on the queue, the snapshots and the configuration,
  not on the order of the engines (ties: least load, then the engine given
  work least recently, then the smallest id);
- ``Scheduler(config)`` after any sequence of updates returns what
  ``schedule(queue, <its current snapshots>, config)`` returns: it is the
  same code, and :func:`schedule` is a fresh ``Scheduler`` used once.

The algorithm, its caps and options, and why: docs/scheduling.md, "The
algorithm".  The vocabulary lives in :mod:`parrot.manager.sched.scheduler_types`.
"""

from __future__ import annotations

from collections.abc import Sequence

from parrot.manager.sched.engine_index import EngineIndex
from parrot.manager.sched.policies import SchedulingPolicy, policy_for
from parrot.manager.sched.scheduler_types import (  # the scheduler's vocabulary, re-exported
    CAP_SCOPES,
    DEFAULT_LATENCY_CAP_TOKENS,
    DEFAULT_PREFILL_TOKENS_PER_STEP,
    POLICIES,
    CapScope,
    EngineSnapshot,
    Mode,
    Placement,
    Policy,
    QueuedCall,
    Reason,
    SchedulerConfig,
)

__all__ = [
    "CAP_SCOPES",
    "DEFAULT_LATENCY_CAP_TOKENS",
    "DEFAULT_PREFILL_TOKENS_PER_STEP",
    "POLICIES",
    "CapScope",
    "EngineSnapshot",
    "Mode",
    "Placement",
    "Policy",
    "QueuedCall",
    "Reason",
    "Scheduler",
    "SchedulerConfig",
    "schedule",
    "unservable",
]


def _rank(c: QueuedCall) -> int:
    return c.topo_rank


def _unservable(queue: Sequence[QueuedCall], longest: dict[str, int]) -> list[tuple[str, str]]:
    overall = max(longest.values(), default=0)
    out: list[tuple[str, str]] = []
    for c in queue:
        if c.model is None:
            limit, what = overall, "any model"
        else:
            limit, what = longest.get(c.model, 0), f"model {c.model!r}"
        if limit == 0:
            out.append((c.call_id, f"no live engine serves {what}; live models: {sorted(longest) or 'none'}"))
        elif c.tokens > limit:
            why = f"call needs {c.tokens} tokens; the longest context of a live engine for {what} is {limit}"
            out.append((c.call_id, why))
    return out


def unservable(queue: Sequence[QueuedCall], engines: Sequence[EngineSnapshot]) -> list[tuple[str, str]]:
    """Calls no live engine could ever run, with a reason (so the manager can fail them fast).

    A call is unservable when no live engine serves its model, or its tokens
    exceed the ``max_seq_len`` of every live engine serving its model.  Dead
    engines do not count.  O(Q + E).
    """
    longest: dict[str, int] = {}
    for e in engines:
        if e.alive:
            longest[e.model] = max(longest.get(e.model, 0), e.max_seq_len)
    return _unservable(queue, longest)


def schedule(
    queue: Sequence[QueuedCall], engines: Sequence[EngineSnapshot], config: SchedulerConfig | None = None
) -> list[Placement]:
    """One scheduling round (docs/scheduling.md, "The algorithm").

    Returns placements in decision order.  Raises ValueError on duplicate
    call or engine ids.
    """
    scheduler = Scheduler(config)
    scheduler.sync(engines)
    return scheduler.schedule(queue)


class Scheduler:
    """Algorithm 1 over engine state kept from one round to the next.

    :func:`schedule` builds its per-engine structures (load heaps, affinity
    indexes) from the snapshots on every call.  A ``Scheduler`` keeps them:
    :meth:`set_engine`, :meth:`remove_engine` and :meth:`sync` tell it what
    changed (O(1) per engine whose snapshot is unchanged, O(log E + keys)
    per changed one), and :meth:`schedule` runs one round over that state,
    then undoes the round's own bookkeeping.  For any sequence of updates,
    ``Scheduler(config).schedule(queue)`` returns what
    ``schedule(queue, <its current snapshots>, config)`` returns.

    ``config`` is fixed for the scheduler's life; its policy object is built
    here, once.
    """

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        config = config or SchedulerConfig()
        self.config = config
        self.policy: SchedulingPolicy = policy_for(config)
        policy = self.policy
        self._index = EngineIndex(config.latency_cap_tokens, policy.tiered, policy.affinity, policy.room)

    # -- what it knows of the engines
    @property
    def engines(self) -> list[EngineSnapshot]:
        """The current snapshots (live or not), in the order they were first set."""
        return list(self._index.snaps.values())

    def sync(self, engines: Sequence[EngineSnapshot]) -> None:
        """Make ``engines`` the whole engine set (unchanged snapshot objects cost O(1)).

        Raises ValueError on a duplicate engine id, before changing anything.
        """
        self._index.sync(engines)

    def set_engine(self, snap: EngineSnapshot) -> None:
        """Add an engine, or replace what is known of one (by ``engine_id``)."""
        self._index.set_engine(snap)

    def remove_engine(self, engine_id: str) -> None:
        """Forget an engine (nothing happens for one it was not told of)."""
        self._index.remove_engine(engine_id)

    def unservable(self, queue: Sequence[QueuedCall]) -> list[tuple[str, str]]:
        """:func:`unservable` over the current snapshots."""
        longest = {model: max(shape[1] for shape in shapes) for model, shapes in self._index.shapes.items()}
        return _unservable(queue, longest)

    # -- the round
    def schedule(self, queue: Sequence[QueuedCall]) -> list[Placement]:
        """One round over the current snapshots (docs/scheduling.md, "The algorithm").

        Returns placements in decision order and leaves the state as it was
        (the round's placements are not remembered).  Raises ValueError on a
        duplicate call id.
        """
        calls_seen: set[str] = set()
        for c in queue:
            if c.call_id in calls_seen:
                raise ValueError(f"duplicate call id {c.call_id!r}")
            calls_seen.add(c.call_id)
        policy, index = self.policy, self._index
        out: list[Placement] = []
        policy.begin_round(index, queue)
        try:
            for c in sorted(queue, key=_rank):
                kind, group = policy.work_of(c)
                eng, reason = policy.choose(index, c, kind, group)
                if eng is None:
                    policy.unplaced(index, c, kind)
                    continue
                index.place(eng, c, kind, group)
                out.append(Placement(c.call_id, eng.id, reason))
        finally:
            policy.end_round()
            index.end_round()
        return out

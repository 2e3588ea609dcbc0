"""Scheduling policies as objects: what each ``SchedulerConfig.policy`` decides.

The :class:`~parrot.manager.sched.scheduler.Scheduler` runs one loop for every
policy: it sorts the queue by ``topo_rank`` and, for each call, asks its policy
what work the call is (:meth:`SchedulingPolicy.work_of`), where it goes
(:meth:`SchedulingPolicy.choose`) and, if nowhere, what its waiting holds back
(:meth:`SchedulingPolicy.unplaced`).  The engine state it searches is an
:class:`~parrot.manager.sched.engine_index.EngineIndex`, whose "has room" rule is
the policy's :meth:`SchedulingPolicy.room`.  :func:`policy_for` builds the policy
object from a :class:`SchedulerConfig` once, when the scheduler is built.

- :class:`ParrotPolicy` (``parrot``): Algorithm 1 of the paper, objectives deduced,
  task-group and prefix affinity, engines in latency or throughput mode, drain
  reservation; the refinements in the configuration (cap scope, saturation
  batching, affinity spill, latency packing) are its own;
- :class:`NoAffinityPolicy` (``no-affinity``): the same without affinity steps;
- :class:`NoDeductionPolicy` (``no-deduction``): the same with every call
  latency-sensitive and no task groups;
- :class:`LatencyBaselinePolicy` (``baseline-latency``) and
  :class:`ThroughputBaselinePolicy` (``baseline-throughput``): request-level FIFO
  to the least-loaded engine under one cap for everything.

Invariants every policy keeps: a call goes only to an engine that serves its model,
takes its length and is not blocked, and that is idle or has room under the
policy's cap (:meth:`EngineIndex.fits`); a policy's decisions read only the index
and the call, so one round's placements depend on nothing else.  The algorithm
in prose, and why: docs/scheduling.md, "The algorithm".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from parrot.manager.sched import saturation
from parrot.manager.sched.engine_index import EngineIndex, WorkingEngine
from parrot.manager.sched.scheduler_types import (
    DEFAULT_PREFILL_TOKENS_PER_STEP,
    MODES,
    EngineSnapshot,
    Mode,
    Policy,
    QueuedCall,
    Reason,
    SchedulerConfig,
)

__all__ = [
    "LatencyBaselinePolicy",
    "NoAffinityPolicy",
    "NoDeductionPolicy",
    "ParrotPolicy",
    "SchedulingPolicy",
    "ThroughputBaselinePolicy",
    "policy_for",
]

Choice = tuple[WorkingEngine | None, Reason]


class SchedulingPolicy(ABC):
    """The per-policy decisions of a scheduling round.

    ``tiered``: engines are told apart by mode (latency work, throughput work, idle);
    ``affinity``: the index keeps task-group and prefix indexes for :meth:`choose`.
    A policy object may keep state within a round (:meth:`begin_round` to
    :meth:`end_round`), never across rounds.
    """

    name: ClassVar[Policy]
    tiered: ClassVar[bool] = True
    affinity: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig) -> None:
        self.throughput_cap = config.throughput_cap

    def _bound(self, kind: Mode, capacity: int, lat_cap: int) -> int:
        """``cap_L = min(L(e), capacity)`` for latency work, else ``cap_T``."""
        if kind == "latency":
            return min(lat_cap, capacity)
        return capacity if self.throughput_cap is None else min(self.throughput_cap, capacity)

    @abstractmethod
    def work_of(self, c: QueuedCall) -> tuple[Mode, str | None]:
        """The kind of work ``c`` is placed as, and its task group (None: none)."""

    @abstractmethod
    def cap(self, kind: Mode, mode: Mode | None, capacity: int, lat_cap: int) -> int:
        """The token load that work of ``kind`` may bring an engine in ``mode`` to
        (``capacity``, ``lat_cap``: the engine's token capacity and latency cap)."""

    def room(
        self, kind: Mode, mode: Mode | None, e: WorkingEngine, c: QueuedCall, capacity: int, lat_cap: int
    ) -> bool:
        """Whether ``c`` (as work of ``kind``) has room on the loaded engine ``e`` in ``mode``."""
        return e.load + c.tokens <= self.cap(kind, mode, capacity, lat_cap)

    @abstractmethod
    def begin_round(self, index: EngineIndex, queue: Sequence[QueuedCall]) -> None:
        """Called before a round's first decision."""

    @abstractmethod
    def end_round(self) -> None:
        """Called when a round ends, whatever was placed."""

    @abstractmethod
    def choose(self, index: EngineIndex, c: QueuedCall, kind: Mode, group: str | None) -> Choice:
        """The engine for ``c`` and why, or ``(None, _)`` when it waits."""

    @abstractmethod
    def unplaced(self, index: EngineIndex, c: QueuedCall, kind: Mode) -> None:
        """``c`` was not placed: block what its waiting holds back for the rest of the round."""


# ------------------------------------------------------------------ the request-level baselines
class _RequestLevelPolicy(SchedulingPolicy):
    """Request-level FIFO in ``topo_rank`` order to the least-loaded engine, one cap for
    everything (:attr:`kind`'s), no modes, no affinity.  No overtaking: a call that does not
    fit blocks every engine it could run on for the rest of the round, as an engine's FCFS
    queue would."""

    tiered = False
    kind: ClassVar[Mode]

    def work_of(self, c: QueuedCall) -> tuple[Mode, str | None]:
        return self.kind, None

    def cap(self, kind: Mode, mode: Mode | None, capacity: int, lat_cap: int) -> int:
        return self._bound(self.kind, capacity, lat_cap)

    def begin_round(self, index: EngineIndex, queue: Sequence[QueuedCall]) -> None:
        pass  # no round state

    def end_round(self) -> None:
        pass

    def choose(self, index: EngineIndex, c: QueuedCall, kind: Mode, group: str | None) -> Choice:
        return index.least_loaded(c, kind, (None,)), "fifo"

    def unplaced(self, index: EngineIndex, c: QueuedCall, kind: Mode) -> None:
        for e in index.serving(c):  # FIFO: nobody overtakes c on the engines it waits for
            index.block(e)


class LatencyBaselinePolicy(_RequestLevelPolicy):
    """``baseline-latency``: every call under ``cap_L`` (the latency-centric baseline)."""

    name = "baseline-latency"
    kind = "latency"


class ThroughputBaselinePolicy(_RequestLevelPolicy):
    """``baseline-throughput``: every call under ``cap_T`` (the throughput-centric baseline)."""

    name = "baseline-throughput"
    kind = "throughput"


# ------------------------------------------------------------------ saturation batching
class SaturationBatching:
    """While latency calls queue, an engine running latency work takes them past its cap up
    to the batch that finishes them soonest (:func:`saturation.batch_calls`).

    Round state: ``competing``, the latency calls (and task-group members) per live engine,
    running or queued; ``open`` until a latency call of the round waits, so no later call
    overtakes it past a cap.
    """

    def __init__(self, prefill_tokens_per_step: float | None) -> None:
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.competing = 0.0
        self.open = False

    def begin_round(self, index: EngineIndex, queued: int) -> None:
        """``queued``: the round's latency calls and task-group members."""
        self.competing = (queued + index.latency_running) / len(index.engs) if index.engs else 0.0
        self.open = True

    def per_step(self, snap: EngineSnapshot) -> float:
        """Prompt tokens per unloaded decode step: the operator's figure, else the engine's
        own, else the default."""
        return self.prefill_tokens_per_step or snap.prefill_tokens_per_step or DEFAULT_PREFILL_TOKENS_PER_STEP

    def admits(self, e: WorkingEngine, c: QueuedCall, capacity: int, lat_cap: int) -> bool:
        """Whether ``e`` runs fewer than ``k*`` latency calls and has ``c``'s tokens in its capacity."""
        k = saturation.batch_calls(
            self.competing, c.tokens, c.new_tokens, lat_cap, self.per_step(e.snap), c.shared_tokens
        )
        return e.lat_calls + 1 <= k and e.load + c.tokens <= capacity


# ------------------------------------------------------------------ Parrot and its ablations
class ParrotPolicy(SchedulingPolicy):
    """``parrot``: Algorithm 1 (docs/scheduling.md, "The algorithm"): task group, then
    prefix, then FindEngine; drain reservation for a call over every cap.

    Configuration it reads: ``latency_cap_scope`` (``"all"``: ``cap_L`` wherever latency
    work is; ``"mixed"``: only where the two kinds meet), ``saturation_batching`` (applies
    under scope ``"all"`` only), ``affinity_spill`` and ``pack_latency``.
    """

    name = "parrot"
    affinity = True

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.mixed_scope = config.latency_cap_scope == "mixed"
        self.spill = config.affinity_spill
        self.pack_latency = config.pack_latency
        batching = config.saturation_batching and not self.mixed_scope
        self.batching = SaturationBatching(config.prefill_tokens_per_step) if batching else None

    def work_of(self, c: QueuedCall) -> tuple[Mode, str | None]:
        return c.objective.kind, c.objective.task_group

    def critical(self, c: QueuedCall, kind: Mode) -> bool:
        """Whether ``c`` (as work of ``kind``) is on a latency-sensitive call's critical path:
        latency work, or a member of a task group."""
        return kind == "latency" or c.objective.task_group is not None

    # -- caps and room
    def cap(self, kind: Mode, mode: Mode | None, capacity: int, lat_cap: int) -> int:
        if self.mixed_scope:
            if kind == "latency":
                return capacity  # latency work batches like any server's (see room for mode "throughput")
            if mode == "latency":
                kind = "latency"  # throughput work next to latency work
        elif mode == "latency":
            kind = "latency"
        return self._bound(kind, capacity, lat_cap)

    def room(
        self, kind: Mode, mode: Mode | None, e: WorkingEngine, c: QueuedCall, capacity: int, lat_cap: int
    ) -> bool:
        load = e.load
        if kind == "latency" and mode == "throughput" and self.mixed_scope:
            # Latency work joins throughput work that is within the latency cap.
            return load <= min(lat_cap, capacity) and load + c.tokens <= capacity
        if load + c.tokens <= self.cap(kind, mode, capacity, lat_cap):
            return True
        batching = self.batching
        if batching is not None and batching.open and mode != "throughput" and self.critical(c, kind):
            return batching.admits(e, c, capacity, lat_cap)
        return False

    # -- the round
    def begin_round(self, index: EngineIndex, queue: Sequence[QueuedCall]) -> None:
        if self.batching is not None:
            queued = sum(1 for c in queue if self.critical(c, self.work_of(c)[0]))
            self.batching.begin_round(index, queued)

    def end_round(self) -> None:
        if self.batching is not None:
            self.batching.open = False

    def choose(self, index: EngineIndex, c: QueuedCall, kind: Mode, group: str | None) -> Choice:
        if group is not None:
            eng, reason = self._task_group(index, c, kind, group)
            if eng is not None:
                return eng, reason
        for h in reversed(c.prefix_hashes):
            eng, reason = self._prefix(index, c, kind, h)
            if eng is not None:
                return eng, reason
        return self._find_engine(index, c, kind)

    def _task_group(self, index: EngineIndex, c: QueuedCall, kind: Mode, group: str) -> Choice:
        """Step 1: the least-loaded engine running (or given this round) a member of ``group``
        (with spill: the most loaded, unless another finishes it sooner)."""
        members = index.groups.get(group), index.round_groups.get(group)
        eng = index.pick(*members, c, kind, busiest=self.spill)
        if eng is None:
            return None, "task-group"
        other = self._spill(index, c, kind, eng)
        if other is not None:
            member = any(m is not None and other.id in m for m in members)
            return other, ("task-group" if member else "task-group-spill")
        return eng, "task-group"

    def _prefix(self, index: EngineIndex, c: QueuedCall, kind: Mode, h: object) -> Choice:
        """Step 2, for one prefix hash ``h``: the least-loaded engine holding it or given a
        call with it this round (with spill: the most loaded, unless another is lighter)."""
        on_engine = index.prefixes.get(h)
        this_round = index.round_prefixes.get(h)
        if on_engine is None and this_round is None:
            return None, "prefix-engine"
        eng = index.pick(on_engine, this_round, c, kind, busiest=self.spill)
        if eng is None:
            return None, "prefix-engine"
        other = self._spill(index, c, kind, eng)
        if other is not None:
            if (on_engine is not None and other.id in on_engine) or (
                this_round is not None and other.id in this_round
            ):
                eng = other  # another holder of the prefix, less loaded
            else:
                return other, "prefix-spill"
        held = on_engine is not None and eng.id in on_engine
        return eng, ("prefix-engine" if held else "prefix-queued")

    def _spill(
        self, index: EngineIndex, c: QueuedCall, kind: Mode, home: WorkingEngine
    ) -> WorkingEngine | None:
        """Under ``affinity_spill``: the least-loaded engine ``f`` that ``c`` fits, if it is not
        ``home`` and ``f.load + c.tokens <= home.load`` (throughput ``c``: and ``<= L(f)``);
        else None."""
        if not self.spill:
            return None
        other = index.least_loaded(c, kind, MODES)
        if other is None or other is home:
            return None
        bound = home.load if kind == "latency" else min(home.load, index.lat(other.snap))
        return other if other.load + c.tokens <= bound else None

    def _find_engine(self, index: EngineIndex, c: QueuedCall, kind: Mode) -> Choice:
        """Step 3: the least-loaded fitting engine of ``c``'s kind or idle, else of the other kind
        (packing: a latency call takes the most loaded engine in latency mode that it fits, and
        an idle engine only when none fits; O(engines in latency mode))."""
        preferred: tuple[Mode | None, ...]
        other: tuple[Mode | None, ...]
        if kind == "latency":
            preferred, other = ("latency", None), ("throughput",)
            if self.pack_latency:
                eng = index.pick(index.latency_engs, None, c, kind, busiest=True)
                if eng is not None:
                    return eng, "find-engine"
        else:
            preferred, other = ("throughput", None), ("latency",)
        eng = index.least_loaded(c, kind, preferred)
        if eng is not None:
            return eng, "find-engine"
        return index.least_loaded(c, kind, other), "find-engine-mixed"

    def unplaced(self, index: EngineIndex, c: QueuedCall, kind: Mode) -> None:
        """Close saturation batching behind a waiting latency call (one some live engine
        serves), and reserve an engine for a call over the cap of every engine that could
        run it: the least loaded, which drains, so the call gets it in a later round."""
        servable = c.model is None or c.model in index.by_model
        if self.batching is not None and servable and self.critical(c, kind):
            self.batching.open = False  # no later latency call overtakes it past a cap
        models = index.by_model if c.model is None else (c.model,)
        for m in models:
            for capacity, max_seq_len, lat_cap in index.shapes.get(m, ()):
                if c.tokens <= max_seq_len and c.tokens <= self.cap(kind, None, capacity, lat_cap):
                    return  # it fits some engine's cap: it waits like any call
        usable = list(index.serving(c))
        if usable:
            index.block(min(usable, key=lambda e: (e.load, e.recency, e.id)))


class NoAffinityPolicy(ParrotPolicy):
    """``no-affinity``: Parrot without steps 1 and 2 (task group, prefix)."""

    name = "no-affinity"
    affinity = False

    def choose(self, index: EngineIndex, c: QueuedCall, kind: Mode, group: str | None) -> Choice:
        return self._find_engine(index, c, kind)


class NoDeductionPolicy(ParrotPolicy):
    """``no-deduction``: Parrot with every call latency-sensitive (objectives ignored, so no
    task groups); prefix affinity stays."""

    name = "no-deduction"

    def work_of(self, c: QueuedCall) -> tuple[Mode, str | None]:
        return "latency", None

    def critical(self, c: QueuedCall, kind: Mode) -> bool:
        return kind == "latency"


POLICY_CLASSES: dict[Policy, type[SchedulingPolicy]] = {
    cls.name: cls
    for cls in (
        ParrotPolicy,
        NoAffinityPolicy,
        NoDeductionPolicy,
        LatencyBaselinePolicy,
        ThroughputBaselinePolicy,
    )
}


def policy_for(config: SchedulerConfig) -> SchedulingPolicy:
    """The policy object for ``config.policy``, configured by ``config``."""
    return POLICY_CLASSES[config.policy](config)

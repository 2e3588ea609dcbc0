"""Application-centric scheduling: Algorithm 1 of the paper as a pure function.

``schedule(queue, engines, config)`` decides, for one scheduling round, which
queued calls go to which engine.  It reads plain snapshots and returns
placements; calls it does not place stay queued.  No I/O, no asyncio, no
engine imports, so the manager and the simulator run the same decisions.
:class:`Scheduler` is the same round over engine state kept between rounds,
so a busy manager pays only for the engines that changed.

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

import heapq
import itertools
from collections.abc import Sequence

from parrot.manager.sched import saturation
from parrot.manager.sched.scheduler_types import (  # the scheduler's vocabulary, re-exported
    CAP_SCOPES,
    DEFAULT_LATENCY_CAP_TOKENS,
    DEFAULT_PREFILL_TOKENS_PER_STEP,
    IN_ROUND,
    MODES,
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


# ------------------------------------------------------------------ helpers
class _Eng:
    """Working copy of one live engine's snapshot: what a round has placed on it so far."""

    __slots__ = ("blocked", "id", "lat_calls", "load", "mode", "recency", "snap", "touched", "version")

    def __init__(self, snap: EngineSnapshot):
        self.snap = snap
        self.id = snap.engine_id
        # New on every change, unique within a Scheduler (an engine that leaves and comes back
        # gets a new _Eng): heap entries of other versions are stale, and two entries never tie.
        self.version = -1
        self.blocked = False
        self.touched = False  # changed by the running round (undone when it ends)
        self.load = snap.token_load
        self.mode: str | None = snap.mode if snap.token_load > 0 else None
        self.recency = snap.last_assigned  # raised by placements of the running round
        self.lat_calls = snap.latency_calls  # latency calls running there or placed this round

    def reset(self) -> None:
        snap = self.snap
        self.load = snap.token_load
        self.mode = snap.mode if snap.token_load > 0 else None
        self.recency = snap.last_assigned
        self.lat_calls = snap.latency_calls


def _matches(model: str | None, eng_model: str) -> bool:
    return model is None or model == eng_model


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


# ---------------------------------------------------------------- schedule
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


def _discard(index: dict[object, dict[str, _Eng]], key: object, engine_id: str) -> None:
    got = index.get(key)
    if got is not None:
        got.pop(engine_id, None)
        if not got:
            del index[key]


class Scheduler:
    """Algorithm 1 over engine state kept from one round to the next.

    :func:`schedule` builds its per-engine structures (load heaps, affinity
    indexes) from the snapshots on every call.  A ``Scheduler`` keeps them:
    :meth:`set_engine`, :meth:`remove_engine` and :meth:`sync` tell it what
    changed (O(1) per engine whose snapshot is unchanged, O(log E + keys)
    per changed one), and :meth:`schedule` runs one round over that state,
    then undoes the round's own bookkeeping (placements are not kept: the
    caller reports each engine's new load with its next snapshot).  For any
    sequence of updates, ``Scheduler(config).schedule(queue)`` returns what
    ``schedule(queue, <its current snapshots>, config)`` returns — it is the
    same code; :func:`schedule` is a fresh ``Scheduler`` used once.
    """

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        config = config or SchedulerConfig()
        self.config = config
        policy = config.policy
        self.baseline = policy.startswith("baseline")
        self.affinity = policy in ("parrot", "no-deduction")
        self.deduction = policy in ("parrot", "no-affinity")
        self.lat_cap = config.latency_cap_tokens  # None: each engine's own
        self.thr_cap = config.throughput_cap
        self.fixed_kind = {"baseline-latency": "latency", "baseline-throughput": "throughput"}.get(policy)
        self.cap_mixed_only = config.latency_cap_scope == "mixed"
        self.affinity_spill = config.affinity_spill
        self.pack_latency = config.pack_latency
        self.saturation = config.saturation_batching and not self.baseline
        self._competing = 0.0  # latency calls per engine this round (running or queued)
        self._saturation_open = False  # no latency call of this round has waited yet

        self._snaps: dict[str, EngineSnapshot] = {}  # every engine it was told of, live or not
        self._engs: dict[str, _Eng] = {}  # live engines
        self._latency_running = 0  # latency calls running over the live engines (their snapshots)
        self._latency_engs: dict[str, _Eng] = {}  # live engines in latency mode (working copies)
        self._by_model: dict[str, dict[str, _Eng]] = {}  # live engines by model
        # model -> {(token_capacity, max_seq_len, latency cap): live engines of that shape}
        self._shapes: dict[str, dict[tuple[int, int, int], int]] = {}
        # heaps[cls] = [(load, recency, engine_id, version, eng)];
        # cls = (model, mode, token_capacity, max_seq_len, latency cap)
        self._heaps: dict[tuple, list] = {}
        self._classes: dict[str | None, dict[str | None, list[tuple]]] = {}
        self._pushes = 0  # heap entries pushed since the heaps were last rebuilt
        self._versions = itertools.count()
        # key -> {engine id: engine}: snapshots' task groups / prefixes, and this round's placements
        self._groups: dict[object, dict[str, _Eng]] = {}
        self._prefixes: dict[object, dict[str, _Eng]] = {}
        self._round_groups: dict[object, dict[str, _Eng]] = {}
        self._round_prefixes: dict[object, dict[str, _Eng]] = {}
        self._touched: list[_Eng] = []
        self._recency = IN_ROUND  # the next placement's recency within the running round

    # -- what it knows of the engines
    @property
    def engines(self) -> list[EngineSnapshot]:
        """The current snapshots (live or not), in the order they were first set."""
        return list(self._snaps.values())

    def sync(self, engines: Sequence[EngineSnapshot]) -> None:
        """Make ``engines`` the whole engine set (unchanged snapshot objects cost O(1)).

        Raises ValueError on a duplicate engine id, before changing anything.
        """
        ids: set[str] = set()
        for s in engines:
            if s.engine_id in ids:
                raise ValueError(f"duplicate engine id {s.engine_id!r}")
            ids.add(s.engine_id)
        if not self._snaps:  # a fresh state (as in schedule()): index everything, heapify once
            for s in engines:
                self._snaps[s.engine_id] = s
                if s.alive:
                    self._add(s)
            self._rebuild_heaps()
            return
        for s in engines:
            self.set_engine(s)
        if len(self._snaps) != len(ids):
            for eid in [eid for eid in self._snaps if eid not in ids]:
                self.remove_engine(eid)

    def set_engine(self, snap: EngineSnapshot) -> None:
        """Add an engine, or replace what is known of one (by ``engine_id``)."""
        eid = snap.engine_id
        previous = self._snaps.get(eid)
        if previous is snap:
            return
        self._snaps[eid] = snap
        e = None if previous is None else self._engs.get(eid)
        if e is not None and (not snap.alive or snap.model != e.snap.model):
            self._drop(e)
            e = None
        if not snap.alive:
            return
        if e is None:
            e = self._add(snap)
        else:
            old = e.snap
            if self._shape(old) != self._shape(snap):
                self._add_shape(old, -1)
                self._add_shape(snap, 1)
            if self.affinity:
                if old.task_groups is not snap.task_groups:
                    self._reindex(self._groups, e, old.task_groups, snap.task_groups)
                if old.prefixes is not snap.prefixes:
                    self._reindex(self._prefixes, e, old.prefixes, snap.prefixes)
            self._latency_running += snap.latency_calls - old.latency_calls
            e.snap = snap
            e.reset()
            e.version = next(self._versions)
        self._push(e)

    def _add(self, snap: EngineSnapshot) -> _Eng:
        """Index a live engine that was not (its heap entry is the caller's to push)."""
        eid = snap.engine_id
        e = _Eng(snap)
        e.version = next(self._versions)
        self._engs[eid] = e
        self._latency_running += snap.latency_calls
        same_model = self._by_model.get(snap.model)
        if same_model is None:
            same_model = self._by_model[snap.model] = {}
        same_model[eid] = e
        self._add_shape(snap, 1)
        if self.affinity:
            if snap.task_groups:
                for k in snap.task_groups:
                    self._groups.setdefault(k, {})[eid] = e
            if snap.prefixes:
                for k in snap.prefixes:
                    self._prefixes.setdefault(k, {})[eid] = e
        return e

    def remove_engine(self, engine_id: str) -> None:
        self._snaps.pop(engine_id, None)
        e = self._engs.get(engine_id)
        if e is not None:
            self._drop(e)

    def _drop(self, e: _Eng) -> None:
        snap = e.snap
        del self._engs[e.id]
        self._latency_engs.pop(e.id, None)
        self._latency_running -= snap.latency_calls
        same_model = self._by_model[snap.model]
        del same_model[e.id]
        if not same_model:
            del self._by_model[snap.model]
        self._add_shape(snap, -1)
        if self.affinity:
            for k in snap.task_groups:
                _discard(self._groups, k, e.id)
            for k in snap.prefixes:
                _discard(self._prefixes, k, e.id)
        e.version = next(self._versions)  # its heap entries are stale for good

    def _lat(self, snap: EngineSnapshot) -> int:
        """The latency cap that applies to an engine: the operator's, else its own."""
        return snap.latency_cap_tokens if self.lat_cap is None else self.lat_cap

    def _shape(self, snap: EngineSnapshot) -> tuple[int, int, int]:
        return (snap.token_capacity, snap.max_seq_len, self._lat(snap))

    def _add_shape(self, snap: EngineSnapshot, n: int) -> None:
        shapes = self._shapes.get(snap.model)
        if shapes is None:
            shapes = self._shapes[snap.model] = {}
        shape = self._shape(snap)
        count = shapes.get(shape, 0) + n
        if count:
            shapes[shape] = count
        else:
            del shapes[shape]
            if not shapes:
                del self._shapes[snap.model]

    @staticmethod
    def _reindex(index: dict[object, dict[str, _Eng]], e: _Eng, old: frozenset, new: frozenset) -> None:
        for k in old - new:
            _discard(index, k, e.id)
        for k in new - old:
            index.setdefault(k, {})[e.id] = e

    def unservable(self, queue: Sequence[QueuedCall]) -> list[tuple[str, str]]:
        """:func:`unservable` over the current snapshots."""
        longest = {model: max(shape[1] for shape in shapes) for model, shapes in self._shapes.items()}
        return _unservable(queue, longest)

    # -- caps and fit
    def _cap(self, kind: str, mode: str | None, capacity: int, lat_cap: int) -> int:
        """The cap for a call of ``kind`` on an engine in ``mode`` (``lat_cap``: its latency cap)."""
        if self.fixed_kind is not None:
            kind = self.fixed_kind
        elif self.cap_mixed_only:
            if kind == "latency":
                return capacity  # latency work batches like any server's (see _room for mode "throughput")
            if mode == "latency":
                kind = "latency"  # throughput work next to latency work
        elif mode == "latency":
            kind = "latency"
        if kind == "latency":
            return min(lat_cap, capacity)
        return capacity if self.thr_cap is None else min(self.thr_cap, capacity)

    def _room(self, kind: str, mode: str | None, e: _Eng, c: QueuedCall, capacity: int, lat_cap: int) -> bool:
        """Whether call ``c`` (as work of ``kind``) fits engine ``e`` in ``mode`` (its load,
        its latency calls; ``capacity``, ``lat_cap``: its token capacity and latency cap)."""
        load, tokens = e.load, c.tokens
        if kind == "latency" and mode == "throughput" and self.cap_mixed_only and self.fixed_kind is None:
            # Latency work joins throughput work that is within the latency cap.
            return load <= min(lat_cap, capacity) and load + tokens <= capacity
        if load + tokens <= self._cap(kind, mode, capacity, lat_cap):
            return True
        saturating = self._saturation_open and mode != "throughput" and not self.cap_mixed_only
        if saturating and self._critical(c, kind):
            # latency calls queue: up to the batch that finishes them soonest, within the capacity
            per_step = self._prefill_tokens_per_step(e.snap)
            k = saturation.batch_calls(
                self._competing, tokens, c.new_tokens, lat_cap, per_step, c.shared_tokens
            )
            return e.lat_calls + 1 <= k and load + tokens <= capacity
        return False

    def _critical(self, c: QueuedCall, kind: str) -> bool:
        """Whether ``c`` (as work of ``kind``) is on a latency-sensitive call's critical path:
        latency work, or (with deduction) a member of a task group."""
        return kind == "latency" or (self.deduction and c.objective.task_group is not None)

    def _prefill_tokens_per_step(self, snap: EngineSnapshot) -> float:
        """The operator's figure, else the engine's own, else the default."""
        return (
            self.config.prefill_tokens_per_step
            or snap.prefill_tokens_per_step
            or DEFAULT_PREFILL_TOKENS_PER_STEP
        )

    def _fits(self, e: _Eng, c: QueuedCall, kind: str) -> bool:
        s = e.snap
        return (
            not e.blocked
            and _matches(c.model, s.model)
            and c.tokens <= s.max_seq_len
            and (e.load == 0 or self._room(kind, e.mode, e, c, s.token_capacity, self._lat(s)))
        )

    # -- heap index
    def _push(self, e: _Eng) -> None:
        s = e.snap
        mode = None if self.baseline else e.mode  # baselines ignore modes: one tier
        cls = (s.model, mode, s.token_capacity, s.max_seq_len, self._lat(s))
        heap = self._heaps.get(cls)
        if heap is None:
            heap = self._heaps[cls] = []
            self._classes.setdefault(s.model, {}).setdefault(mode, []).append(cls)
        heapq.heappush(heap, (e.load, e.recency, e.id, e.version, e))
        self._pushes += 1
        if mode == "latency":
            self._latency_engs[e.id] = e
        else:
            self._latency_engs.pop(e.id, None)

    def _rebuild_heaps(self) -> None:
        """One current entry per live engine: drops stale entries (and classes no live engine has)."""
        heaps: dict[tuple, list] = {}
        classes: dict[str | None, dict[str | None, list[tuple]]] = {}
        baseline = self.baseline
        for e in self._engs.values():
            s = e.snap
            mode = None if baseline else e.mode
            cls = (s.model, mode, s.token_capacity, s.max_seq_len, self._lat(s))
            heap = heaps.get(cls)
            if heap is None:
                heap = heaps[cls] = []
                classes.setdefault(s.model, {}).setdefault(mode, []).append(cls)
            heap.append((e.load, e.recency, e.id, e.version, e))
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps, self._classes, self._pushes = heaps, classes, 0
        self._latency_engs = {} if baseline else {e.id: e for e in self._engs.values() if e.mode == "latency"}

    def _top(self, cls: tuple) -> tuple | None:
        heap = self._heaps[cls]
        while heap:
            top = heap[0]
            e = top[4]
            if top[3] == e.version and not e.blocked:
                return top
            heapq.heappop(heap)
        return None

    def _least_loaded(self, c: QueuedCall, kind: str, modes: tuple) -> _Eng | None:
        """Least-loaded engine (ties by recency, then id) in one of ``modes`` that ``c`` fits."""
        best = None
        models = self._classes if c.model is None else (c.model,)
        for model in models:
            by_mode = self._classes.get(model)
            if by_mode is None:
                continue
            for mode in modes:
                for cls in by_mode.get(mode, ()):
                    if c.tokens > cls[3]:
                        continue
                    top = self._top(cls)
                    if top is None:
                        continue
                    if top[0] and not self._room(kind, mode, top[4], c, cls[2], cls[4]):
                        # the same cap in the class: nothing else here fits either (saturation
                        # batching also counts calls: a less loaded engine running more latency
                        # calls would not fit; one running fewer may, and waits a round)
                        continue
                    if best is None or top[:3] < best[:3]:
                        best = top
        return None if best is None else best[4]

    def _pick(
        self,
        held: dict[str, _Eng] | None,
        placed: dict[str, _Eng] | None,
        c: QueuedCall,
        kind: str,
        busiest: bool = False,
    ) -> _Eng | None:
        """Least-loaded (``busiest``: most loaded) engine among ``held`` and ``placed`` that ``c``
        fits; ties by recency, then id."""
        best = None
        best_key: tuple | None = None
        for group in (held, placed):
            if group is None:
                continue
            for e in group.values():
                key = (-e.load if busiest else e.load, e.recency, e.id)
                if self._fits(e, c, kind) and (best_key is None or key < best_key):
                    best, best_key = e, key
        return best

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
        out: list[Placement] = []
        if self.saturation:
            self._competing = self._latency_demand(queue)
            self._saturation_open = True
        try:
            for c in sorted(queue, key=_rank):
                if self.baseline:
                    kind = self.fixed_kind or "latency"
                    group = None
                elif self.deduction:
                    kind = c.objective.kind
                    group = c.objective.task_group
                else:
                    kind, group = "latency", None
                eng, reason = self._choose(c, kind, group)
                if eng is None:
                    if self._critical(c, kind) and (c.model is None or c.model in self._by_model):
                        self._saturation_open = False  # no later latency call overtakes it past a cap
                    self._blocked(c, kind)
                    continue
                self._place(eng, c, kind, group)
                out.append(Placement(c.call_id, eng.id, reason))
        finally:
            self._end_round()
        return out

    def _latency_demand(self, queue: Sequence[QueuedCall]) -> float:
        """Latency calls and task-group members per live engine, running or in ``queue``
        (for saturation batching)."""
        if not self._engs:
            return 0.0
        queued = sum(1 for c in queue if not self.deduction or self._critical(c, c.objective.kind))
        return (queued + self._latency_running) / len(self._engs)

    def _end_round(self) -> None:
        self._saturation_open = False
        for e in self._touched:
            e.touched = e.blocked = False
            e.reset()
            e.version = next(self._versions)
            self._push(e)
        self._touched.clear()
        self._recency = IN_ROUND
        self._round_groups.clear()
        self._round_prefixes.clear()
        if self._pushes > 4 * len(self._engs) + 64:
            self._rebuild_heaps()

    def _choose(self, c: QueuedCall, kind: str, group: str | None) -> tuple[_Eng | None, Reason]:
        if self.baseline:
            return self._least_loaded(c, kind, (None,)), "fifo"
        if self.affinity:
            if group is not None:
                members = self._groups.get(group), self._round_groups.get(group)
                eng = self._pick(*members, c, kind, busiest=self.affinity_spill)
                if eng is not None:
                    other = self._spill(c, kind, eng)
                    if other is not None:
                        member = any(m is not None and other.id in m for m in members)
                        return other, ("task-group" if member else "task-group-spill")
                    return eng, "task-group"
            for h in reversed(c.prefix_hashes):
                on_engine = self._prefixes.get(h)
                this_round = self._round_prefixes.get(h)
                if on_engine is None and this_round is None:
                    continue
                eng = self._pick(on_engine, this_round, c, kind, busiest=self.affinity_spill)
                if eng is not None:
                    other = self._spill(c, kind, eng)
                    if other is not None:
                        if (on_engine is not None and other.id in on_engine) or (
                            this_round is not None and other.id in this_round
                        ):
                            eng = other  # another holder of the prefix, less loaded
                        else:
                            return other, "prefix-spill"
                    held = on_engine is not None and eng.id in on_engine
                    return eng, ("prefix-engine" if held else "prefix-queued")
        return self._find_engine(c, kind)

    def _spill(self, c: QueuedCall, kind: str, home: _Eng) -> _Eng | None:
        """Under ``affinity_spill``: the least-loaded engine ``f`` that ``c`` fits, if it is not
        ``home`` and ``f.load + c.tokens <= home.load`` (throughput ``c``: and ``<= L(f)``);
        else None."""
        if not self.affinity_spill:
            return None
        other = self._least_loaded(c, kind, MODES)
        if other is None or other is home:
            return None
        bound = home.load if kind == "latency" else min(home.load, self._lat(other.snap))
        return other if other.load + c.tokens <= bound else None

    def _find_engine(self, c: QueuedCall, kind: str) -> tuple[_Eng | None, Reason]:
        """Step 3: the least-loaded fitting engine of ``c``'s kind or idle, else of the other kind
        (packing: a latency call takes the most loaded engine in latency mode that it fits, and
        an idle engine only when none fits; O(engines in latency mode))."""
        if kind == "latency":
            preferred, other = ("latency", None), ("throughput",)
            if self.pack_latency:
                eng = self._pick(self._latency_engs, None, c, kind, busiest=True)
                if eng is not None:
                    return eng, "find-engine"
        else:
            preferred, other = ("throughput", None), ("latency",)
        eng = self._least_loaded(c, kind, preferred)
        if eng is not None:
            return eng, "find-engine"
        return self._least_loaded(c, kind, other), "find-engine-mixed"

    def _touch(self, e: _Eng) -> None:
        if not e.touched:
            e.touched = True
            self._touched.append(e)

    def _place(self, e: _Eng, c: QueuedCall, kind: str, group: str | None) -> None:
        self._touch(e)
        e.load += c.tokens
        if kind == "latency":
            e.lat_calls += 1
        e.recency = self._recency
        self._recency += 1
        if kind == "latency":
            e.mode = "latency"
        elif e.mode is None:
            e.mode = "throughput"
        e.version = next(self._versions)
        self._push(e)
        if self.affinity:
            if group is not None:
                self._round_groups.setdefault(group, {})[e.id] = e
            for h in c.prefix_hashes:
                self._round_prefixes.setdefault(h, {})[e.id] = e

    def _block(self, e: _Eng) -> None:
        self._touch(e)
        e.blocked = True
        e.version = next(self._versions)

    def _blocked(self, c: QueuedCall, kind: str) -> None:
        """Called for a call that was not placed: FIFO blocking / drain reservation."""
        models = self._by_model if c.model is None else (c.model,)
        if self.baseline:  # FIFO: nobody overtakes c on the engines it waits for
            for m in models:
                for e in self._by_model.get(m, {}).values():
                    if not e.blocked and c.tokens <= e.snap.max_seq_len:
                        self._block(e)
            return
        # Drain reservation, only for a call over the cap of every engine that could run it.
        for m in models:
            for capacity, max_seq_len, lat_cap in self._shapes.get(m, ()):
                if c.tokens <= max_seq_len and c.tokens <= self._cap(kind, None, capacity, lat_cap):
                    return  # it fits some engine's cap: it waits like any call
        usable = [
            e
            for m in models
            for e in self._by_model.get(m, {}).values()
            if not e.blocked and c.tokens <= e.snap.max_seq_len
        ]
        if usable:
            self._block(min(usable, key=lambda e: (e.load, e.recency, e.id)))

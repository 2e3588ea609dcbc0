"""What the scheduler knows of the engines, indexed for the questions a round asks.

:class:`EngineIndex` keeps a working copy (:class:`WorkingEngine`) of every live
engine's snapshot and the indexes a policy searches: live engines by model, the
engine shapes per model, one load heap per engine class, and (for policies that
place by affinity) which engines run each task group and hold each prefix.  It is
told what changed between rounds (:meth:`EngineIndex.set_engine`,
:meth:`EngineIndex.remove_engine`, :meth:`EngineIndex.sync`) and undoes a round's
own bookkeeping when the round ends (:meth:`EngineIndex.end_round`).

Invariants, between rounds:

- every live engine has exactly one working copy, equal to its snapshot (load,
  mode, recency, latency calls), and exactly one heap entry with its current
  ``version``; other entries are stale and skipped (versions never repeat, so two
  entries never compare equal and a working copy is never compared);
- an engine's class is ``(model, mode, token_capacity, max_seq_len, latency cap)``
  (``mode`` None for every engine of a policy that does not tell modes apart):
  engines of one class share a cap, so the top of its heap, ordered by
  ``(load, recency, engine_id)``, answers "the least loaded that fits";
- an engine reporting load 0 is idle (mode None), whatever mode it reports.

It decides nothing: whether a call has room on an engine is the policy's
``room`` rule, given at construction (:mod:`parrot.manager.sched.policies`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence

from parrot.manager.sched.scheduler_types import IN_ROUND, EngineSnapshot, Mode, QueuedCall

__all__ = ["EngineIndex", "RoomRule", "WorkingEngine"]

EngineClass = tuple[str, Mode | None, int, int, int]
"""``(model, mode, token_capacity, max_seq_len, latency cap)``: engines that share a cap."""

HeapEntry = tuple[int, int, str, int, "WorkingEngine"]
"""``(load, recency, engine_id, version, engine)``; stale unless ``version`` is the engine's."""

AffinityIndex = dict[object, dict[str, "WorkingEngine"]]
"""key (task group or prefix hash) -> {engine id: engine}."""


class WorkingEngine:
    """Working copy of one live engine's snapshot: what a round has placed on it so far.

    ``load``, ``mode``, ``recency`` and ``lat_calls`` start as the snapshot says and
    grow with the round's placements; :meth:`reset` puts them back.  ``blocked``: it
    takes no new work for the rest of the round.
    """

    __slots__ = ("blocked", "id", "lat_calls", "load", "mode", "recency", "snap", "touched", "version")

    def __init__(self, snap: EngineSnapshot) -> None:
        self.snap = snap
        self.id = snap.engine_id
        # New on every change, unique within an index (an engine that leaves and comes back
        # gets a new WorkingEngine): heap entries of other versions are stale.
        self.version = -1
        self.blocked = False
        self.touched = False  # changed by the running round (undone when it ends)
        self.load = snap.token_load
        self.mode: Mode | None = snap.mode if snap.token_load > 0 else None
        self.recency = snap.last_assigned  # raised by placements of the running round
        self.lat_calls = snap.latency_calls  # latency calls running there or placed this round

    def reset(self) -> None:
        """Back to what the snapshot says (the round's placements forgotten)."""
        snap = self.snap
        self.load = snap.token_load
        self.mode = snap.mode if snap.token_load > 0 else None
        self.recency = snap.last_assigned
        self.lat_calls = snap.latency_calls


RoomRule = Callable[[Mode, Mode | None, WorkingEngine, QueuedCall, int, int], bool]
"""``room(kind, mode, engine, call, token_capacity, latency_cap)``: whether ``call``, as
work of ``kind``, has room on a loaded ``engine`` in ``mode`` (a policy's rule)."""


def matches(model: str | None, eng_model: str) -> bool:
    """Whether a call for ``model`` (None: any) may run on an engine serving ``eng_model``."""
    return model is None or model == eng_model


def _discard(index: AffinityIndex, key: object, engine_id: str) -> None:
    got = index.get(key)
    if got is not None:
        got.pop(engine_id, None)
        if not got:
            del index[key]


class EngineIndex:
    """The live engines' working copies and the indexes over them (module docstring).

    ``latency_cap``: the operator's latency cap for every engine (None: each engine's
    own); ``tiered``: heaps tell engines apart by mode (False: one tier, as the
    request-level baselines see them); ``affinity``: keep the task-group and prefix
    indexes; ``room``: the policy's rule for a call's room on a loaded engine.
    """

    def __init__(self, latency_cap: int | None, tiered: bool, affinity: bool, room: RoomRule) -> None:
        self.latency_cap = latency_cap
        self.tiered = tiered
        self.affinity = affinity
        self.room = room
        self.snaps: dict[str, EngineSnapshot] = {}  # every engine it was told of, live or not
        self.engs: dict[str, WorkingEngine] = {}  # live engines
        self.latency_running = 0  # latency calls running over the live engines (their snapshots)
        self.latency_engs: dict[str, WorkingEngine] = {}  # live engines in latency mode (working copies)
        self.by_model: dict[str, dict[str, WorkingEngine]] = {}  # live engines by model
        # model -> {(token_capacity, max_seq_len, latency cap): live engines of that shape}
        self.shapes: dict[str, dict[tuple[int, int, int], int]] = {}
        self._heaps: dict[EngineClass, list[HeapEntry]] = {}
        self._classes: dict[str | None, dict[Mode | None, list[EngineClass]]] = {}
        self._pushes = 0  # heap entries pushed since the heaps were last rebuilt
        self._versions = itertools.count()
        # snapshots' task groups / prefixes, and this round's placements
        self.groups: AffinityIndex = {}
        self.prefixes: AffinityIndex = {}
        self.round_groups: AffinityIndex = {}
        self.round_prefixes: AffinityIndex = {}
        self._touched: list[WorkingEngine] = []
        self._recency = IN_ROUND  # the next placement's recency within the running round

    # -- what it knows of the engines
    def sync(self, engines: Sequence[EngineSnapshot]) -> None:
        """Make ``engines`` the whole engine set (unchanged snapshot objects cost O(1)).

        Raises ValueError on a duplicate engine id, before changing anything.
        """
        ids: set[str] = set()
        for s in engines:
            if s.engine_id in ids:
                raise ValueError(f"duplicate engine id {s.engine_id!r}")
            ids.add(s.engine_id)
        if not self.snaps:  # a fresh state (as in schedule()): index everything, heapify once
            for s in engines:
                self.snaps[s.engine_id] = s
                if s.alive:
                    self._add(s)
            self._rebuild_heaps()
            return
        for s in engines:
            self.set_engine(s)
        if len(self.snaps) != len(ids):
            for eid in [eid for eid in self.snaps if eid not in ids]:
                self.remove_engine(eid)

    def set_engine(self, snap: EngineSnapshot) -> None:
        """Add an engine, or replace what is known of one (by ``engine_id``)."""
        eid = snap.engine_id
        previous = self.snaps.get(eid)
        if previous is snap:
            return
        self.snaps[eid] = snap
        e = None if previous is None else self.engs.get(eid)
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
                    self._reindex(self.groups, e, old.task_groups, snap.task_groups)
                if old.prefixes is not snap.prefixes:
                    self._reindex(self.prefixes, e, old.prefixes, snap.prefixes)
            self.latency_running += snap.latency_calls - old.latency_calls
            e.snap = snap
            e.reset()
            e.version = next(self._versions)
        self._push(e)

    def remove_engine(self, engine_id: str) -> None:
        """Forget an engine (nothing happens for one it was not told of)."""
        self.snaps.pop(engine_id, None)
        e = self.engs.get(engine_id)
        if e is not None:
            self._drop(e)

    def _add(self, snap: EngineSnapshot) -> WorkingEngine:
        """Index a live engine that was not (its heap entry is the caller's to push)."""
        eid = snap.engine_id
        e = WorkingEngine(snap)
        e.version = next(self._versions)
        self.engs[eid] = e
        self.latency_running += snap.latency_calls
        same_model = self.by_model.get(snap.model)
        if same_model is None:
            same_model = self.by_model[snap.model] = {}
        same_model[eid] = e
        self._add_shape(snap, 1)
        if self.affinity:
            if snap.task_groups:
                for k in snap.task_groups:
                    self.groups.setdefault(k, {})[eid] = e
            if snap.prefixes:
                for k in snap.prefixes:
                    self.prefixes.setdefault(k, {})[eid] = e
        return e

    def _drop(self, e: WorkingEngine) -> None:
        snap = e.snap
        del self.engs[e.id]
        self.latency_engs.pop(e.id, None)
        self.latency_running -= snap.latency_calls
        same_model = self.by_model[snap.model]
        del same_model[e.id]
        if not same_model:
            del self.by_model[snap.model]
        self._add_shape(snap, -1)
        if self.affinity:
            for k in snap.task_groups:
                _discard(self.groups, k, e.id)
            for k in snap.prefixes:
                _discard(self.prefixes, k, e.id)
        e.version = next(self._versions)  # its heap entries are stale for good

    def lat(self, snap: EngineSnapshot) -> int:
        """The latency cap that applies to an engine: the operator's, else its own."""
        return snap.latency_cap_tokens if self.latency_cap is None else self.latency_cap

    def _shape(self, snap: EngineSnapshot) -> tuple[int, int, int]:
        return (snap.token_capacity, snap.max_seq_len, self.lat(snap))

    def _add_shape(self, snap: EngineSnapshot, n: int) -> None:
        shapes = self.shapes.get(snap.model)
        if shapes is None:
            shapes = self.shapes[snap.model] = {}
        shape = self._shape(snap)
        count = shapes.get(shape, 0) + n
        if count:
            shapes[shape] = count
        else:
            del shapes[shape]
            if not shapes:
                del self.shapes[snap.model]

    @staticmethod
    def _reindex(index: AffinityIndex, e: WorkingEngine, old: frozenset, new: frozenset) -> None:
        for k in old - new:
            _discard(index, k, e.id)
        for k in new - old:
            index.setdefault(k, {})[e.id] = e

    def serving(self, c: QueuedCall) -> Iterator[WorkingEngine]:
        """Live engines that serve ``c``'s model, are not blocked and take its length."""
        models = self.by_model if c.model is None else (c.model,)
        for m in models:
            for e in self.by_model.get(m, {}).values():
                if not e.blocked and c.tokens <= e.snap.max_seq_len:
                    yield e

    # -- heap index
    def _push(self, e: WorkingEngine) -> None:
        s = e.snap
        mode = e.mode if self.tiered else None
        cls = (s.model, mode, s.token_capacity, s.max_seq_len, self.lat(s))
        heap = self._heaps.get(cls)
        if heap is None:
            heap = self._heaps[cls] = []
            self._classes.setdefault(s.model, {}).setdefault(mode, []).append(cls)
        heapq.heappush(heap, (e.load, e.recency, e.id, e.version, e))
        self._pushes += 1
        if mode == "latency":
            self.latency_engs[e.id] = e
        else:
            self.latency_engs.pop(e.id, None)

    def _rebuild_heaps(self) -> None:
        """One current entry per live engine: drops stale entries (and classes no live engine has)."""
        heaps: dict[EngineClass, list[HeapEntry]] = {}
        classes: dict[str | None, dict[Mode | None, list[EngineClass]]] = {}
        tiered = self.tiered
        for e in self.engs.values():
            s = e.snap
            mode = e.mode if tiered else None
            cls = (s.model, mode, s.token_capacity, s.max_seq_len, self.lat(s))
            heap = heaps.get(cls)
            if heap is None:
                heap = heaps[cls] = []
                classes.setdefault(s.model, {}).setdefault(mode, []).append(cls)
            heap.append((e.load, e.recency, e.id, e.version, e))
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps, self._classes, self._pushes = heaps, classes, 0
        self.latency_engs = {e.id: e for e in self.engs.values() if e.mode == "latency"} if tiered else {}

    def _top(self, cls: EngineClass) -> HeapEntry | None:
        heap = self._heaps[cls]
        while heap:
            top = heap[0]
            e = top[4]
            if top[3] == e.version and not e.blocked:
                return top
            heapq.heappop(heap)
        return None

    # -- searches
    def fits(self, e: WorkingEngine, c: QueuedCall, kind: Mode) -> bool:
        """Whether ``c`` (as work of ``kind``) may go to ``e`` now: not blocked, its model, its
        length, and room under the policy's rule, or ``e`` idle (the big-call rule)."""
        s = e.snap
        return (
            not e.blocked
            and matches(c.model, s.model)
            and c.tokens <= s.max_seq_len
            and (e.load == 0 or self.room(kind, e.mode, e, c, s.token_capacity, self.lat(s)))
        )

    def least_loaded(self, c: QueuedCall, kind: Mode, modes: tuple[Mode | None, ...]) -> WorkingEngine | None:
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
                    if top[0] and not self.room(kind, mode, top[4], c, cls[2], cls[4]):
                        # the same cap in the class: nothing else here fits either (saturation
                        # batching also counts calls: a less loaded engine running more latency
                        # calls would not fit; one running fewer may, and waits a round)
                        continue
                    if best is None or top[:3] < best[:3]:
                        best = top
        return None if best is None else best[4]

    def pick(
        self,
        held: dict[str, WorkingEngine] | None,
        placed: dict[str, WorkingEngine] | None,
        c: QueuedCall,
        kind: Mode,
        busiest: bool = False,
    ) -> WorkingEngine | None:
        """Least-loaded (``busiest``: most loaded) engine among ``held`` and ``placed`` that ``c``
        fits; ties by recency, then id."""
        best = None
        best_key: tuple[int, int, str] | None = None
        for group in (held, placed):
            if group is None:
                continue
            for e in group.values():
                key = (-e.load if busiest else e.load, e.recency, e.id)
                if self.fits(e, c, kind) and (best_key is None or key < best_key):
                    best, best_key = e, key
        return best

    # -- the round's bookkeeping
    def _touch(self, e: WorkingEngine) -> None:
        if not e.touched:
            e.touched = True
            self._touched.append(e)

    def place(self, e: WorkingEngine, c: QueuedCall, kind: Mode, group: str | None) -> None:
        """Record ``c`` (as work of ``kind``, in task ``group``) on ``e`` for the rest of the
        round: its load, latency calls, mode (``"latency"`` with latency work, else
        ``"throughput"`` if it was idle), recency, and the call's group and prefixes."""
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
                self.round_groups.setdefault(group, {})[e.id] = e
            for h in c.prefix_hashes:
                self.round_prefixes.setdefault(h, {})[e.id] = e

    def block(self, e: WorkingEngine) -> None:
        """``e`` takes no new work for the rest of the round."""
        self._touch(e)
        e.blocked = True
        e.version = next(self._versions)

    def end_round(self) -> None:
        """Undo the round's bookkeeping: every touched engine back to its snapshot."""
        for e in self._touched:
            e.touched = e.blocked = False
            e.reset()
            e.version = next(self._versions)
            self._push(e)
        self._touched.clear()
        self._recency = IN_ROUND
        self.round_groups.clear()
        self.round_prefixes.clear()
        if self._pushes > 4 * len(self.engs) + 64:
            self._rebuild_heaps()

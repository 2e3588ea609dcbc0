"""Application-centric scheduling: Algorithm 1 of the paper as a pure function.

``schedule(queue, engines, config)`` decides, for one scheduling round, which
queued calls go to which engine.  It reads plain snapshots and returns
placements; calls it does not place stay queued.  No I/O, no asyncio, no
engine imports, so a simulator can reuse it unchanged.

Caps.  ``cap_L(e) = min(latency_cap_tokens, e.token_capacity)`` bounds an
engine that runs latency-sensitive work; ``cap_T(e) = e.token_capacity``
(or ``min(throughput_cap, e.token_capacity)``) bounds one that runs only
throughput work.  Under ``parrot`` the cap that applies when placing call
``c`` on ``e`` is ``cap_L`` if ``c`` is latency-sensitive *or* ``e`` already
runs latency work (mode ``"latency"``), else ``cap_T``; the baselines apply
one cap to everything.  A call *fits* ``e`` when ``e`` is alive, serves the
call's model, ``c.tokens <= e.max_seq_len``, and either
``e.load + c.tokens <= cap`` or ``e`` is idle (load 0).  The idle clause is
the *big-call rule*: a call larger than the cap runs alone on an idle engine
(nothing else fits next to it, because the engine is then over its cap) —
never starve a big call.

Algorithm (policy ``parrot``).  Sort the queue by ``topo_rank`` (stable:
producers first, then arrival).  For each call ``c``:

1. *task group* — if ``c`` is in a task group and engines run (or were given
   this round) members of it: the least-loaded of them that ``c`` fits;
2. *prefix* — for each of ``c``'s prefix hashes, longest first: the engines
   that hold that prefix (a context on the engine, ``prefix-engine``, or a
   call placed there this round, ``prefix-queued``); the least-loaded that
   ``c`` fits;
3. *FindEngine* — latency-sensitive ``c``: the least-loaded fitting engine in
   latency mode or idle (mode None); only if none fits, a fitting engine in
   throughput mode (``find-engine-mixed``; its cap drops to ``cap_L``).
   Throughput ``c``: the least-loaded fitting engine in throughput mode or
   idle; only if none fits, one in latency mode (under ``cap_L``).

Ties are broken by ``engine_id``, so results do not depend on the order of
``engines``.  Each placement updates a working copy of its engine (load +=
tokens; mode becomes ``"latency"`` with latency work, ``"throughput"`` if it
was idle; the call's task group and prefix hashes are recorded), so later
decisions in the round see it.  An engine reporting load 0 is treated as
idle (mode None).

Drain reservation (``parrot`` and the ablations).  A call that is not placed
and is larger than the cap of *every* engine that could ever run it can only
run on an idle engine; it reserves the least-loaded such engine (ties by id),
which then takes no new work for the rest of the round, so it drains and the
big call gets it in a later round.

Policies:

- ``parrot``: all of the above;
- ``no-affinity``: skip steps 1 and 2;
- ``no-deduction``: every call is latency-sensitive (objective ignored, so no
  task groups); prefix affinity stays;
- ``baseline-latency``: request-level FIFO in ``topo_rank`` order to the
  least-loaded engine (fewest tokens), ``cap_L`` for everything, no modes, no
  affinity.  FIFO means no overtaking: a call that does not fit blocks every
  engine it could run on for the rest of the round (as an engine's FCFS queue
  would);
- ``baseline-throughput``: the same with ``cap_T`` for everything.

Cost: O(Q log Q) for the sort plus, per call, O(H + log E) where H is the
number of (model, mode, capacity, max_seq_len) classes of engines (a handful)
— engines of one class share a cap, so a heap ordered by load answers "least
loaded that fits" from its top.  Affinity look-ups are dict hits.  No O(Q²).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from parrot.manager.objectives import CallObjective

Mode = Literal["latency", "throughput"]
Policy = Literal["parrot", "no-affinity", "no-deduction", "baseline-latency", "baseline-throughput"]
POLICIES: tuple[Policy, ...] = (
    "parrot",
    "no-affinity",
    "no-deduction",
    "baseline-latency",
    "baseline-throughput",
)
Reason = Literal["task-group", "prefix-queued", "prefix-engine", "find-engine", "find-engine-mixed", "fifo"]
_MODES = ("latency", "throughput", None)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What the scheduler knows of one engine at the start of a round.

    ``mode`` is the kind of work it runs now: ``"latency"`` if any running
    call is latency-sensitive (its cap is then ``cap_L``), ``"throughput"`` if
    it runs only throughput work, None if idle.  ``token_load`` counts KV
    tokens of work running or already assigned there.
    """

    engine_id: str
    model: str
    max_seq_len: int
    token_capacity: int
    token_load: int = 0
    mode: Mode | None = None
    task_groups: frozenset[str] = frozenset()
    prefixes: frozenset[object] = frozenset()
    alive: bool = True

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError("engine_id must be non-empty")
        if self.max_seq_len <= 0 or self.token_capacity <= 0:
            raise ValueError(f"engine {self.engine_id}: max_seq_len and token_capacity must be positive")
        if self.token_load < 0:
            raise ValueError(f"engine {self.engine_id}: token_load must be >= 0")
        if self.mode not in _MODES:
            raise ValueError(f"engine {self.engine_id}: mode must be one of {_MODES}, got {self.mode!r}")


@dataclass(frozen=True, slots=True)
class QueuedCall:
    """A ready call waiting for an engine.

    ``model`` None: any engine.  ``prefix_hashes``: hashes of the prompt's
    prefixes at variable boundaries, outermost (shortest) first.  ``tokens``:
    estimated KV tokens (prompt + max new tokens).  ``topo_rank``: an integer
    order in which producers come before consumers (then arrival).
    """

    call_id: str
    model: str | None
    objective: CallObjective
    prefix_hashes: tuple[object, ...] = ()
    tokens: int = 1
    topo_rank: int = 0

    def __post_init__(self) -> None:
        if not self.call_id:
            raise ValueError("call_id must be non-empty")
        if self.tokens <= 0:
            raise ValueError(f"call {self.call_id}: tokens must be positive, got {self.tokens}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: Policy = "parrot"
    latency_cap_tokens: int = 6144
    throughput_cap: int | None = None  # None: each engine's token_capacity

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.latency_cap_tokens <= 0:
            raise ValueError("latency_cap_tokens must be positive")
        if self.throughput_cap is not None and self.throughput_cap <= 0:
            raise ValueError("throughput_cap must be positive (or None)")


@dataclass(frozen=True, slots=True)
class Placement:
    call_id: str
    engine_id: str
    reason: Reason


# ------------------------------------------------------------------ helpers
class _Eng:
    """Mutable working copy of a snapshot for one round."""

    __slots__ = ("blocked", "id", "load", "mode", "snap", "version")

    def __init__(self, snap: EngineSnapshot):
        self.snap = snap
        self.id = snap.engine_id
        self.load = snap.token_load
        self.mode: str | None = snap.mode if snap.token_load > 0 else None
        self.version = 0
        self.blocked = False


class _Affinity:
    """key -> engines holding it: from the snapshots' ``attr`` sets, and from this round's placements."""

    def __init__(self, engs: list[_Eng], attr: str, queue_len: int):
        self.engs = engs
        self.attr = attr
        self.round: dict[object, dict[str, _Eng]] = {}
        total = sum(len(getattr(e.snap, attr)) for e in engs)
        # Build the inverse index only when it is cheaper than scanning per look-up.
        self.index: dict[object, list[_Eng]] | None = None
        if total and total <= queue_len * len(engs):
            self.index = {}
            for e in engs:
                for k in getattr(e.snap, attr):
                    self.index.setdefault(k, []).append(e)
        self.empty = total == 0

    def from_snapshot(self, key: object) -> list[_Eng]:
        if self.empty:
            return []
        if self.index is not None:
            return self.index.get(key, [])
        attr = self.attr
        return [e for e in self.engs if key in getattr(e.snap, attr)]

    def this_round(self, key: object) -> list[_Eng]:
        got = self.round.get(key)
        return [] if got is None else list(got.values())

    def add(self, key: object, eng: _Eng) -> None:
        got = self.round.get(key)
        if got is None:
            self.round[key] = {eng.id: eng}
        else:
            got[eng.id] = eng


def _matches(model: str | None, eng_model: str) -> bool:
    return model is None or model == eng_model


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


# ---------------------------------------------------------------- schedule
def schedule(
    queue: Sequence[QueuedCall], engines: Sequence[EngineSnapshot], config: SchedulerConfig | None = None
) -> list[Placement]:
    """One scheduling round; see the module docstring for the algorithm.

    Returns placements in decision order.  Raises ValueError on duplicate
    call or engine ids.
    """
    return _Round(queue, engines, config or SchedulerConfig()).run()


class _Round:
    def __init__(
        self, queue: Sequence[QueuedCall], engines: Sequence[EngineSnapshot], config: SchedulerConfig
    ) -> None:
        seen: set[str] = set()
        for e in engines:
            if e.engine_id in seen:
                raise ValueError(f"duplicate engine id {e.engine_id!r}")
            seen.add(e.engine_id)
        calls_seen: set[str] = set()
        for c in queue:
            if c.call_id in calls_seen:
                raise ValueError(f"duplicate call id {c.call_id!r}")
            calls_seen.add(c.call_id)

        policy = config.policy
        self.queue = sorted(queue, key=lambda c: c.topo_rank)
        self.baseline = policy.startswith("baseline")
        self.affinity = policy in ("parrot", "no-deduction")
        self.deduction = policy in ("parrot", "no-affinity")
        self.lat_cap = config.latency_cap_tokens
        self.thr_cap = config.throughput_cap
        self.fixed_kind = {"baseline-latency": "latency", "baseline-throughput": "throughput"}.get(policy)

        self.engs = [_Eng(s) for s in engines if s.alive]
        # heaps[cls] = [(load, engine_id, version, eng)]; cls = (model, mode, token_capacity, max_seq_len)
        self.heaps: dict[tuple, list] = {}
        self.classes: dict[str | None, dict[str | None, list[tuple]]] = {}
        self.unblocked: dict[str, set[_Eng]] = {}
        for e in self.engs:
            self._push(e)
            self.unblocked.setdefault(e.snap.model, set()).add(e)
        self.groups = _Affinity(self.engs, "task_groups", len(self.queue)) if self.affinity else None
        self.prefixes = _Affinity(self.engs, "prefixes", len(self.queue)) if self.affinity else None

    # -- caps and fit
    def _cap(self, kind: str, mode: str | None, capacity: int) -> int:
        if self.fixed_kind is not None:
            kind = self.fixed_kind
        elif mode == "latency":
            kind = "latency"
        if kind == "latency":
            return min(self.lat_cap, capacity)
        return capacity if self.thr_cap is None else min(self.thr_cap, capacity)

    def _fits(self, e: _Eng, c: QueuedCall, kind: str) -> bool:
        s = e.snap
        return (
            not e.blocked
            and _matches(c.model, s.model)
            and c.tokens <= s.max_seq_len
            and (e.load == 0 or e.load + c.tokens <= self._cap(kind, e.mode, s.token_capacity))
        )

    # -- heap index
    def _push(self, e: _Eng) -> None:
        s = e.snap
        mode = None if self.baseline else e.mode  # baselines ignore modes: one tier
        cls = (s.model, mode, s.token_capacity, s.max_seq_len)
        if cls not in self.heaps:
            self.heaps[cls] = []
            self.classes.setdefault(s.model, {}).setdefault(mode, []).append(cls)
        heapq.heappush(self.heaps[cls], (e.load, e.id, e.version, e))

    def _top(self, cls: tuple) -> tuple | None:
        heap = self.heaps[cls]
        while heap:
            top = heap[0]
            e = top[3]
            if top[2] == e.version and not e.blocked:
                return top
            heapq.heappop(heap)
        return None

    def _least_loaded(self, c: QueuedCall, kind: str, modes: tuple) -> _Eng | None:
        """Least-loaded engine (ties by id) in one of ``modes`` that ``c`` fits."""
        best = None
        models = self.classes if c.model is None else (c.model,)
        for model in models:
            by_mode = self.classes.get(model)
            if by_mode is None:
                continue
            for mode in modes:
                for cls in by_mode.get(mode, ()):
                    if c.tokens > cls[3]:
                        continue
                    top = self._top(cls)
                    if top is None:
                        continue
                    load = top[0]
                    if load and load + c.tokens > self._cap(kind, mode, cls[2]):
                        continue  # same cap in the class: nothing else here fits either
                    if best is None or top[:2] < best[:2]:
                        best = top
        return None if best is None else best[3]

    def _pick(self, candidates: list[_Eng], c: QueuedCall, kind: str) -> _Eng | None:
        best = None
        for e in candidates:
            if self._fits(e, c, kind) and (best is None or (e.load, e.id) < (best.load, best.id)):
                best = e
        return best

    # -- the round
    def run(self) -> list[Placement]:
        out: list[Placement] = []
        for c in self.queue:
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
                self._blocked(c, kind)
                continue
            self._place(eng, c, kind, group)
            out.append(Placement(c.call_id, eng.id, reason))
        return out

    def _choose(self, c: QueuedCall, kind: str, group: str | None) -> tuple[_Eng | None, Reason]:
        if self.baseline:
            return self._least_loaded(c, kind, (None,)), "fifo"
        if self.affinity:
            if group is not None:
                cands = self.groups.from_snapshot(group) + self.groups.this_round(group)
                eng = self._pick(cands, c, kind)
                if eng is not None:
                    return eng, "task-group"
            for h in reversed(c.prefix_hashes):
                on_engine = self.prefixes.from_snapshot(h)
                this_round = self.prefixes.this_round(h)
                eng = self._pick(on_engine + this_round, c, kind)
                if eng is not None:
                    return eng, ("prefix-engine" if eng in on_engine else "prefix-queued")
        if kind == "latency":
            preferred, other = ("latency", None), ("throughput",)
        else:
            preferred, other = ("throughput", None), ("latency",)
        eng = self._least_loaded(c, kind, preferred)
        if eng is not None:
            return eng, "find-engine"
        return self._least_loaded(c, kind, other), "find-engine-mixed"

    def _place(self, e: _Eng, c: QueuedCall, kind: str, group: str | None) -> None:
        e.load += c.tokens
        if kind == "latency":
            e.mode = "latency"
        elif e.mode is None:
            e.mode = "throughput"
        e.version += 1
        self._push(e)
        if self.affinity:
            if group is not None:
                self.groups.add(group, e)
            for h in c.prefix_hashes:
                self.prefixes.add(h, e)

    def _block(self, e: _Eng) -> None:
        e.blocked = True
        e.version += 1
        self.unblocked[e.snap.model].discard(e)

    def _blocked(self, c: QueuedCall, kind: str) -> None:
        """Called for a call that was not placed: FIFO blocking / drain reservation."""
        models = self.unblocked if c.model is None else (c.model,)
        if self.baseline:  # FIFO: nobody overtakes c on the engines it waits for
            for m in models:
                for e in [e for e in self.unblocked.get(m, ()) if c.tokens <= e.snap.max_seq_len]:
                    self._block(e)
            return
        # Drain reservation, only for a call over the cap of every engine that could run it.
        for m in models:
            for by_mode in self.classes.get(m, {}).values():
                for cls in by_mode:
                    if c.tokens <= cls[3] and c.tokens <= self._cap(kind, None, cls[2]):
                        return  # it fits some engine's cap: it waits like any call
        usable = [e for m in models for e in self.unblocked.get(m, ()) if c.tokens <= e.snap.max_seq_len]
        if usable:
            self._block(min(usable, key=lambda e: (e.load, e.id)))

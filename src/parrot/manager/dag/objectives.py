"""Performance objective deduction: which calls want low latency, which want throughput.

The client annotates only *final* variables (``get(criteria=LATENCY)`` or an output's
``criteria``).  :func:`deduce` propagates those annotations backwards through the call
DAG, in reverse topological order over its transitive reduction, and labels every call
of a downward-closed set with a :class:`CallObjective`: latency-sensitive (a chain into
a latency output), a task-group member (parallel producers of a latency call: only the
group's completion matters), throughput, or the default (latency, no group).  The rules
and their precedence, effective producers, merged groups, scope and cost (O(V + E)):
docs/scheduling.md, "How objectives are deduced".

Pure: plain data in, plain data out; no I/O, no asyncio, no engine imports.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

Kind = Literal["latency", "throughput"]
KINDS: tuple[Kind, ...] = ("latency", "throughput")
LATENCY = "LATENCY"
THROUGHPUT = "THROUGHPUT"
_CRITERIA = (LATENCY, THROUGHPUT, None)
DEFAULT_REASON = "default: no LATENCY/THROUGHPUT output downstream"


@dataclass(frozen=True, slots=True)
class CallObjective:
    """The deduced scheduling preference of one call.

    ``task_group`` is set only for throughput work that is a member of a task
    group; ``reason`` says which rule decided (for introspection and tests).
    """

    kind: Kind
    task_group: str | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"objective kind must be one of {KINDS}, got {self.kind!r}")
        if self.task_group is not None and self.kind != "throughput":
            raise ValueError("only throughput work can belong to a task group")

    @property
    def latency_sensitive(self) -> bool:
        return self.kind == "latency"


@dataclass(frozen=True, slots=True)
class CallNode:
    """A call reduced to what deduction needs (what a simulator builds directly).

    ``producers``: the producer call id of each input variable that has one
    (duplicates allowed; client-set variables are simply absent).
    ``criteria``: the criteria of each output variable (None entries allowed).
    """

    call_id: str
    producers: tuple[str, ...] = ()
    criteria: tuple[str | None, ...] = ()


class _VarLike(Protocol):
    producer: object | None  # an object with a ``call_id`` (a graph.Call) or None
    criteria: str | None


class _OutputLike(Protocol):
    var: _VarLike


class CallLike(Protocol):
    """What :func:`deduce` reads from a ``graph.Call`` (duck-typed)."""

    call_id: str
    outputs: Mapping[str, _OutputLike]

    def effective_producers(self) -> tuple[str, ...]: ...


def node_of(call: CallLike | CallNode) -> CallNode:
    """The :class:`CallNode` of a ``graph.Call``-like object, with its effective producers
    (a CallNode is returned as is)."""
    if isinstance(call, CallNode):
        return call
    cid, producers, criteria, _ = _extract(call)
    return CallNode(cid, tuple(producers), tuple(criteria))


def _extract(
    call: CallLike | CallNode,
) -> tuple[str, list[str] | tuple[str, ...], Iterable[str | None], bool]:
    """(id, producers, criteria, whether the producers are already the effective ones)."""
    if isinstance(call, CallNode):
        return call.call_id, call.producers, call.criteria, False
    return call.call_id, call.effective_producers(), [o.var.criteria for o in call.outputs.values()], True


def _reduced(distinct: list[str], producers_of: Callable[[str], Sequence[str]]) -> list[str]:
    """``distinct`` less every id upstream of another of them (walking ``producers_of``)."""
    targets = set(distinct)
    upstream: set[str] = set()
    stack = [p for q in distinct for p in producers_of(q)]
    while stack:
        cid = stack.pop()
        if cid in upstream:
            continue
        upstream.add(cid)
        stack.extend(producers_of(cid))
    return distinct if upstream.isdisjoint(targets) else [p for p in distinct if p not in upstream]


# Internal labels (plain ints for speed).
_LAT, _GROUP, _THR, _DEFAULT = 0, 1, 2, 3
_DEFAULT_OBJECTIVE = CallObjective("latency", None, DEFAULT_REASON)  # immutable: shared by every default call


def deduce(calls: Iterable[CallLike | CallNode]) -> dict[str, CallObjective]:
    """Label every call of a downward-closed set (see the module docstring).  It runs in
    every scheduling round for each changed session, so each phase works on plain lists
    indexed by the calls' order (``docs/manager_overhead.md``).

    Returns ``{call_id: CallObjective}`` for every given call.  Raises
    ValueError on a duplicate call id, an unknown criteria value, or a cycle.
    """
    dag = _read(calls)
    _link(dag)
    marks = _Marks(len(dag.ids))
    _label(dag, marks)
    return _objectives(dag, marks)


@dataclass(slots=True)
class _Dag:
    """The calls as lists indexed by their order in the input.  Invariant after
    :func:`_link`: ``fanin[i]`` counts call i's distinct effective producers, in the set
    or not; ``ups[i]`` lists those in the set (indices); ``pending[j]`` counts j's
    in-set consumers not labelled yet."""

    ids: list[str]
    index: dict[str, int]  # call id -> its index
    own: list[int]  # _LAT / _THR / _DEFAULT from the call's own outputs
    raw: list[list[str] | tuple[str, ...]]  # producer ids as given
    reduced: list[bool]  # whether ``raw`` is already the effective producers
    fanin: list[int] = field(default_factory=list)
    ups: list[list[int]] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Marks:
    """What consumers handed each call (by index), and the labels given.  The first mark of
    each kind wins for the ``reason`` text; labels do not depend on order."""

    n: int
    lat_why: list[str | None] = field(init=False)
    thr_why: list[str | None] = field(init=False)
    groups: list[list[int] | None] = field(init=False)  # consumer indices of a call's groups
    label: list[int] = field(init=False)
    parent: dict[int, int] = field(default_factory=dict)  # union-find over groups, by consumer index

    def __post_init__(self) -> None:
        self.lat_why = [None] * self.n
        self.thr_why = [None] * self.n
        self.groups = [None] * self.n
        self.label = [_DEFAULT] * self.n

    def find(self, g: int) -> int:
        """The group ``g`` was merged into (with path compression)."""
        parent = self.parent
        root = g
        while parent.get(root, root) != root:
            root = parent[root]
        while g != root:
            parent[g], g = root, parent[g]
        return root

    def merge(self, gs: list[int], ids: list[str]) -> None:
        """Merge the groups ``gs`` into one, named by the smallest consumer id."""
        root = self.find(gs[0])
        for g in gs[1:]:
            other = self.find(g)
            if other != root:
                if ids[other] < ids[root]:
                    root, other = other, root
                self.parent[other] = root


def _read(calls: Iterable[CallLike | CallNode]) -> _Dag:
    """The calls' ids, producers and own labels; ValueError on a bad or duplicate id or an
    unknown criteria value."""
    dag = _Dag([], {}, [], [], [])
    ids, index, own = dag.ids, dag.index, dag.own
    for call in calls:
        cid, producers, criteria, is_reduced = _extract(call)
        if not isinstance(cid, str) or not cid:
            raise ValueError(f"call id must be a non-empty string, got {cid!r}")
        if cid in index:
            raise ValueError(f"duplicate call id {cid!r}")
        index[cid] = len(ids)
        ids.append(cid)
        dag.raw.append(producers)
        dag.reduced.append(is_reduced)
        label = _DEFAULT
        for crit in criteria:
            if crit == LATENCY:
                label = _LAT
            elif crit == THROUGHPUT:
                if label == _DEFAULT:
                    label = _THR
            elif crit is not None:
                raise ValueError(f"call {cid!r}: criteria must be one of {_CRITERIA}, got {crit!r}")
        own.append(label)
    return dag


def _link(dag: _Dag) -> None:
    """Each call's effective producers: ``fanin``, ``ups`` and ``pending`` (see
    :class:`_Dag`); ValueError for a call consuming its own output."""
    ids, index, raw, reduced = dag.ids, dag.index, dag.raw, dag.reduced
    fanin, ups = dag.fanin, dag.ups
    pending = dag.pending = [0] * len(ids)

    def producers_of(cid: str) -> Sequence[str]:
        j = index.get(cid)
        return () if j is None else raw[j]

    for i, producers in enumerate(raw):
        distinct = list(dict.fromkeys(producers)) if len(producers) > 1 else producers
        if len(distinct) > 1 and not reduced[i]:
            distinct = _reduced(distinct, producers_of)  # type: ignore[arg-type]
        fanin.append(len(distinct))
        inset = [index[p] for p in distinct if p in index]
        for j in inset:
            if j == i:
                raise ValueError(f"call {ids[i]!r} consumes its own output")
            pending[j] += 1
        ups.append(inset)


def _label(dag: _Dag, marks: _Marks) -> None:
    """Label the calls in reverse topological order, each from its own outputs and its
    consumers' marks, and hand its marks to its producers; ValueError on a cycle."""
    ids, own, fanin, ups, pending = dag.ids, dag.own, dag.fanin, dag.ups, dag.pending
    lat_why, thr_why, groups, label = marks.lat_why, marks.thr_why, marks.groups, marks.label
    n = len(ids)
    stack = [i for i in range(n - 1, -1, -1) if pending[i] == 0]
    done = 0
    while stack:
        i = stack.pop()
        done += 1
        mine = own[i]
        if mine == _LAT or lat_why[i] is not None:
            lab = _LAT
            if mine == _LAT:
                lat_why[i] = "produces a LATENCY output"
        elif groups[i] is not None:
            lab = _GROUP
            marks.merge(groups[i], ids)  # type: ignore[arg-type]
        elif mine == _THR or thr_why[i] is not None:
            lab = _THR
            if mine == _THR:
                thr_why[i] = "produces a THROUGHPUT output"
        else:
            lab = _DEFAULT
        label[i] = lab
        producers = ups[i]
        if producers and lab != _DEFAULT:
            _mark_producers(i, lab, producers, fanin[i], ids, marks)
        for j in producers:
            pending[j] -= 1
            if pending[j] == 0:
                stack.append(j)
    if done != n:
        stuck = sorted(ids[i] for i in range(n) if pending[i] > 0)
        raise ValueError(f"the calls form a cycle (involving {stuck[:5]})")


def _mark_producers(
    i: int, lab: int, producers: list[int], fanin: int, ids: list[str], marks: _Marks
) -> None:
    """Hand call ``i``'s marks (it is labelled ``lab``, not default) to its in-set producers."""
    if lab == _LAT and fanin == 1:
        why = f"sole producer of latency-sensitive call {ids[i]}"
        lat_why = marks.lat_why
        for j in producers:
            if lat_why[j] is None:
                lat_why[j] = why
    elif lab == _LAT:
        groups = marks.groups
        for j in producers:
            gs = groups[j]
            if gs is None:
                groups[j] = [i]
            else:
                gs.append(i)
    elif lab == _GROUP:
        why = f"producer of task-group member {ids[i]}"
        lat_why = marks.lat_why
        for j in producers:
            if lat_why[j] is None:
                lat_why[j] = why
    else:
        why = f"upstream of a THROUGHPUT output (via {ids[i]})"
        thr_why = marks.thr_why
        for j in producers:
            if thr_why[j] is None:
                thr_why[j] = why


def _objectives(dag: _Dag, marks: _Marks) -> dict[str, CallObjective]:
    """Each call's :class:`CallObjective` from its label and the reason that decided it."""
    ids, fanin = dag.ids, dag.fanin
    label, lat_why, thr_why, groups = marks.label, marks.lat_why, marks.thr_why, marks.groups
    result: dict[str, CallObjective] = {}
    for i, cid in enumerate(ids):
        lab = label[i]
        if lab == _LAT:
            result[cid] = CallObjective("latency", None, lat_why[i])  # type: ignore[arg-type]
        elif lab == _GROUP:
            first = groups[i][0]  # type: ignore[index]
            tg = "tg:" + ids[marks.find(first)]
            why = f"member of task group {tg} (fan-in of {fanin[first]} calls into {ids[first]})"
            result[cid] = CallObjective("throughput", tg, why)
        elif lab == _THR:
            result[cid] = CallObjective("throughput", None, thr_why[i])  # type: ignore[arg-type]
        else:
            result[cid] = _DEFAULT_OBJECTIVE
    return result

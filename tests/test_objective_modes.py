"""Deduced objectives do not depend on how an application submits its calls or reads its values.

A random DAG of calls is submitted one by one (sync or async session) or in one
batch (sync or async), in a random topological order, and its values are read
with ``get``, ``aget``, ``stream`` or ``astream``.  An engine held busy by
another session's call keeps every call of the DAG queued until all the reads
have told the manager their criteria; the objectives the calls are then placed
with (their kind and the partition of task groups) must be those of
:func:`parrot.manager.dag.objectives.deduce` over the whole DAG, whatever the mode.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import parrot as P
import parrot.manager.executor as executor_module
from parrot.manager.dag.objectives import CallNode, deduce
from parrot.manager.service import Manager, ManagerConfig
from tests.conftest import LiveServer, start_server
from tests.fake_engine import GatedEngine, GatedServer

WAIT = 20.0


@pytest.fixture(scope="module")
def server() -> Iterator[GatedServer]:
    # A latency cap of one token that binds every call (the paper's scope): while the
    # blocker (latency work) runs, nothing else fits.
    manager = Manager(ManagerConfig(latency_cap_tokens=1, latency_cap_scope="all", saturation_batching=False))
    engine = GatedEngine()
    manager.pool.register(engine, name="gated")
    live = start_server(manager, record=False)
    yield GatedServer(live, engine)
    live.stop()


# ---------------------------------------------------------------- the DAGs
@dataclass(frozen=True)
class Spec:
    """Call ``i`` consumes the outputs of ``producers[i]`` (earlier calls); ``declared[i]``
    is its output's ``P.Output(criteria=...)``, ``read[i]`` the criteria its output is
    read with (None: never read); ``order`` is a topological submission order."""

    producers: tuple[tuple[int, ...], ...]
    declared: tuple[str | None, ...]
    read: tuple[str | None, ...]
    order: tuple[int, ...]

    def nodes(self) -> list[CallNode]:
        crit = [r if r is not None else d for r, d in zip(self.read, self.declared, strict=True)]
        return [
            CallNode(f"c{i}", tuple(f"c{p}" for p in ps), (crit[i],)) for i, ps in enumerate(self.producers)
        ]


CRITERIA = st.sampled_from([P.LATENCY, P.THROUGHPUT])


@st.composite
def specs(draw) -> Spec:
    size = draw(st.integers(1, 7))
    producers = tuple(
        tuple(draw(st.lists(st.integers(0, i - 1), max_size=3))) if i else () for i in range(size)
    )
    consumed = {p for ps in producers for p in ps}
    declared = tuple(draw(st.none() | CRITERIA) if draw(st.integers(0, 3)) == 0 else None for _ in producers)
    read = tuple(draw(st.none() | CRITERIA) if i in consumed else draw(CRITERIA) for i in range(size))
    # a random topological order: repeatedly submit one of the calls whose producers are in
    order: list[int] = []
    while len(order) < size:
        ready = [i for i in range(size) if i not in order and all(p in order for p in producers[i])]
        order.append(draw(st.sampled_from(ready)))
    return Spec(producers, declared, read, tuple(order))


def function(spec: Spec, i: int) -> P.SemanticFunction:
    inputs = "".join(f" {{{{input:x{k}}}}}" for k in range(len(spec.producers[i])))
    return P.template_function(
        f"call {i}:{inputs} {{{{input:k}}}} => {{{{output:o}}}}",
        name=f"c{i}",
        o=P.Output(max_tokens=1, criteria=spec.declared[i]),
    )


def arguments(spec: Spec, i: int, outs: dict[int, P.SemanticVariable]) -> dict[str, object]:
    args: dict[str, object] = {f"x{k}": outs[p] for k, p in enumerate(spec.producers[i])}
    args["k"] = str(i)
    return args


def submit(session: P.Session | P.AsyncSession, spec: Spec) -> dict[int, P.SemanticVariable]:
    """Submit (or record, in a batch) every call in ``spec.order``; an async session only queues them."""
    outs: dict[int, P.SemanticVariable] = {}
    for i in spec.order:
        outs[i] = session.call(function(spec, i), **arguments(spec, i, outs))  # type: ignore[assignment]
    return outs


# ---------------------------------------------------------------- the reads
def read_sync(var: P.SemanticVariable, criteria: str, how: str) -> str:
    if how == "get":
        return var.get(criteria, timeout=WAIT)
    if how == "stream":
        return "".join(var.stream(criteria, timeout=WAIT))
    return asyncio.run(var.aget(criteria, timeout=WAIT))


async def read_async(var: P.SemanticVariable, criteria: str, how: str) -> str:
    if how == "aget":
        return await var.aget(criteria, timeout=WAIT)
    return "".join([d async for d in var.astream(criteria, timeout=WAIT)])


# ---------------------------------------------------------------- one run
SYNC_READS = ("get", "stream", "aget")
ASYNC_READS = ("aget", "astream")
MODES = [("sync", r) for r in SYNC_READS] + [("sync-batch", r) for r in SYNC_READS]
MODES += [("async", r) for r in ASYNC_READS] + [("async-batch", r) for r in ASYNC_READS]


def blocker(server: GatedServer) -> P.Session:
    """A session whose one call holds the engine (gate closed) until the gate opens."""
    server.set_gate(False)
    session = P.connect(server.live.url, timeout=WAIT).open()
    held = session.call(function(Spec(((),), (None,), (None,), (0,)), 0), k="block")
    deadline = time.monotonic() + WAIT
    while server.state(lambda m: len(m.executor._placed)) != 1:  # type: ignore[arg-type]
        assert time.monotonic() < deadline, "the blocker was never placed"
        time.sleep(0.005)
    assert held.id is not None
    return session


def wait_until(server: GatedServer, check: Callable[[Manager], bool], timeout: float = WAIT / 4) -> None:
    """Until ``check(manager)`` holds (fails the test after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not server.state(check):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def wait_for_criteria(server: GatedServer, session_id: str, expected: dict[str, str]) -> None:
    """Until the manager has recorded the criteria of every read variable (or WAIT passes)."""

    def recorded(m: Manager) -> dict[str, str | None]:
        variables = m.sessions[session_id].variables
        return {vid: variables[vid].criteria for vid in expected}

    deadline = time.monotonic() + WAIT / 4
    while (got := server.state(recorded)) != expected and time.monotonic() < deadline:
        time.sleep(0.005)
    assert got == expected, "the reads did not all reach the manager with their criteria"


def objectives(
    live: LiveServer, session: P.Session | P.AsyncSession, by: str = "name"
) -> dict[str, tuple[str, str | None]]:
    """(objective, task group) of every call of the session, all done, by name (or call id)."""
    graph = httpx.get(
        f"{live.url}/v1/sessions/{session.session_id}/graph",
        headers={"Authorization": f"Bearer {session.token}"},
        timeout=WAIT,
    ).json()
    assert all(c["state"] == "done" for c in graph["calls"]), graph["calls"]
    return {c[by]: (c["objective"], c["task_group"]) for c in graph["calls"]}


def partition(labels: dict[str, tuple[str, str | None]]) -> tuple[dict[str, str], set[frozenset[str]]]:
    """(kind of each call, task groups as sets of call names): group ids differ between runs."""
    groups: dict[str, set[str]] = {}
    for name, (_, group) in labels.items():
        if group is not None:
            groups.setdefault(group, set()).add(name)
    return {n: k for n, (k, _) in labels.items()}, {frozenset(g) for g in groups.values()}


def run_sync(server: GatedServer, spec: Spec, batch: bool, how: str) -> dict[str, tuple[str, str | None]]:
    held = blocker(server)
    try:
        with P.connect(server.live.url, timeout=WAIT) as session:
            if batch:
                with session.batch():
                    outs = submit(session, spec)
            else:
                outs = submit(session, spec)
            reads = {i: c for i, c in enumerate(spec.read) if c is not None}
            with ThreadPoolExecutor(len(reads)) as pool:
                futures = [pool.submit(read_sync, outs[i], c, how) for i, c in reads.items()]
                try:
                    wait_for_criteria(server, session.session_id, {outs[i].id: c for i, c in reads.items()})
                finally:
                    server.set_gate(True)
                assert all(f.result(WAIT) == "A" for f in futures)
            return objectives(server.live, session)
    finally:
        server.set_gate(True)
        held.close()


def run_async(server: GatedServer, spec: Spec, batch: bool, how: str) -> dict[str, tuple[str, str | None]]:
    held = blocker(server)

    async def main() -> dict[str, tuple[str, str | None]]:
        async with P.aconnect(server.live.url, timeout=WAIT) as session:
            if batch:
                async with session.batch():
                    outs = submit(session, spec)
            else:
                outs = submit(session, spec)
            await session.flush()
            reads = {i: c for i, c in enumerate(spec.read) if c is not None}
            tasks = [asyncio.create_task(read_async(outs[i], c, how)) for i, c in reads.items()]
            expected = {outs[i].id: c for i, c in reads.items()}
            try:
                await asyncio.to_thread(wait_for_criteria, server, session.session_id, expected)  # type: ignore[arg-type]
            finally:
                server.set_gate(True)
                values = await asyncio.gather(*tasks, return_exceptions=True)
            assert values == ["A"] * len(tasks)
            return objectives(server.live, session)

    try:
        return asyncio.run(main())
    finally:
        server.set_gate(True)
        held.close()


def run(server: GatedServer, spec: Spec, mode: str, how: str) -> dict[str, tuple[str, str | None]]:
    if mode.startswith("sync"):
        return run_sync(server, spec, mode.endswith("batch"), how)
    return run_async(server, spec, mode.endswith("batch"), how)


def expected(spec: Spec) -> dict[str, tuple[str, str | None]]:
    return {cid: (o.kind, o.task_group) for cid, o in deduce(spec.nodes()).items()}


# ---------------------------------------------------------------- tests
LAT, THR = "latency", "throughput"
MAP_REDUCE_AND_CHAIN = Spec(
    producers=((), (), (), (0, 1, 2), (3,), (4,)),
    declared=(None,) * 6,
    read=(None, None, None, None, None, P.LATENCY),
    order=(0, 1, 2, 3, 4, 5),
)
# A six-call chain whose steps 2 and 4 also reread an older output (c0, c1): nothing in it
# can run in parallel, so it has no task group.
REREADING_CHAIN = Spec(
    producers=((), (0,), (1, 0), (2,), (3, 1), (4,)),
    declared=(None,) * 6,
    read=(None, None, None, None, None, P.LATENCY),
    order=(0, 1, 2, 3, 4, 5),
)
CASES = {
    "map-reduce-then-chain": (
        MAP_REDUCE_AND_CHAIN,
        ({"c0": THR, "c1": THR, "c2": THR, "c3": LAT, "c4": LAT, "c5": LAT}, {frozenset({"c0", "c1", "c2"})}),
    ),
    "rereading-chain": (REREADING_CHAIN, ({f"c{i}": LAT for i in range(6)}, set())),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("mode", "how"), MODES)
def test_fixed_dags_get_their_objectives_in_every_mode(server, case, mode, how):
    spec, want = CASES[case]
    assert partition(expected(spec)) == want
    assert partition(run(server, spec, mode, how)) == want


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(spec=specs(), data=st.data())
def test_objectives_are_the_same_however_a_dag_is_submitted_and_read(server, spec, data):
    want = partition(expected(spec))
    for mode in ("sync", "sync-batch", "async", "async-batch"):
        how = data.draw(st.sampled_from(SYNC_READS if mode.startswith("sync") else ASYNC_READS), label=mode)
        assert partition(run(server, spec, mode, how)) == want, (mode, how)


@pytest.fixture
def fresh_server(monkeypatch) -> Iterator[GatedServer]:
    """A server of its own whose rounds run only on events: no periodic tick to hide a missing one."""
    monkeypatch.setattr(executor_module, "TICK_S", 3600.0)
    manager = Manager(ManagerConfig(latency_cap_tokens=1, latency_cap_scope="all", saturation_batching=False))
    engine = GatedEngine()
    manager.pool.register(engine, name="gated")
    live = start_server(manager, record=False)
    yield GatedServer(live, engine)
    live.stop()


@pytest.mark.parametrize("how", ["get", "stream"])
def test_calls_queued_before_their_consumers_criterion_are_re_ranked_when_it_arrives(fresh_server, how):
    server = fresh_server
    out = P.Output(max_tokens=1)
    part = P.template_function("part {{input:k}} =>{{output:o}}", name="part", o=out)
    whole = P.template_function("all {{input:a}} {{input:b}} =>{{output:o}}", name="whole", o=out)

    def queued(m: Manager) -> set[tuple[str | None, str | None, str | None]]:
        """(name, kind, task group) of the queued calls, as their QueuedCall carries them."""
        seen: set[tuple[str | None, str | None, str | None]] = set()
        for ticket in m.executor._queue.values():
            if ticket.queued is None:  # no round saw it yet
                seen.add((ticket.call.name, None, None))
            else:
                objective = ticket.queued.objective
                seen.add((ticket.call.name, objective.kind, objective.task_group))
        return seen

    held = blocker(server)
    try:
        with P.connect(server.live.url, timeout=WAIT) as s:
            parts = [s.call(part, k=str(i)) for i in range(2)]  # queued before their consumer exists
            wait_until(server, lambda m: queued(m) == {("part", LAT, None)} and len(m.executor._queue) == 2)
            out_var = s.call(whole, a=parts[0], b=parts[1])
            whole_id = server.state(lambda m: m.sessions[s.session_id].variables[out_var.id].producer.call_id)
            with ThreadPoolExecutor(1) as pool:
                read = pool.submit(read_sync, out_var, P.LATENCY, how)
                try:
                    # the read's criterion re-ranks the queued parts: one task group feeding `whole`
                    wait_until(server, lambda m: queued(m) == {("part", THR, f"tg:{whole_id}")})
                finally:
                    server.set_gate(True)
                assert read.result(WAIT) == "A"
            graph = objectives(server.live, s, by="call_id")
        assert len(graph) == 3 and graph.pop(whole_id) == (LAT, None)
        assert set(graph.values()) == {(THR, f"tg:{whole_id}")}
    finally:
        server.set_gate(True)
        held.close()

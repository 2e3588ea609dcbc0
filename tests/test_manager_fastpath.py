"""The executor's scheduling fast path gives the pure scheduler's placements.

``scheduler.Scheduler`` keeps Algorithm 1's engine state between rounds and
is told only what changed; ``scheduler.schedule`` rebuilds it from the
snapshots every call.  For any history of engine updates, the two must place
every queue identically — checked here on random histories, and on a running
manager (its incremental snapshots against snapshots built afresh).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parrot.manager.dag.objectives import CallObjective
from parrot.manager.sched.engine_loads import PlacedShare
from parrot.manager.sched.scheduler import (
    POLICIES,
    EngineSnapshot,
    QueuedCall,
    Scheduler,
    SchedulerConfig,
    schedule,
    unservable,
)
from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import EngineStats, GenerateChunk, PlaceholderBinding, SubmitCall
from parrot.protocol.tokenizer import TextTokenizer

ENGINE_IDS = [f"e{i}" for i in range(6)]


# ------------------------------------------------------------ random histories
# Each strategy is built once, here, not inside the composites at every draw: they draw
# the same examples, without hypothesis building and validating ~300,000 strategy objects
# (80% of this file's time).
SNAPSHOT_FIELDS = (
    st.sampled_from(["a", "b"]),
    st.sampled_from([4096, 16_384]),
    st.sampled_from([2048, 8192, 32_000]),
    st.sampled_from([0, 0, 100, 3000, 6000, 9000]),
    st.sampled_from([None, "latency", "throughput"]),
)
TASK_GROUP_SETS = st.sets(st.sampled_from(["tg:1", "tg:2"]), max_size=2)
PREFIX_SETS = st.sets(st.sampled_from(["p", "q", "r"]), max_size=2)
BOOLEANS = st.booleans()
OWN_CAPS = st.sampled_from([1024, 3000, 6144])  # the engine's own latency cap
LAST_ASSIGNED = st.sampled_from([0, 1, 2, 5])
LATENCY_RUNNING = st.sampled_from([0, 0, 3, 20])  # latency calls running there


@st.composite
def snapshots(draw, engine_id: str) -> EngineSnapshot:
    return EngineSnapshot(
        engine_id,
        *(draw(field) for field in SNAPSHOT_FIELDS),
        frozenset(draw(TASK_GROUP_SETS)),
        frozenset(draw(PREFIX_SETS)),
        draw(BOOLEANS) or draw(BOOLEANS),
        draw(OWN_CAPS),
        draw(LAST_ASSIGNED),
        draw(LATENCY_RUNNING),
    )


QUEUE_LENGTHS = st.integers(0, 20)
KINDS = st.sampled_from(["latency", "throughput"])
GROUPS = st.sampled_from([None, "tg:1", "tg:2"])
MODELS = st.sampled_from(["a", "b", None])
PREFIX_LISTS = st.lists(st.sampled_from(["p", "q", "r"]), max_size=2)
TOKENS = st.sampled_from([1, 50, 1000, 3000, 7000, 20_000])
RANKS = st.integers(0, 3)
NEW_TOKENS = st.sampled_from([0, 16, 64, 500])


@st.composite
def queues(draw) -> list[QueuedCall]:
    queue = []
    for i in range(draw(QUEUE_LENGTHS)):
        kind = draw(KINDS)
        group = draw(GROUPS) if kind == "throughput" else None
        queue.append(
            QueuedCall(
                f"c{i}",
                draw(MODELS),
                CallObjective(kind, group, "test"),  # type: ignore[arg-type]
                tuple(draw(PREFIX_LISTS)),
                draw(TOKENS),
                draw(RANKS),
                draw(NEW_TOKENS),
            )
        )
    return queue


@st.composite
def histories(draw):
    """A config and rounds of (engine updates, queue); an update is ("set", snapshot),
    ("same", id) (the current snapshot again, or an equal copy), ("tweak", id, field,
    value) (one field of the current snapshot changed: its latency cap, stamp or load),
    ("remove", id), or ("sync", snapshots) (the whole engine set)."""
    policy = draw(st.sampled_from(POLICIES))
    config = SchedulerConfig(
        policy,
        latency_cap_tokens=draw(st.sampled_from([None, None, 1024, 6144])),
        latency_cap_scope=draw(st.sampled_from(["mixed", "all"])),
        affinity_spill=draw(st.booleans()),
        saturation_batching=draw(st.booleans()),
    )
    rounds = []
    for _ in range(draw(st.integers(1, 8))):
        ops = []
        for _ in range(draw(st.integers(0, 5))):
            what = draw(st.sampled_from(["set", "set", "set", "same", "tweak", "remove", "sync"]))
            eid = draw(st.sampled_from(ENGINE_IDS))
            if what == "set":
                ops.append(("set", draw(snapshots(eid))))
            elif what == "tweak":
                field = draw(st.sampled_from(["latency_cap_tokens", "last_assigned", "token_load"]))
                value = draw(
                    st.sampled_from([0, 1, 500, 1024, 6144] if field != "latency_cap_tokens" else [500, 6144])
                )
                ops.append(("tweak", eid, field, value))
            elif what == "sync":
                ids = draw(st.sets(st.sampled_from(ENGINE_IDS), max_size=len(ENGINE_IDS)))
                ops.append(("sync", [draw(snapshots(i)) for i in sorted(ids)]))
            else:
                ops.append((what, eid, draw(st.booleans())))
        rounds.append((ops, draw(queues())))
    return config, rounds


@settings(max_examples=300, deadline=None)
@given(histories())
def test_incremental_scheduler_places_like_the_pure_function(history):
    config, rounds = history
    sched = Scheduler(config)
    engines: dict[str, EngineSnapshot] = {}  # what the scheduler was told, as a plain dict
    for ops, queue in rounds:
        for op in ops:
            if op[0] == "set":
                engines[op[1].engine_id] = op[1]
                sched.set_engine(op[1])
            elif op[0] == "sync":
                engines = {s.engine_id: s for s in op[1]}
                sched.sync(op[1])
            elif op[0] == "remove":
                engines.pop(op[1], None)
                sched.remove_engine(op[1])
            elif op[0] == "tweak":
                if op[1] in engines:
                    snap = dataclasses.replace(engines[op[1]], **{op[2]: op[3]})
                    engines[op[1]] = snap
                    sched.set_engine(snap)
            elif op[1] in engines:  # "same": the object again, or an equal copy
                snap = engines[op[1]] if op[2] else dataclasses.replace(engines[op[1]])
                engines[op[1]] = snap
                sched.set_engine(snap)
        current = list(engines.values())
        assert {s.engine_id: s for s in sched.engines} == engines
        expected = schedule(queue, current, config)
        assert sched.schedule(queue) == expected
        assert sched.schedule(queue) == expected  # a round leaves the state as it was
        assert sched.unservable(queue) == unservable(queue, current)


def test_incremental_scheduler_survives_many_rounds_on_one_state():
    """Heaps keep stale entries between rebuilds; thousands of rounds must not change answers."""
    config = SchedulerConfig()
    sched = Scheduler(config)
    engines = {f"e{i}": EngineSnapshot(f"e{i}", "m", 4096, 8192, token_load=(i * 37) % 500) for i in range(8)}
    sched.sync(list(engines.values()))
    lat = CallObjective("latency", None, "test")
    for r in range(2000):
        queue = [QueuedCall(f"c{r}-{k}", "m", lat, (f"p{r % 3}",), 100 + k, k) for k in range(3)]
        placements = sched.schedule(queue)
        assert placements == schedule(queue, list(engines.values()), config)
        for p in placements:  # the engine reports the new load, as the executor does
            old = engines[p.engine_id]
            load = (old.token_load + 100) % 3000
            snap = dataclasses.replace(old, token_load=load, mode="latency" if load else None)
            engines[p.engine_id] = snap
            sched.set_engine(snap)


def test_idle_engines_take_turns_when_calls_come_one_at_a_time():
    """Issue 13, defect 4: every round starts from equal (zero) loads; ties by engine id
    alone sent every call to the same engine while the other idled.  (The prompts share
    no prefix, which would rightly keep them together.)"""

    async def main() -> list[tuple[str | None, str | None]]:
        manager = Manager(ManagerConfig())
        tokenizer = TextTokenizer.byte_level_tiny()
        for _ in range(2):
            manager.pool.register(SlowishEngine(tokenizer))
        session = manager.create_session()[0]
        used = []
        for i in range(6):
            call = submit(manager, session, "{{input:x}} {{output:y}}", x=f"question {i}", y={"sampling": {}})
            while call.state != "done":
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.005)  # its context is freed: the engine is idle again
            used.append((call.engine_id, call.placement))
        await manager.executor.drain()
        return used

    used = asyncio.run(main())
    engines = [e for e, _ in used]
    assert {p for _, p in used} == {"find-engine"}
    assert len(set(engines)) == 2 and all(a != b for a, b in itertools.pairwise(engines)), used


def test_incremental_scheduler_validates_like_the_pure_function():
    sched = Scheduler()
    a = EngineSnapshot("e1", "m", 4096, 8192)
    with pytest.raises(ValueError, match="duplicate engine id"):
        sched.sync([a, a])
    assert sched.engines == []  # nothing changed
    sched.sync([a])
    q = QueuedCall("c", "m", CallObjective("latency"), (), 10, 0)
    with pytest.raises(ValueError, match="duplicate call id"):
        sched.schedule([q, q])
    assert [p.engine_id for p in sched.schedule([q])] == ["e1"]


# --------------------------------------------------------- a running manager
SYSTEM = "You are a careful assistant who answers in one short sentence. "


class SlowishEngine:
    """A fake engine that yields to the loop on every step, so loads overlap."""

    def __init__(self, tokenizer: TextTokenizer, max_seq_len: int = 4096):
        self._tokenizer = tokenizer
        self.max_seq_len = max_seq_len

    model_name = "fake"

    @property
    def tokenizer(self) -> TextTokenizer:
        return self._tokenizer

    async def fill(
        self,
        tokens: Sequence[int],
        context_id: int,
        parent_context_id: int | None = None,
        cache_salt: str = "",
        *,
        priority: int = 0,
        retain: bool = False,
    ) -> None:
        await asyncio.sleep(0)

    async def generate(
        self,
        sampling: SamplingParams,
        context_id: int,
        parent_context_id: int | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[GenerateChunk]:
        await asyncio.sleep(0.001)  # rounds run while calls hold their engines
        yield GenerateChunk(token_ids=[65], text="A", done=True, finish_reason="length")

    async def free_context(self, context_id: int) -> None:
        return None

    async def stats(self) -> EngineStats:
        return EngineStats()


def submit(manager: Manager, session, template: str, **bindings) -> object:
    placeholders = []
    for name, b in bindings.items():
        if isinstance(b, dict):
            placeholders.append(PlaceholderBinding(name=name, **b))
        else:
            placeholders.append(PlaceholderBinding(name=name, value=b))
    return manager.submit_call(session, SubmitCall(template=template, placeholders=placeholders))


async def run_workload(manager: Manager) -> list:
    tokenizer = TextTokenizer.byte_level_tiny()
    handles = [manager.pool.register(SlowishEngine(tokenizer, 4096 if i % 3 else 2048)) for i in range(5)]
    remote = manager.pool.register(SlowishEngine(tokenizer), url="http://fake")  # can be suspected
    sessions = [manager.create_session()[0] for _ in range(4)]
    calls = []
    for step in range(12):
        for k, session in enumerate(sessions):
            # map-reduce whose maps wait on a variable set last: a task group feeding a LATENCY reduce
            doc = manager.create_variable(session, "doc", None)
            maps = [
                submit(
                    manager,
                    session,
                    SYSTEM + "Part {{input:i}} of {{input:doc}}: {{output:s}}",
                    i=str(i),
                    doc={"var_id": doc.var_id},
                    s={"sampling": {"max_tokens": 40 * (1 + i)}},
                )
                for i in range(4)
            ]
            parts = " ".join(f"{{{{input:p{i}}}}}" for i in range(len(maps)))
            reduce_ = submit(
                manager,
                session,
                f"Combine: {parts} {{{{output:out}}}}",
                **{f"p{i}": {"var_id": m.outputs["s"].var.var_id} for i, m in enumerate(maps)},
                out={"sampling": {"max_tokens": 300}, "criteria": "LATENCY"},
            )
            single = submit(
                manager, session, SYSTEM + "Say {{input:x}}: {{output:y}}", x=str(k), y={"sampling": {}}
            )
            calls += [*maps, reduce_, single]
            manager.set_variable(session, doc.var_id, f"document {step}")
            await asyncio.sleep(0)
        # what the pool says of engines changes between rounds
        if step == 3:
            manager.pool.heartbeat(handles[1].engine_id, EngineStats(token_capacity=600))
        if step == 4:
            manager.pool.suspect(remote.engine_id)
        if step == 6:
            manager.pool.heartbeat(remote.engine_id, EngineStats(token_capacity=900))
        if step == 7:
            manager.pool.drop(handles[2].engine_id, "test")
        if step == 8:
            manager.pool.register(SlowishEngine(tokenizer))
        await asyncio.sleep(0.002)
    for _ in range(5000):
        if all(c.state in ("done", "failed") for c in calls):
            break
        await asyncio.sleep(0.002)
    await manager.executor.drain()
    return calls


@pytest.mark.parametrize("policy", ["parrot", "no-affinity", "baseline-latency"])
def test_executor_fast_path_matches_the_pure_scheduler(policy, monkeypatch):
    manager = Manager(ManagerConfig(policy=policy, latency_cap_tokens=500, engine_token_capacity=1500))
    executor = manager.executor
    pure_schedule = Scheduler.schedule
    problems: list[str] = []
    rounds: list[int] = []

    def checked_schedule(self: Scheduler, queue):
        got = pure_schedule(self, queue)
        if self is executor.loads.sched:  # the executor's state, not schedule()'s fresh one
            fresh = executor.snapshots()
            if {s.engine_id: s for s in self.engines} != {s.engine_id: s for s in fresh}:
                problems.append(f"round {len(rounds)}: snapshots differ")
            expected = schedule(queue, fresh, self.config)
            if got != expected:
                problems.append(f"round {len(rounds)}: {got} != {expected}")
            rounds.append(len(got))
        return got

    monkeypatch.setattr(Scheduler, "schedule", checked_schedule)
    calls = asyncio.run(run_workload(manager))
    assert problems == []
    assert sum(rounds) >= len(calls) and len(rounds) > 20
    # a call whose output was already materialised when its engine was dropped cannot be re-run
    failed = [c for c in calls if c.state != "done"]
    assert all("dropped: test" in str(c.error) for c in failed), [(c.state, c.error) for c in failed]
    assert len(failed) < len(calls) // 10
    placements = {c.placement for c in calls}
    if policy == "parrot":
        assert {"task-group", "prefix-engine"} <= placements


def test_executor_snapshots_follow_every_kind_of_change():
    """Each way an engine's snapshot can change reaches the scheduler's kept state."""

    async def main() -> None:
        manager = Manager(ManagerConfig())
        executor, pool = manager.executor, manager.pool
        tokenizer = TextTokenizer.byte_level_tiny()

        def in_sync() -> bool:
            sched = executor.loads.sync(executor.scheduler)
            return {s.engine_id: s for s in sched.engines} == {s.engine_id: s for s in executor.snapshots()}

        local = pool.register(SlowishEngine(tokenizer))
        remote = pool.register(SlowishEngine(tokenizer), url="http://fake")
        assert in_sync()
        executor.prefixes.record(local.engine_id, ["k"])  # a call with prefix key k was placed there
        assert in_sync() and {s.engine_id: s.prefixes for s in executor.loads.sched.engines}[
            local.engine_id
        ] == {"k"}
        executor.prefixes.forget_engine(local.engine_id)
        assert in_sync()
        pool.heartbeat(remote.engine_id, EngineStats(token_capacity=777))  # a new capacity
        assert in_sync()
        pool.suspect(remote.engine_id)  # no longer alive
        assert in_sync()
        pool.heartbeat(remote.engine_id, EngineStats(token_capacity=777))  # back
        assert in_sync()
        session = manager.create_session()[0]
        call = submit(manager, session, SYSTEM + "{{input:x}} {{output:y}}", x="1", y={"sampling": {}})
        assert call.call_id in executor._queue
        share = PlacedShare(50, None, "latency", None)  # a call placed by hand: its load shows
        executor.loads.account(local.engine_id, share, +1)
        assert in_sync() and {s.token_load for s in executor.loads.sched.engines} == {50, 0}
        executor.loads.account(local.engine_id, share, -1)
        assert in_sync()
        pool.drop(local.engine_id, "test")  # gone
        pool.register(SlowishEngine(tokenizer))  # and a new one
        assert in_sync() and len(executor.loads.sched.engines) == 2
        executor.scheduler = SchedulerConfig("no-affinity")  # reconfigured: state rebuilt
        assert in_sync() and executor.loads.sched.config.policy == "no-affinity"
        await executor.drain()

    asyncio.run(main())


def test_a_call_whose_task_is_cancelled_before_it_starts_is_not_lost():
    """A task cancelled before its first step never runs its body: the executor
    must still re-queue the call (engine dropped) or release its load (cancelled)."""

    async def main() -> None:
        manager = Manager(ManagerConfig())
        executor, pool = manager.executor, manager.pool
        tokenizer = TextTokenizer.byte_level_tiny()
        first = pool.register(SlowishEngine(tokenizer))
        session = manager.create_session()[0]
        call = submit(manager, session, SYSTEM + "{{input:x}} {{output:y}}", x="1", y={"sampling": {}})
        executor._round()  # placed: its task exists but has not run yet
        assert call.call_id in executor._placed and call.engine_id is None
        pool.drop(first.engine_id, "test")
        assert call.state == "ready" and call.call_id in executor._queue
        assert call.call_id not in executor._placed and call.call_id not in executor._tasks
        second = pool.register(SlowishEngine(tokenizer))
        while call.state != "done":
            await asyncio.sleep(0.001)
        assert call.engine_id == second.engine_id

        other = manager.create_session()[0]
        call = submit(manager, other, SYSTEM + "{{input:x}} {{output:y}}", x="2", y={"sampling": {}})
        executor._round()
        assert call.call_id in executor._placed
        manager.close_session(other)
        assert call.state == "failed" and not executor._placed and not executor._tasks
        assert executor.loads.usage[second.engine_id].load == 0
        await executor.drain()

    asyncio.run(main())

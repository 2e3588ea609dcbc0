"""In-process engines' stats reach the scheduler by themselves, as a remote engine's
heartbeats do: once when the engine is registered (or the manager starts) and then
on every heartbeat interval, without anyone asking ``GET /v1/engines``."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from parrot.engine.loader import LoadedModel
from parrot.engine.local import LocalEngine
from parrot.manager.backends.pool import EngineHandle
from parrot.manager.service import Manager, ManagerConfig
from tests.conftest import LiveServer, start_server

WAIT = 5.0


@pytest.fixture
def engines(tiny_model: LoadedModel) -> Iterator[list[LocalEngine]]:
    """Two embedded engines of the tiny model with token capacities 1234 and 2345."""
    made = [
        LocalEngine(tiny_model, max_step_tokens=256, token_capacity=cap, kv_cache_tokens=4096)
        for cap in (1234, 2345)
    ]
    yield made
    for engine in made:
        engine.close()


def scheduler_capacities(live: LiveServer) -> dict[str, int]:
    """Engine id -> the token capacity in the scheduler's snapshot of it."""

    async def read() -> dict[str, int]:
        sched = live.manager.executor.loads.sync(live.manager.executor.scheduler)
        return {s.engine_id: s.token_capacity for s in sched.engines}

    return live.run_on_loop(read())


def wait_for_capacity(live: LiveServer, engine_id: str, capacity: int) -> None:
    deadline = time.monotonic() + WAIT
    while (got := scheduler_capacities(live).get(engine_id)) != capacity and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == capacity, f"the scheduler sees capacity {got} for {engine_id}, not {capacity}"


def test_an_embedded_engines_capacity_reaches_the_scheduler_without_get_engines(engines):
    assert ManagerConfig().engine_token_capacity != 1234  # the default would not do
    # heartbeats far apart: only the poll at start-up / registration can bring the numbers
    manager = Manager(ManagerConfig(heartbeat_interval_s=60.0, heartbeat_timeout_s=120.0))
    first = manager.pool.register(engines[0], name="embedded")  # before the server runs, as `parrot serve`
    live = start_server(manager)
    try:
        wait_for_capacity(live, first.engine_id, 1234)

        async def register() -> EngineHandle:  # while the manager runs
            return manager.pool.register(engines[1], name="second")

        second = live.run_on_loop(register())
        wait_for_capacity(live, second.engine_id, 2345)
        assert not [p for _, p in live.requests if p.startswith("/v1/engines")]
    finally:
        live.stop()


def test_embedded_engine_stats_follow_the_heartbeat_interval(engines):
    manager = Manager(ManagerConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0))
    handle = manager.pool.register(engines[0], name="embedded")
    live = start_server(manager)
    try:
        wait_for_capacity(live, handle.engine_id, 1234)
        live.run_on_loop(engines[0].set_token_capacity(777))  # changed at run time
        wait_for_capacity(live, handle.engine_id, 777)
        assert not [p for _, p in live.requests if p.startswith("/v1/engines")]
        assert manager.pool.get(handle.engine_id).alive  # in-process engines are never dropped
    finally:
        live.stop()

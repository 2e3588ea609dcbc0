"""Application-level FIFO: a queued call ranks by its application's (session's) place
in the queue, so a chain's next step does not queue behind applications that came
after it.  ``--no-app-fifo`` and the request-level baselines rank by each call's
arrival instead."""

from __future__ import annotations

import time

import pytest

import parrot as P
from parrot.cli import _parser, manager_config
from parrot.manager.service import Manager, ManagerConfig
from tests.conftest import start_server
from tests.fake_engine import GatedEngine, GatedServer

WAIT = 10.0


def fn(name: str) -> P.SemanticFunction:
    out = P.Output(max_tokens=1)
    return P.template_function(f"{name} {{{{input:x}}}} =>{{{{output:o}}}}", name=name, o=out)


def wait_until(server: GatedServer, what: str, check) -> None:
    deadline = time.monotonic() + WAIT
    while not server.state(check):
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


def chain_and_later_app(config: ManagerConfig, b_queues: bool) -> tuple[GatedEngine, list[str]]:
    """A's call a1 runs (held at the gate); then B's b1 arrives, queued behind it
    (``b_queues``: the engine fits one call at a time) or running beside it; then the gate
    opens, a1 finishes and A's a2 becomes ready.  Returns the engine and the calls' names
    in the order they were dispatched."""
    manager = Manager(config)
    engine = GatedEngine()
    manager.pool.register(engine, name="gated")
    server = GatedServer(start_server(manager, record=False), engine)
    executor = manager.executor
    try:
        server.set_gate(False)
        with P.connect(server.live.url, timeout=WAIT) as a, P.connect(server.live.url, timeout=WAIT) as b:
            a2 = a.call(fn("a2"), x=a.call(fn("a1"), x="go"))
            wait_until(server, "a1 runs", lambda m: len(m.executor._placed) == 1)
            b1 = b.call(fn("b1"), x="go")
            if b_queues:
                wait_until(server, "b1 is queued", lambda m: len(m.executor._queue) == 1)
            else:
                wait_until(server, "b1 runs", lambda m: len(m.executor._placed) == 2)
            server.set_gate(True)
            assert a2.get(timeout=WAIT) == "A" and b1.get(timeout=WAIT) == "A"
            sessions = (a.session_id, b.session_id)
            calls = server.state(lambda m: [c for sid in sessions for c in m.sessions[sid].calls.values()])
        assert not executor._queue
    finally:
        server.set_gate(True)
        server.live.stop()
    return engine, [c.name for c in sorted(calls, key=lambda c: c.dispatched_at)]


def placement_order(config: ManagerConfig) -> list[str]:
    """Which of a2 and b1 goes first, on an engine that fits one call at a time?"""
    return chain_and_later_app(config, b_queues=True)[1]


# one call at a time on a busy engine, whatever its objective
ONE_AT_A_TIME = {"latency_cap_tokens": 1, "engine_token_capacity": 1}


def test_app_fifo_places_a_chains_next_call_before_a_later_application():
    assert placement_order(ManagerConfig(**ONE_AT_A_TIME)) == ["a1", "a2", "b1"]


@pytest.mark.parametrize(
    "config",
    [
        ManagerConfig(app_fifo=False, **ONE_AT_A_TIME),
        ManagerConfig(policy="baseline-latency", **ONE_AT_A_TIME),
        ManagerConfig(policy="baseline-throughput", **ONE_AT_A_TIME),
    ],
    ids=["no-app-fifo", "baseline-latency", "baseline-throughput"],
)
def test_request_level_fifo_places_calls_in_arrival_order(config):
    assert placement_order(config) == ["a1", "b1", "a2"]


def test_the_cli_switch_turns_app_fifo_off():
    assert manager_config(_parser().parse_args(["serve"])).app_fifo is True
    assert manager_config(_parser().parse_args(["serve", "--no-app-fifo"])).app_fifo is False


def test_an_application_whose_work_ended_gives_up_its_place():
    """A's a1 ran to its end; then C's c1 runs (held) and B's b1 queues behind it; then A
    submits new work a2.  Nothing of A was in flight, so a2 queues behind b1: a session that
    stays open does not keep the place of its first call for ever."""
    manager = Manager(ManagerConfig(**ONE_AT_A_TIME))
    engine = GatedEngine()
    manager.pool.register(engine, name="one-at-a-time")
    server = GatedServer(start_server(manager, record=False), engine)
    try:
        with (
            P.connect(server.live.url, timeout=WAIT) as a,
            P.connect(server.live.url, timeout=WAIT) as b,
            P.connect(server.live.url, timeout=WAIT) as c,
        ):
            assert a.call(fn("a1"), x="go").get(timeout=WAIT) == "A"
            server.set_gate(False)
            c1 = c.call(fn("c1"), x="go")
            wait_until(server, "c1 runs", lambda m: len(m.executor._placed) == 1)
            b1 = b.call(fn("b1"), x="go")
            a2 = a.call(fn("a2"), x="go")
            wait_until(server, "b1 and a2 are queued", lambda m: len(m.executor._queue) == 2)
            server.set_gate(True)
            for out in (c1, b1, a2):
                out.get(timeout=WAIT)
            sessions = (a.session_id, b.session_id, c.session_id)
            calls = server.state(lambda m: [c for sid in sessions for c in m.sessions[sid].calls.values()])
    finally:
        server.set_gate(True)
        server.live.stop()
    assert [c.name for c in sorted(calls, key=lambda c: c.dispatched_at)] == ["a1", "c1", "b1", "a2"]
    assert not manager.executor.order.app_ranks and not manager.executor.order.app_active


@pytest.mark.parametrize("app_fifo", [True, False], ids=["app-fifo", "no-app-fifo"])
def test_generations_carry_their_applications_place_as_their_priority(app_fifo: bool):
    """A's a1 and B's b1 both run (held at the gate), then a1 ends and A's a2 runs.  Each
    generation carries a priority for engines that order their own queue (a vLLM backend
    with ``--backend-priority``): with app-FIFO a2 keeps A's place, ahead of B, which came
    later; without it a2 ranks by its own arrival, behind b1."""
    engine, order = chain_and_later_app(ManagerConfig(app_fifo=app_fifo), b_queues=False)
    assert order == ["a1", "b1", "a2"]
    pa1, pb1, pa2 = engine.priorities  # in that order; the server has stopped
    if app_fifo:
        assert pa1 == pa2 < pb1, engine.priorities
    else:
        assert pa1 < pb1 < pa2, engine.priorities

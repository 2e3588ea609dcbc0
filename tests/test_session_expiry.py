"""Idle sessions expire: their variables are dropped and their calls' engine contexts freed;
a session in use, or with work queued or running, stays."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest

import parrot as P
from parrot.manager.service import Manager, ManagerConfig
from tests.conftest import start_server
from tests.fake_engine import GatedEngine, GatedServer

TTL = 0.4


F = P.template_function("x {{input:a}} {{output:b}}", b=P.Output(max_tokens=2))


def _gated_server(ttl: float) -> GatedServer:
    """A live manager with sessions expiring after ``ttl`` s and one gated engine."""
    manager = Manager(ManagerConfig(session_ttl_s=ttl))
    engine = GatedEngine()
    manager.pool.register(engine, name="gated")
    return GatedServer(start_server(manager), engine)


@pytest.mark.timing
def test_idle_sessions_expire_and_busy_or_used_ones_stay() -> None:
    server = _gated_server(TTL)
    live, f = server.live, F
    try:
        idle = P.connect(live.url).open()
        done = idle.call(f, a="1")
        assert done.get(timeout=30) == "A"
        used = P.connect(live.url).open()
        used_var = used.variable(name="kept", value="still here")
        busy = P.connect(live.url).open()
        server.set_gate(False)
        running = busy.call(f, a="2")
        deadline = time.monotonic() + 10 * TTL
        while idle.session_id in server.state(lambda m: set(m.sessions)):
            assert time.monotonic() < deadline, "the idle session did not expire"
            resp = httpx.get(  # a request with its token: keeps the session alive
                f"{live.url}/v1/sessions/{used.session_id}/variables/{used_var.id}",
                headers={"Authorization": f"Bearer {used.token}"},
                timeout=5,
            )
            assert resp.json()["value"] == "still here"
            time.sleep(TTL / 4)
        sessions = server.state(lambda m: set(m.sessions))
        assert used.session_id in sessions and busy.session_id in sessions
        resp = httpx.get(f"{live.url}/v1/sessions/{idle.session_id}/graph", timeout=10)
        assert resp.status_code == 404
        with pytest.raises(P.NotFound):  # the client learns it is gone (and closes its connection)
            idle.close()
        server.set_gate(True)
        assert running.get(timeout=30) == "A"  # the busy session's call finished normally
        used.close()
        busy.close()
    finally:
        server.set_gate(True)
        live.stop()


def _wait_for(server: GatedServer, read, want: object, what: str) -> None:
    deadline = time.monotonic() + 30
    while server.state(read) != want:
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.timing
def test_a_call_that_outlasts_the_ttl_leaves_its_client_a_ttl_to_read_the_result() -> None:
    ttl = 1.0
    server = _gated_server(ttl)
    live, f = server.live, F
    session = P.connect(live.url).open()
    try:
        server.set_gate(False)
        running = session.call(f, a="2")
        states = lambda m: [c.state for c in m.sessions[session.session_id].calls.values()]  # noqa: E731
        _wait_for(server, states, ["running"], "the call never started")
        time.sleep(2 * ttl)  # no request with the token: only the running call keeps the session
        server.set_gate(True)
        _wait_for(server, states, ["done"], "the call never finished")
        # idle for twice the TTL, but its call has just ended: the result must still be readable
        assert server.state(lambda m: m.expire_idle_sessions()) == []
        assert running.get(timeout=30) == "A"
        # a TTL after the last request (the get), with nothing running, it goes
        time.sleep(1.5 * ttl)
        assert session.session_id not in server.state(lambda m: set(m.sessions))
    finally:
        server.set_gate(True)
        with contextlib.suppress(P.NotFound):
            session.close()
        live.stop()


def test_a_ttl_of_zero_on_the_command_line_means_never() -> None:
    from parrot.cli import _parser, manager_config

    assert manager_config(_parser().parse_args(["serve", "--session-ttl", "0"])).session_ttl_s is None
    assert manager_config(_parser().parse_args(["serve"])).session_ttl_s == 3600.0

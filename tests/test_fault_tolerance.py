"""Two real engine processes; one is killed in the middle of a map-reduce DAG.
The manager re-runs the lost calls on the survivor from the inputs it holds:
the application completes with exactly the undisturbed outputs (greedy)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import parrot as P
from tests.procs import Procs, engine_by_url, wait_until

N_MAP = 4
MAP_TOKENS = 400


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.kill_all()


def mapper() -> P.SemanticFunction:
    return P.template_function(
        "Part {{input:i}} of the story: {{output:summary}}",
        # the reduce prompt must fit the tiny model's context: keep 40 characters of each part
        summary=P.Output(
            max_tokens=MAP_TOKENS, ignore_eos=True, transform=P.transforms.regex(r"(?s)\A(.{0,40})")
        ),
    )


def reducer() -> P.SemanticFunction:
    parts = " | ".join(f"{{{{input:s{i}}}}}" for i in range(N_MAP))
    return P.template_function(
        f"Combine: {parts} => {{{{output:all}}}}", all=P.Output(max_tokens=8, ignore_eos=True)
    )


def submit_map_reduce() -> tuple[list[P.SemanticVariable], P.SemanticVariable]:
    m, r = mapper(), reducer()
    maps = [m(str(i)) for i in range(N_MAP)]
    return maps, r(**{f"s{i}": v for i, v in enumerate(maps)})


def graph(url: str, s: P.Session) -> dict:
    return httpx.get(
        f"{url}/v1/sessions/{s.session_id}/graph", headers={"Authorization": f"Bearer {s.token}"}, timeout=10
    ).json()


def test_killing_an_engine_mid_map_reduce_loses_nothing(procs: Procs):
    mgr = procs.manager(heartbeat_interval=0.3, heartbeat_timeout=3, engine_wait=15)
    engines = [procs.engine(mgr), procs.engine(mgr)]
    by_id = {engine_by_url(mgr, e.url)["engine_id"]: e for e in engines}

    with P.connect(mgr.url):
        maps, final = submit_map_reduce()
        expected = [v.get(timeout=120) for v in maps] + [final.get(timeout=120)]

    with P.connect(mgr.url) as s:
        maps, final = submit_map_reduce()

        def busy() -> list[dict]:
            calls = graph(mgr.url, s)["calls"]
            return [c for c in calls if c["state"] == "running" and c["generated_tokens"] >= 20]

        def still_running(victim_id: str) -> set[str]:
            calls = graph(mgr.url, s)["calls"]
            return {c["call_id"] for c in calls if c["state"] == "running" and c["engine_id"] == victim_id}

        def settled(victim_id: str) -> tuple[set[str]] | None:
            """The victim's running calls, once what it sent before it stopped has reached
            the manager (two reads agree)."""
            first = still_running(victim_id)
            time.sleep(0.3)
            return (first,) if first == still_running(victim_id) else None

        # the victim is an engine running a map well under way: the manager may pack the
        # maps onto either engine (latency packing), so which one is known only now
        for _ in range(5):
            running = wait_until(busy, 60, lambda: f"no call got going: {graph(mgr.url, s)}")
            victim_id = running[0]["engine_id"]
            victim = by_id[victim_id]
            victim.signal(signal.SIGSTOP)  # frozen: its calls cannot finish while they are looked at
            (on_victim_ids,) = wait_until(
                lambda v=victim_id: settled(v), 30, lambda: f"its calls kept changing: {graph(mgr.url, s)}"
            )
            on_victim = [c for c in running if c["call_id"] in on_victim_ids]
            if on_victim:
                break
            victim.signal(signal.SIGCONT)  # its calls finished before it stopped (a loaded machine)
        else:
            pytest.fail(f"no engine could be stopped mid-map: {graph(mgr.url, s)}")
        (survivor_id,) = (eid for eid in by_id if eid != victim_id)
        victim.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        got = [v.get(timeout=120) for v in maps] + [final.get(timeout=120)]
        calls = {c["call_id"]: c for c in graph(mgr.url, s)["calls"]}

    assert got == expected
    gone = engine_by_url(mgr, victim.url)
    assert gone is None or gone["alive"] is False  # the manager stopped placing on the killed engine ...
    for c in on_victim:  # ... and the calls running there were re-run, to completion, on the survivor
        assert calls[c["call_id"]]["state"] == "done"
        assert calls[c["call_id"]]["engine_id"] == survivor_id
        assert calls[c["call_id"]]["generated_tokens"] == MAP_TOKENS
    assert time.monotonic() - killed_at < 60

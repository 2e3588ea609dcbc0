"""Objective deduction and scheduling policies, seen through the manager's
introspection endpoint on a real server."""

from __future__ import annotations

import httpx
import pytest

import parrot as P
from parrot.manager.sched.scheduler import SchedulerConfig
from parrot.manager.service import ManagerConfig

N_MAP = 3


def map_reduce(s: P.Session) -> P.SemanticVariable:
    """Map calls wait on a variable set last, so the whole DAG is known before any call is ready."""
    doc = s.variable(name="doc")
    m = P.template_function(
        "Part {{input:i}} of {{input:doc}}: {{output:s}}",
        name="map",
        s=P.Output(max_tokens=4, ignore_eos=True),
    )
    parts = " ".join(f"{{{{input:s{i}}}}}" for i in range(N_MAP))
    r = P.template_function(
        f"All: {parts} => {{{{output:out}}}}",
        name="reduce",
        out=P.Output(max_tokens=4, ignore_eos=True, criteria=P.LATENCY),
    )
    maps = [m(i=str(i), doc=doc) for i in range(N_MAP)]
    out = r(**{f"s{i}": v for i, v in enumerate(maps)})
    doc.set("a document")
    return out


def test_map_calls_form_a_throughput_task_group_feeding_a_latency_reduce(live):
    with P.connect(live.url) as s:
        out = map_reduce(s)
        out.get(timeout=60)
        calls = httpx.get(
            f"{live.url}/v1/sessions/{s.session_id}/graph", headers={"Authorization": f"Bearer {s.token}"}
        ).json()["calls"]
    reduce_call = next(c for c in calls if c["name"] == "reduce")
    map_calls = [c for c in calls if c["name"] == "map"]
    assert len(map_calls) == N_MAP
    assert reduce_call["objective"] == "latency" and reduce_call["task_group"] is None
    assert {c["objective"] for c in map_calls} == {"throughput"}
    assert {c["task_group"] for c in map_calls} == {f"tg:{reduce_call['call_id']}"}
    assert all(c["placement"] for c in calls)  # every call says why it went where it went


@pytest.mark.parametrize("manager_config", [ManagerConfig(policy="baseline-latency")])
def test_baseline_policy_runs_request_by_request_fifo(live):
    with P.connect(live.url) as s:
        map_reduce(s).get(timeout=60)
        calls = httpx.get(
            f"{live.url}/v1/sessions/{s.session_id}/graph", headers={"Authorization": f"Bearer {s.token}"}
        ).json()["calls"]
    assert {c["placement"] for c in calls} == {"fifo"}
    assert all(c["state"] == "done" for c in calls)


def busy_call_id(live, var: P.SemanticVariable) -> str:
    """The id of the call producing ``var``, from the manager's own graph."""
    for session in live.manager.sessions.values():
        found = session.variables.get(var.id)
        if found is not None and found.producer is not None:
            return found.producer.call_id
    raise AssertionError(f"no call produces {var!r}")


def test_a_call_waiting_past_the_queue_deadline_fails_with_timeout(live):
    executor = live.manager.executor
    executor.queue_timeout_s = 0.5
    # a busy engine takes nothing more
    executor.scheduler = SchedulerConfig(latency_cap_tokens=1, latency_cap_scope="all")
    long = P.template_function("go {{input:a}} {{output:b}}", b=P.Output(max_tokens=1500, ignore_eos=True))
    short = P.template_function("hi {{input:a}} {{output:b}}", b=P.Output(max_tokens=2))
    with P.connect(live.url):
        busy = long("1")  # runs alone on the idle engine (the big-call rule)
        with pytest.raises(P.Timeout, match=r"waited more than 0\.5s"):
            short("2").get(timeout=30)
        long_call = live.manager.executor.task(busy_call_id(live, busy))
        assert long_call is not None and not long_call.done()  # the long call was not disturbed


SYSTEM = "You answer questions about lighthouses. " * 8  # 320 bytes: 320 tokens of the tiny model


@pytest.mark.parametrize("manager_config", [ManagerConfig(latency_cap_tokens=420, latency_cap_scope="all")])
def test_a_shared_system_prompt_counts_once_against_the_latency_cap(live):
    """Four latency calls share a 320-token system prompt and have ~20 tokens of their own:
    320 + 4 x 20 fits a 420-token cap, so one round places all four on the engine at once.
    Counting the prompt per call (4 x 340) would admit one call at a time."""
    ask = P.template_function(
        SYSTEM + "{{input:q}} => {{output:a}}", name="ask", a=P.Output(max_tokens=8, ignore_eos=True)
    )
    with P.connect(live.url) as s:
        gate = s.variable(name="gate")
        outs = [ask(q=gate) for _ in range(4)]
        gate.set("Why?")  # every call becomes ready at once
        assert all(o.get(timeout=60) is not None for o in outs)
        calls = httpx.get(
            f"{live.url}/v1/sessions/{s.session_id}/graph", headers={"Authorization": f"Bearer {s.token}"}
        ).json()["calls"]
    assert len(calls) == 4 and {c["objective"] for c in calls} == {"latency"}
    assert max(c["dispatched_at"] for c in calls) < min(c["finished_at"] for c in calls)


@pytest.mark.parametrize(
    "manager_config",
    [
        ManagerConfig(latency_cap_tokens=100, latency_cap_scope="all", saturation_batching=False),
        ManagerConfig(latency_cap_tokens=100, latency_cap_scope="all"),
    ],
    ids=["cap", "saturation-batching"],
)
def test_saturation_batching_runs_queued_latency_calls_past_the_cap(live, manager_config):
    """Eight latency calls under the 320-token system prompt, each 40 tokens of its own
    (32 generated): the 100-token cap runs two at a time; with saturation batching the
    eight, queued together, share the engine's steps."""
    ask = P.template_function(
        SYSTEM + "{{input:q}} => {{output:a}}", name="ask", a=P.Output(max_tokens=32, ignore_eos=True)
    )
    with P.connect(live.url) as s:
        gate = s.variable(name="gate")
        outs = [ask(q=gate) for _ in range(8)]
        gate.set("Why?")
        assert all(o.get(timeout=60) is not None for o in outs)
        calls = httpx.get(
            f"{live.url}/v1/sessions/{s.session_id}/graph", headers={"Authorization": f"Bearer {s.token}"}
        ).json()["calls"]
    assert len(calls) == 8 and {c["objective"] for c in calls} == {"latency"}
    together = max(c["dispatched_at"] for c in calls) < min(c["finished_at"] for c in calls)
    assert together == manager_config.saturation_batching  # on by default

"""The DAG: producers, consumers, readiness, cycles, failure propagation."""

import asyncio

import pytest

from parrot.manager.dag.graph import (
    Call,
    OutputSpec,
    Variable,
    fail_call,
    link_call,
    materialise,
)
from parrot.protocol.errors import CallFailed, Conflict, CycleError
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.template import parse_template


def var(name):
    return Variable(f"v-{name}", "s", name=name)


def call(cid, inputs, outputs):
    t = parse_template(
        " ".join([f"{{{{input:{k}}}}}" for k in inputs] + [f"{{{{output:{k}}}}}" for k in outputs])
    )
    return Call(
        cid, "s", cid, t, dict(inputs), {k: OutputSpec(k, v, SamplingParams()) for k, v in outputs.items()}
    )


def test_chain_becomes_ready_step_by_step():
    a, b, c = var("a"), var("b"), var("c")
    c1 = call("c1", {"x": a}, {"y": b})
    c2 = call("c2", {"x": b}, {"y": c})
    link_call(c1)
    link_call(c2)
    assert a.consumers == [c1] and b.producer is c1 and b.consumers == [c2]
    assert materialise(a, "A") == [c1]
    assert c1.state == "ready" and c2.state == "waiting"
    assert materialise(b, "B") == [c2]


def test_second_producer_is_rejected_without_linking():
    a, b = var("a"), var("b")
    link_call(call("c1", {"x": a}, {"y": b}))
    c2 = call("c2", {"x": a}, {"y": b})
    with pytest.raises(Conflict, match="already produced"):
        link_call(c2)
    assert a.consumers and all(c.call_id == "c1" for c in a.consumers)


def test_cycle_through_a_preexisting_output_variable_is_rejected():
    x, y = var("x"), var("y")
    link_call(call("c1", {"i": x}, {"o": y}))
    back = call("c2", {"i": y}, {"o": x})  # x feeds c1 which feeds y -> x
    with pytest.raises(CycleError):
        link_call(back)
    assert x.producer is None and len(y.consumers) == 0


def test_self_loop_is_rejected():
    x = var("x")
    with pytest.raises(CycleError):
        link_call(call("c1", {"i": x}, {"o": x}))


def test_failure_propagates_downstream_and_wakes_nobody_forever():
    a, b, c, d = var("a"), var("b"), var("c"), var("d")
    c1 = call("c1", {"x": a}, {"y": b})
    c2 = call("c2", {"x": b}, {"y": c})
    c3 = call("c3", {"x": c}, {"y": d})
    for cc in (c1, c2, c3):
        link_call(cc)
    fail_call(c1, CallFailed("engine exploded"))
    assert [cc.state for cc in (c1, c2, c3)] == ["failed"] * 3
    assert [v.state for v in (b, c, d)] == ["failed"] * 3
    assert "engine exploded" in d.error.message
    assert d.error.detail["origin_call"] == "c1"  # the root cause, not the nearest failure


def test_wait_change_times_out_and_forgets_its_future():
    async def main() -> list:
        v = var("v")
        await v.wait_change(0.01)
        return v._waiters or []

    assert asyncio.run(main()) == []

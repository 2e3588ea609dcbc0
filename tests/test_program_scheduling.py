"""Program-level scheduling: applications ranked by their attained service (least first,
in discrete levels), then by their place; the engines serve fills and generations in the
manager's order (priority, then arrival)."""

from __future__ import annotations

import asyncio

import pytest

import parrot as P
import tests.test_app_fifo as fifo
from parrot.cli import _parser, manager_config
from parrot.manager.dag.graph import Call
from parrot.manager.sched.queue_order import SERVICE_LEVEL_TOKENS, QueueOrder, service_level
from parrot.manager.service import ManagerConfig
from parrot.protocol.schemas import ENGINE_PRIORITY_MAX, FillRequest, GenerateRequest
from parrot.protocol.tokenizer import TextTokenizer
from parrot.sim import clock as sim_clock
from parrot.sim.cost import StepCost
from parrot.sim.engine import SimEngine
from tests.test_app_fifo import ONE_AT_A_TIME, chain_and_later_app


def _call(session: str, seq: int) -> Call:
    call = Call(f"{session}-{seq}", session, None, None, {}, {})  # type: ignore[arg-type]
    call.seq = seq
    return call


def test_service_levels_grow_by_four_times_from_the_first_threshold():
    q = SERVICE_LEVEL_TOKENS
    levels = [service_level(t) for t in (0, q - 1, q, 4 * q - 1, 4 * q, 16 * q, 10**30)]
    assert levels[:6] == [0, 0, 1, 1, 2, 3]
    assert levels[6] < 64  # bounded, so an engine priority stays within 63 bits


@pytest.mark.parametrize("by_service", [True, False], ids=["program-level", "app-fifo"])
def test_an_application_with_less_service_ranks_first_only_under_program_scheduling(by_service: bool):
    order = QueueOrder(by_service=by_service)
    a1, a2, b1 = _call("A", 0), _call("A", 1), _call("B", 0)
    order.enter(a1, 0)
    order.enter(a2, 1)
    order.enter(b1, 2)
    order.attain(a1, SERVICE_LEVEL_TOKENS)  # a1 ran: A has passed the first threshold
    order.leave(a1)
    a_first = order.rank(a2, 1, True) < order.rank(b1, 2, True)
    a_prio_first = order.engine_priority(a2, 1, True) < order.engine_priority(b1, 2, True)
    assert a_first is a_prio_first is (not by_service)
    for call, arrival in ((a2, 1), (b1, 2)):
        assert 0 <= order.engine_priority(call, arrival, True) <= ENGINE_PRIORITY_MAX
    # request-level ranking (each request its own application): arrival order, no levels
    assert order.rank(a2, 1, False) < order.rank(b1, 2, False)


def test_an_application_whose_work_ended_starts_again_at_the_first_level():
    order = QueueOrder(by_service=True)
    a1 = _call("A", 0)
    order.enter(a1, 0)
    order.attain(a1, 100 * SERVICE_LEVEL_TOKENS)
    assert order.level(a1, True) > 0
    order.leave(a1)
    assert order.attained == {} and order.level(_call("A", 1), True) == 0


def _a_long_first_call(name: str) -> P.SemanticFunction:
    # estimated at more than the first threshold (prompt + max_tokens), so A passes it when a1 ends
    out = P.Output(max_tokens=SERVICE_LEVEL_TOKENS)
    return P.template_function(f"{name} {{{{input:x}}}} =>{{{{output:o}}}}", name=name, o=out)


@pytest.mark.parametrize("program_scheduling", [True, False], ids=["program-level", "app-fifo"])
def test_a_short_application_overtakes_the_next_call_of_a_long_one(program_scheduling: bool, monkeypatch):
    """A's a1 (over the first service threshold) runs, held at the gate, while B's b1 queues
    on an engine that fits one call at a time; the gate opens, a1 ends and A's a2 is ready
    beside b1.  Under program-level scheduling B (no service yet) goes first; under app-FIFO
    A keeps its earlier place."""
    short = fifo.fn
    monkeypatch.setattr(fifo, "fn", lambda name: _a_long_first_call(name) if name == "a1" else short(name))
    config = ManagerConfig(program_scheduling=program_scheduling, **ONE_AT_A_TIME)
    _, order = chain_and_later_app(config, b_queues=True)
    assert order == (["a1", "b1", "a2"] if program_scheduling else ["a1", "a2", "b1"])


def test_the_cli_switch_turns_program_scheduling_on():
    assert manager_config(_parser().parse_args(["serve"])).program_scheduling is False
    assert manager_config(_parser().parse_args(["serve", "--program-scheduling"])).program_scheduling is True


@pytest.mark.parametrize("model", [FillRequest, GenerateRequest])
def test_an_engine_priority_out_of_range_is_refused(model):
    ok = {"tokens": [1], "context_id": 1} if model is FillRequest else {"context_id": 1}
    assert model(**ok, priority=ENGINE_PRIORITY_MAX).priority == ENGINE_PRIORITY_MAX
    for bad in (-1, ENGINE_PRIORITY_MAX + 1):
        with pytest.raises(ValueError):
            model(**ok, priority=bad)


# ------------------------------------------------------------ the engine's order

COST = StepCost(base=0.010, per_prefill_token=0.0005, per_decode_seq=0.0003, per_kv_token=0.0)


def _fill_end_times(priorities: tuple[int, int]) -> tuple[float, float]:
    """A's 3,000-token prompt is queued first, then B's 100-token prompt; one engine with
    steps of 2,048 tokens.  Returns when each fill ended (virtual seconds)."""
    tokenizer = TextTokenizer.byte_level_tiny()

    async def run() -> tuple[float, float]:
        engine = SimEngine(tokenizer, COST, model_name="sim", prefix_cache=False)
        loop = asyncio.get_running_loop()
        ends: dict[str, float] = {}

        async def fill(name: str, n: int, context_id: int, priority: int) -> None:
            await engine.fill([7] * n, context_id, priority=priority)
            ends[name] = loop.time()

        try:
            # both queued before the engine's first step, A first
            await asyncio.gather(fill("A", 3000, 1, priorities[0]), fill("B", 100, 2, priorities[1]))
        finally:
            await engine.close()
        return ends["A"], ends["B"]

    return sim_clock.run(run())


def test_the_engine_computes_the_prompt_of_a_higher_priority_first():
    a_end, b_end = _fill_end_times((5, 1))
    assert b_end < a_end  # B's prompt went into the first step, ahead of A's chunk
    a_end, b_end = _fill_end_times((0, 0))
    assert b_end >= a_end  # first come first served: A's chunk filled the first step

"""Early prefill: a call waiting for its inputs has its template's constant start filled on
an engine, in a retained context, which the call's own fill then reads from the prefix
cache; the context is freed once the call has started or ended."""

from __future__ import annotations

import asyncio

import pytest

from parrot.cli import _parser, manager_config
from parrot.manager.early_prefill import BACKGROUND_PRIORITY
from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol.schemas import PlaceholderBinding, SubmitCall
from parrot.protocol.tokenizer import TextTokenizer
from parrot.sim import clock as sim_clock
from parrot.sim.cost import StepCost
from parrot.sim.engine import SimEngine

COST = StepCost(base=0.010, per_prefill_token=0.0005, per_decode_seq=0.0003, per_kv_token=0.0)
INSTRUCTIONS = "Follow these instructions with great care. " * 20  # ~880 bytes, far over the minimum
SAMPLING = {"sampling": {"max_tokens": 8, "ignore_eos": True}}


def _submit(manager: Manager, session, template: str, **bindings):
    placeholders = [
        PlaceholderBinding(name=n, **b) if isinstance(b, dict) else PlaceholderBinding(name=n, value=b)
        for n, b in bindings.items()
    ]
    return manager.submit_call(session, SubmitCall(template=template, placeholders=placeholders))


def _run(config: ManagerConfig, later_input: str | None = None) -> dict:
    """Session: call ``first`` (ready), then ``second`` whose template starts with long
    constant instructions and reads ``first``'s output, or (``later_input``) a variable
    the client sets after a pause.  Returns what the engine and the calls show."""
    tokenizer = TextTokenizer.byte_level_tiny()

    async def main() -> dict:
        manager = Manager(config)
        engine = SimEngine(tokenizer, COST, model_name="tiny")
        manager.pool.register(engine)
        await manager.poll_engine_stats()
        fills: list[tuple[int, int, bool]] = []  # (tokens, priority, retain)
        original = engine.fill

        async def fill(tokens, context_id, parent_context_id=None, cache_salt="", **kw):
            fills.append((len(tokens), kw.get("priority", 0), kw.get("retain", False)))
            return await original(tokens, context_id, parent_context_id, cache_salt, **kw)

        engine.fill = fill  # type: ignore[method-assign]
        session = manager.create_session()[0]
        first = _submit(manager, session, "Say something: {{output:a}}", a=SAMPLING)
        if later_input is None:
            source = {"var_id": first.outputs["a"].var.var_id}
        else:
            source = {"var_id": manager.create_variable(session, None, None).var_id}
        second = _submit(
            manager, session, INSTRUCTIONS + "Now: {{input:x}} => {{output:b}}", x=source, b=SAMPLING
        )
        await asyncio.sleep(0.5)  # the early fill (if any) is done by now
        retained = [c.retained for c in engine.contexts]
        if later_input is not None:
            manager.set_variable(session, source["var_id"], later_input)
        out = second.outputs["b"].var
        while out.state == "pending":
            await manager.wait_variable(out, 60.0)
        await asyncio.sleep(0.1)
        left = len(engine.contexts)
        await manager.executor.drain()
        await engine.close()
        early = manager.executor.early
        return {
            "fills": fills,
            "retained_while_waiting": retained,
            "contexts_left": left,
            "second_reused": second.prefix_reused_tokens,
            "second_state": second.state,
            "early_fills": 0 if early is None else early.fills,
        }

    return sim_clock.run(main())


@pytest.mark.parametrize("later", [False, True], ids=["chain", "client-set-input"])
def test_a_waiting_calls_constant_start_is_filled_early_and_read_from_the_prefix_cache(later: bool):
    got = _run(ManagerConfig(inline_tokenize_bytes=None), later_input="an answer" if later else None)
    assert got["early_fills"] == 1 and got["second_state"] == "done"
    early = [f for f in got["fills"] if f[2]]
    assert len(early) == 1 and early[0][1] == BACKGROUND_PRIORITY
    assert early[0][0] >= len(INSTRUCTIONS) - 16  # byte-level tokenizer: a token per byte
    assert True in got["retained_while_waiting"]  # the engine keeps it for the call
    # the call's own fill took the whole blocks of the start from the cache (the last,
    # partial block of the early fill is not cached)
    assert got["second_reused"] >= early[0][0] - 16
    assert got["contexts_left"] == 0  # the early context was freed once the call started


def test_without_early_prefill_the_call_computes_its_whole_prompt():
    got = _run(ManagerConfig(inline_tokenize_bytes=None, early_prefill=False), later_input="an answer")
    assert got["early_fills"] == 0 and not any(f[2] for f in got["fills"])
    assert got["second_reused"] == 0 and got["second_state"] == "done"


def test_a_short_constant_start_is_not_filled_early():
    tokenizer = TextTokenizer.byte_level_tiny()

    async def main() -> int:
        manager = Manager(ManagerConfig(inline_tokenize_bytes=None))
        engine = SimEngine(tokenizer, COST, model_name="tiny")
        manager.pool.register(engine)
        session = manager.create_session()[0]
        var = manager.create_variable(session, None, None)
        call = _submit(
            manager, session, "Short: {{input:x}} => {{output:b}}", x={"var_id": var.var_id}, b=SAMPLING
        )
        await asyncio.sleep(0.1)
        assert call.state == "waiting"
        await manager.executor.drain()
        await engine.close()
        return manager.executor.early.fills  # type: ignore[union-attr]

    assert sim_clock.run(main()) == 0


def test_the_cli_switch_turns_early_prefill_off():
    assert manager_config(_parser().parse_args(["serve"])).early_prefill is True
    assert manager_config(_parser().parse_args(["serve", "--no-early-prefill"])).early_prefill is False


def test_calls_of_one_template_share_one_early_fill_held_until_the_last_has_started():
    tokenizer = TextTokenizer.byte_level_tiny()

    async def main() -> list[tuple[int, int, bool]]:
        manager = Manager(ManagerConfig(inline_tokenize_bytes=None))
        engine = SimEngine(tokenizer, COST, model_name="tiny")
        manager.pool.register(engine)
        await manager.poll_engine_stats()
        session = manager.create_session()[0]
        template = INSTRUCTIONS + "Now: {{input:x}} => {{output:b}}"
        inputs = [manager.create_variable(session, None, None) for _ in range(2)]
        calls = [_submit(manager, session, template, x={"var_id": v.var_id}, b=SAMPLING) for v in inputs]
        await asyncio.sleep(0.5)
        early = manager.executor.early
        assert early is not None and early.fills == 1 and early.held() == 1
        seen = []
        for var, call in zip(inputs, calls, strict=True):
            manager.set_variable(session, var.var_id, "go")
            out = call.outputs["b"].var
            while out.state == "pending":
                await manager.wait_variable(out, 60.0)
            await asyncio.sleep(0.1)
            seen.append(
                (early.held(), len(engine.contexts), call.prefix_reused_tokens >= len(INSTRUCTIONS) - 32)
            )
        await manager.executor.drain()
        await engine.close()
        return seen

    # after the first call: still held for the second (its context retained); after both: gone
    assert sim_clock.run(main()) == [(1, 1, True), (0, 0, True)]

"""The fake engine the manager tests drive (tests.fake_engine.GatedEngine) answers as the
real engine does where those tests rely on it: unknown contexts are rejected with the same
errors, and its stats count what it holds (issue 41)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from parrot.engine.local import LocalEngine
from parrot.protocol.errors import ParrotError
from parrot.protocol.sampling import SamplingParams
from tests.fake_engine import GatedEngine

SP = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


async def _drain(engine: Any, context_id: int, parent: int | None = None) -> None:
    async for _ in engine.generate(SP, context_id, parent):
        pass


SCENARIOS: dict[str, Callable[[Any], Awaitable[None]]] = {
    "generate on an unknown context": lambda e: _drain(e, 901),
    "generate forking from an unknown parent": lambda e: _drain(e, 902, 903),
    "fill forking from an unknown parent": lambda e: e.fill([5, 6], 904, 905),
    "free an unknown context": lambda e: e.free_context(906),
    "a context its own parent": lambda e: e.fill([5], 907, 907),
}


async def _outcome(engine: Any, scenario: Callable[[Any], Awaitable[None]]) -> tuple[str, str | None]:
    try:
        await scenario(engine)
    except ParrotError as exc:
        return type(exc).__name__, exc.code
    return "ok", None


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_unknown_contexts_are_rejected_as_the_real_engine_rejects_them(tiny_engine: LocalEngine, name: str):
    scenario = SCENARIOS[name]
    real = asyncio.run(_outcome(tiny_engine, scenario))
    fake = asyncio.run(_outcome(GatedEngine(), scenario))
    assert real[0] != "ok" and fake == real


def test_a_fork_of_an_existing_context_under_another_parent_conflicts_on_both(tiny_engine: LocalEngine):
    async def scenario(engine: Any) -> tuple[str, str | None]:
        await engine.fill([5, 6, 7], 911)
        await engine.fill([8], 912, 911)
        await engine.fill([9], 913)
        try:
            return await _outcome(engine, lambda e: e.fill([1], 912, 913))
        finally:
            for c in (912, 911, 913):
                await engine.free_context(c)

    assert (
        asyncio.run(scenario(GatedEngine()))
        == asyncio.run(scenario(tiny_engine))
        == ("Conflict", "context_conflict")
    )


def test_its_stats_count_contexts_generations_and_tokens():
    async def main() -> None:
        engine = GatedEngine(token_capacity=1000)
        await engine.fill([1, 2, 3], 1)
        await engine.fill([4], 2, 1)  # a fork: 3 tokens of its parent and its own
        engine.gate.clear()
        stream = engine.generate(SP, 2)
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        stats = await engine.stats()
        assert (stats.num_contexts, stats.num_running, stats.token_load) == (2, 1, 4)
        assert (stats.fills, stats.filled_tokens, stats.generates, stats.token_capacity) == (2, 4, 1, 1000)
        assert stats.kv_tokens_used == 3 + 4
        engine.gate.set()
        chunk = await waiting
        assert chunk.done and chunk.token_ids == [65]
        await engine.free_context(2)
        stats = await engine.stats()
        assert (stats.num_contexts, stats.num_running, stats.generated_tokens, stats.kv_tokens_used) == (
            1,
            0,
            1,
            3,
        )

    asyncio.run(main())

"""The local engine builds its runner (and can load its model) on its own thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from parrot.engine.loader import LoadedModel, load_model
from parrot.engine.local import LocalEngine
from parrot.engine.runner import EngineRunner
from parrot.protocol.sampling import SamplingParams


def test_a_loader_runs_on_the_engine_thread_which_then_serves() -> None:
    seen: list[threading.Thread] = []

    def load() -> LoadedModel:
        seen.append(threading.current_thread())
        return load_model("tiny")

    engine = LocalEngine(load)
    try:
        assert seen == [engine.runner._thread] and seen[0] is not threading.main_thread()

        async def go() -> list[int]:
            await engine.fill([5, 6, 7], 1)
            out = [
                t
                async for c in engine.generate(SamplingParams(max_tokens=4, temperature=0.0), 1)
                for t in c.token_ids
            ]
            await engine.free_context(1)
            return out

        assert len(asyncio.run(go())) == 4
    finally:
        engine.close()
    assert not seen[0].is_alive()


def test_a_failing_build_raises_to_the_caller_and_leaves_no_thread() -> None:
    before = {t.ident for t in threading.enumerate()}

    def load() -> LoadedModel:
        raise ValueError("no such model: nope")

    with pytest.raises(ValueError, match="no such model: nope"):
        LocalEngine(load)
    with pytest.raises(ValueError, match="max_step_tokens must be >= 1"):
        EngineRunner.start_on_own_thread(lambda: EngineRunner(load_model("tiny"), max_step_tokens=0))
    for t in threading.enumerate():
        if t.ident not in before:
            t.join(5)
            assert not t.is_alive(), t.name

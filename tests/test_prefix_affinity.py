"""Prefix affinity places a call by the shared starts long enough to be worth it:
a start of at least ``min_prefix_tokens`` tokens keeps its sharers on the engine that
holds it; a shorter one (a one-line instruction at the head of every map of every
map-reduce app) places nothing, so its sharers spread over idle engines."""

from __future__ import annotations

import asyncio

import pytest

from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol.schemas import EngineStats, PlaceholderBinding, SubmitCall
from parrot.protocol.tokenizer import TextTokenizer
from tests.fake_engine import GatedEngine

SHORT = "Summarise this part.\n"  # 21 characters: 21 tokens of the byte tokenizer
LONG = "You summarise parts of long documents, one part at a time, in plain words.\n"  # 75


class HeldEngine(GatedEngine):
    """Holds every generation until its gate opens, so a placed call keeps its load."""

    def __init__(self, tokenizer: TextTokenizer):
        super().__init__(tokenizer)
        self.gate.clear()

    async def stats(self) -> EngineStats:
        return EngineStats(token_capacity=32768, latency_cap_tokens=30000)


def summary_call(manager: Manager, instruction: str, part: str):
    session = manager.create_session()[0]  # one app per call: no task group joins them
    bindings = [
        PlaceholderBinding(name="part", value=part),
        PlaceholderBinding(name="y", sampling={"max_tokens": 8}, criteria="LATENCY"),
    ]
    template = instruction + "{{input:part}}\nSummary: {{output:y}}"
    return manager.submit_call(session, SubmitCall(template=template, placeholders=bindings))


async def placed(engines: list[HeldEngine], n: int) -> None:
    for _ in range(400):
        if sum(len(e.generated) for e in engines) >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"fewer than {n} calls started")


@pytest.mark.parametrize(
    ("instruction", "together", "reason"),
    [(SHORT, False, "find-engine"), (LONG, True, "prefix-engine")],
)
def test_only_a_shared_start_of_min_prefix_tokens_keeps_its_sharers_together(
    instruction: str, together: bool, reason: str
):
    async def main() -> None:
        # latency calls spread over idle engines (not packed): only affinity keeps them together
        manager = Manager(ManagerConfig(min_prefix_tokens=32, pack_latency=False))
        tokenizer = TextTokenizer.byte_level_tiny()
        engines = [HeldEngine(tokenizer), HeldEngine(tokenizer)]
        for e in engines:
            manager.pool.register(e)
        await manager.poll_engine_stats()
        first = summary_call(manager, instruction, "The harbour froze early that winter. " * 4)
        await placed(engines, 1)
        second = summary_call(manager, instruction, "A new lamp arrived by the spring boat. " * 4)
        await placed(engines, 2)
        assert (first.engine_id == second.engine_id) is together
        assert second.placement == reason
        for e in engines:
            e.gate.set()
        for _ in range(400):
            if first.state == second.state == "done":
                break
            await asyncio.sleep(0.005)
        assert first.state == second.state == "done", (first.error, second.error)
        await manager.executor.drain()

    asyncio.run(main())

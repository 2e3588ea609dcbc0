"""A fake engine for manager tests: instant, one token per output, with a gate that holds
generation, and a live manager server around it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from parrot.manager.service import Manager
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import EngineStats, GenerateChunk
from parrot.protocol.tokenizer import TextTokenizer
from tests.conftest import LiveServer


class GatedEngine:
    """Generates one token ("A") per output, but only while its gate is open.

    ``gate`` is an :class:`asyncio.Event` of the loop the engine runs on; ``generated``
    lists the context ids in the order their generation began, ``priorities`` the
    priority each of those generations carried.
    """

    model_name = "fake"

    def __init__(self, tokenizer: TextTokenizer | None = None, max_seq_len: int = 4096) -> None:
        self.tokenizer = tokenizer or TextTokenizer.byte_level_tiny()
        self.max_seq_len = max_seq_len
        self.gate = asyncio.Event()
        self.gate.set()
        self.generated: list[int] = []
        self.priorities: list[int] = []

    async def fill(
        self,
        tokens: Sequence[int],
        context_id: int,
        parent_context_id: int | None = None,
        cache_salt: str = "",
        *,
        priority: int = 0,
        retain: bool = False,
    ) -> None:
        await asyncio.sleep(0)

    async def generate(
        self,
        sampling: SamplingParams,
        context_id: int,
        parent_context_id: int | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[GenerateChunk]:
        self.generated.append(context_id)
        self.priorities.append(priority)
        await self.gate.wait()
        yield GenerateChunk(token_ids=[65], text="A", done=True, finish_reason="length")

    async def free_context(self, context_id: int) -> None:
        return None

    async def stats(self) -> EngineStats:
        return EngineStats()

    async def set_token_capacity(self, n: int) -> None:
        return None


@dataclass(frozen=True)
class GatedServer:
    """A live manager server whose one engine is a :class:`GatedEngine`."""

    live: LiveServer
    engine: GatedEngine

    def set_gate(self, open_: bool) -> None:
        """Open or close the engine's gate (on the server's loop)."""

        async def flip() -> None:
            if open_:
                self.engine.gate.set()
            else:
                self.engine.gate.clear()

        self.live.run_on_loop(flip())

    def state(self, read: Callable[[Manager], object]) -> object:
        """``read(manager)``, run on the server's loop (where the manager's state lives)."""

        async def run() -> object:
            return read(self.live.manager)

        return self.live.run_on_loop(run())

"""A fake engine for manager tests: instant, one token per output, with a gate that holds
generation, and a live manager server around it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from parrot.manager.service import Manager
from parrot.protocol.errors import BadRequest, Conflict, NotFound
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import EngineStats, GenerateChunk
from parrot.protocol.tokenizer import TextTokenizer
from tests.conftest import LiveServer


class GatedEngine:
    """Generates one token ("A") per output, but only while its gate is open.

    ``gate`` is an :class:`asyncio.Event` of the loop the engine runs on; ``generated``
    lists the context ids in the order their generation began, ``priorities`` the
    priority each of those generations carried.

    Its contexts behave as the real engine's (:class:`~parrot.engine.core.contexts.ContextTable`,
    the step planner's admission): a fill creates its context (forked from a parent that
    must exist) or extends it; a generate needs its context to exist or a parent to fork
    from; freeing an unknown context fails; the same errors, with the same codes.  Its
    stats count its contexts, running generations and tokens (``token_capacity``: what it
    reports as its capacity; 0, unknown, by default).
    """

    model_name = "fake"

    def __init__(
        self, tokenizer: TextTokenizer | None = None, max_seq_len: int = 4096, token_capacity: int = 0
    ) -> None:
        self.tokenizer = tokenizer or TextTokenizer.byte_level_tiny()
        self.max_seq_len = max_seq_len
        self.token_capacity = token_capacity
        self.gate = asyncio.Event()
        self.gate.set()
        self.generated: list[int] = []
        self.priorities: list[int] = []
        self.contexts: dict[int, int] = {}  # context id -> its length in tokens
        self._parents: dict[int, int | None] = {}
        self._running: set[int] = set()  # contexts generating (or waiting at the gate)
        self._counts = {"fills": 0, "filled_tokens": 0, "generates": 0, "generated_tokens": 0}

    def _open(self, context_id: int, parent_context_id: int | None) -> None:
        """ContextTable.open's rules and errors."""
        if context_id in self.contexts:
            if parent_context_id is not None and self._parents[context_id] != parent_context_id:
                raise Conflict(
                    f"context {context_id} exists and is not a child of context {parent_context_id}",
                    code="context_conflict",
                )
            return
        length = 0
        if parent_context_id is not None:
            if parent_context_id == context_id:
                raise BadRequest("a context cannot be its own parent")
            length = self._get(parent_context_id)
        self.contexts[context_id] = length
        self._parents[context_id] = parent_context_id

    def _get(self, context_id: int) -> int:
        if context_id not in self.contexts:
            raise NotFound(f"context {context_id} does not exist", code="context_not_found")
        return self.contexts[context_id]

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
        self._open(context_id, parent_context_id)
        self.contexts[context_id] += len(tokens)
        self._counts["fills"] += 1
        self._counts["filled_tokens"] += len(tokens)

    async def generate(
        self,
        sampling: SamplingParams,
        context_id: int,
        parent_context_id: int | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[GenerateChunk]:
        if parent_context_id is None and context_id not in self.contexts:
            raise BadRequest(f"context {context_id} has no tokens to generate from")
        self._open(context_id, parent_context_id)
        self.generated.append(context_id)
        self.priorities.append(priority)
        self._counts["generates"] += 1
        self._running.add(context_id)
        try:
            await self.gate.wait()
        finally:
            self._running.discard(context_id)
        if context_id in self.contexts:  # (freed meanwhile: the real engine cancels the generation)
            self.contexts[context_id] += 1
        self._counts["generated_tokens"] += 1
        yield GenerateChunk(token_ids=[65], text="A", done=True, finish_reason="length")

    async def free_context(self, context_id: int) -> None:
        self._get(context_id)
        del self.contexts[context_id]
        del self._parents[context_id]

    async def stats(self) -> EngineStats:
        load = sum(self.contexts.get(c, 0) for c in self._running)
        return EngineStats(
            num_contexts=len(self.contexts),
            num_running=len(self._running),
            token_load=load,
            token_capacity=self.token_capacity,
            kv_tokens_used=sum(self.contexts.values()),
            **self._counts,
        )

    async def set_token_capacity(self, n: int) -> None:
        self.token_capacity = n


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

"""The engine interface the manager programs against (the paper's primitives).

Implemented in-process by :class:`parrot.engine.local.LocalEngine` and over
HTTP by :class:`parrot.manager.backends.remote_engine.RemoteEngine`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import EngineStats, GenerateChunk
from parrot.protocol.tokenizer import TextTokenizer


class EngineAPI(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def max_seq_len(self) -> int: ...

    @property
    def tokenizer(self) -> TextTokenizer: ...

    async def fill(
        self,
        tokens: Sequence[int],
        context_id: int,
        parent_context_id: int | None = None,
        cache_salt: str = "",
        *,
        priority: int = 0,
        retain: bool = False,
    ) -> int | None:
        """Append ``tokens`` to the context, creating it (forked from the parent) if needed.
        A context created here reuses and offers cached prefix blocks only among
        contexts of the same ``cache_salt`` (a fork keeps its parent's).  Returns how
        many of ``tokens`` took their KV from the prefix cache instead of being computed
        (0 to ``len(tokens)``), or None when the engine does not know.  ``priority``: as
        :meth:`generate`'s (the prompt's computation is served in that order).
        ``retain``: a context this creates holds a prefix computed ahead for a call that
        has not run yet; the engine evicts its KV only after other idle contexts'."""

    def generate(
        self,
        sampling: SamplingParams,
        context_id: int,
        parent_context_id: int | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[GenerateChunk]:
        """Stream generated chunks; the last has ``done`` set.  Closing early cancels.

        ``priority`` (lower first, 0 to :data:`~parrot.protocol.schemas.ENGINE_PRIORITY_MAX`):
        the call's place in the manager's order (:meth:`parrot.manager.sched.queue_order.QueueOrder.
        engine_priority`), for an engine that orders its own queue by it.  Parrot's own engines
        admit jobs and compute prompts in that order (then first-come first-served); an
        OpenAI-compatible backend sends it with ``send_priority`` (vLLM started with
        ``--scheduling-policy priority``)."""

    async def free_context(self, context_id: int) -> None: ...

    async def stats(self) -> EngineStats: ...

    async def set_token_capacity(self, n: int) -> None: ...

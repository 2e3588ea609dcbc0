"""The engine's unit of work: a fill or a generate on one context (no torch)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from parrot.engine.contexts import Context
from parrot.engine.stopping import StopStringFilter
from parrot.protocol.errors import ParrotError
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import GenerateChunk
from parrot.protocol.tokenizer import IncrementalDecoder

if TYPE_CHECKING:
    import torch

__all__ = ["ChunkCallback", "FinishCallback", "Job"]

FinishCallback = Callable[[ParrotError | None], None]
ChunkCallback = Callable[[GenerateChunk], None]


@dataclass(eq=False)
class Job:
    """A fill (``sampling is None``) or a generate on one context."""

    context_id: int
    parent_context_id: int | None
    tokens: list[int] = field(default_factory=list)
    sampling: SamplingParams | None = None
    on_chunk: ChunkCallback | None = None
    on_finish: FinishCallback | None = None
    internal: bool = False  # a flush the runner made itself
    cache_salt: str = ""  # the prefix-cache salt of the context it creates (a fill's)
    ctx: Context | None = None  # set once admitted; the job then owns ``ctx.busy``
    cancelled: bool = False
    arrival: int = 0  # first-come first-served order, kept across preemptions
    preempted: bool = False  # waiting again after preemption (``ctx`` still set and busy)
    # generate state
    generated: int = 0
    generator: torch.Generator | None = None
    decoder: IncrementalDecoder | None = None
    stops: StopStringFilter | None = None

    @property
    def is_generate(self) -> bool:
        return self.sampling is not None

"""The engine's unit of work: a fill or a generate on one context (no torch)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from parrot.engine.core.contexts import Context
from parrot.engine.core.stopping import StopStringFilter
from parrot.protocol.errors import BadRequest, ParrotError
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import GenerateChunk
from parrot.protocol.tokenizer import IncrementalDecoder

if TYPE_CHECKING:
    import torch

__all__ = ["ChunkCallback", "FinishCallback", "Job", "check_token_ids", "finish_job", "reused_of"]

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
    cached_tokens: int = 0  # pending tokens whose KV it took from the prefix cache
    ctx: Context | None = None  # set once admitted; the job then owns ``ctx.busy``
    cancelled: bool = False
    arrival: int = 0  # first-come first-served order, kept across preemptions
    # lower first: the manager's order of the call it belongs to (its application's attained
    # service and place); jobs of equal priority keep first-come first-served order
    priority: int = 0
    # a fill creating its context marks it retained: kept for a call that will read it
    # (its KV is evicted only after every other idle context's; parrot.engine.core.memory)
    retain: bool = False
    preempted: bool = False  # waiting again after preemption (``ctx`` still set and busy)
    # generate state
    generated: int = 0
    generator: torch.Generator | None = None
    decoder: IncrementalDecoder | None = None
    stops: StopStringFilter | None = None
    # times each token was generated so far, kept only when the sampling has penalties
    counts: dict[int, int] | None = None
    # the llguidance matcher of a constrained generate (engine.grammar), its own per fork
    matcher: Any = None

    @property
    def is_generate(self) -> bool:
        return self.sampling is not None

    @property
    def order(self) -> tuple[int, int]:
        """The engine's order of service: priority, then arrival (lower first)."""
        return (self.priority, self.arrival)


def finish_job(job: Job, error: ParrotError | None, finish_reason: str | None = None) -> None:
    """Tell ``job``'s caller it ended (once; an internal job has no caller): a cancelled
    generate's stream gets its last chunk, then ``on_finish`` gets ``error``."""
    if job.internal:
        return
    if finish_reason == "cancelled" and job.on_chunk is not None:
        job.on_chunk(GenerateChunk(done=True, finish_reason="cancelled"))
    if job.on_finish is not None:
        job.on_finish(error)
        job.on_finish = None


def reused_of(job: Job) -> int:
    """How many of a fill's own tokens took their KV from the prefix cache: at most its
    token count (a context preempted and resumed may take back blocks it computed itself;
    those count once, as the fill's tokens)."""
    return min(job.cached_tokens, len(job.tokens))


def check_token_ids(tokens: Sequence[int], vocab_size: int) -> list[int]:
    """``tokens`` as ints, or BadRequest (``invalid_tokens``) naming those outside the vocabulary."""
    out = [int(t) for t in tokens]
    bad = [t for t in out if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(
            f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})", code="invalid_tokens"
        )
    return out

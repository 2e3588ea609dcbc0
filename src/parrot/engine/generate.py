"""What a sampled token does to its generate: its sampling state when it starts, and
whether the token ends it (a stop token or string, the grammar's end or failure, the
length limit) or streams as a chunk.

Invariants: these functions touch only the job (its context's own tokens, its
decoder, stop filter, grammar matcher and penalty counts); releasing its context and
telling its caller it finished is the runner's (:meth:`EngineRunner._end_generate`,
given the :class:`Ending`).  Worker thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

from parrot.engine.core.jobs import Job
from parrot.engine.core.stopping import StopStringFilter
from parrot.engine.grammar import GrammarCache
from parrot.engine.grammar import advance as advance_grammar
from parrot.engine.sampler import make_generator
from parrot.protocol.errors import ParrotError
from parrot.protocol.schemas import GenerateChunk, TokenLogprob
from parrot.protocol.tokenizer import TextTokenizer


@dataclass(frozen=True, slots=True)
class Ending:
    """How a generate ends: its last chunk's tokens, text and logprobs with ``reason``
    (``stop``, ``length``), or ``error`` (reason ``error``, no last chunk)."""

    token_ids: list[int]
    reason: str
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    error: ParrotError | None = None


def start_generate(job: Job, tokenizer: TextTokenizer, grammars: GrammarCache) -> None:
    """Set up an admitted generate's sampling state: its random generator, incremental
    decoder, stop-string filter, penalty counts and grammar matcher.  Raises
    :class:`ParrotError` when its constraint does not compile."""
    assert job.sampling is not None and job.ctx is not None
    job.generator = make_generator(job.sampling.seed)
    job.decoder = tokenizer.incremental_decoder()
    job.stops = StopStringFilter(job.sampling.stop)
    job.counts = {} if job.sampling.penalized else None
    if job.sampling.constraint is not None:
        job.matcher = grammars.matcher(job.sampling.constraint)


def advance(
    job: Job, token: int, eos: set[int], max_seq_len: int, lp: TokenLogprob | None = None
) -> Ending | None:
    """Take ``token`` (with its logprob ``lp``) as ``job``'s next: None when the generate
    goes on (the token is appended to its context and streamed as a chunk), else how it
    ends (the token is then in the last chunk, not in the context)."""
    sp, ctx = job.sampling, job.ctx
    assert sp is not None and ctx is not None and job.decoder is not None and job.stops is not None
    job.generated += 1
    if job.counts is not None:
        job.counts[token] = job.counts.get(token, 0) + 1
    lps = None if lp is None else [lp]
    if token in sp.stop_token_ids or (token in eos and (not sp.ignore_eos or job.matcher is not None)):
        return Ending([token], "stop", logprobs=lps)
    ctx.own_tokens.append(token)
    grammar = None if job.matcher is None else advance_grammar(job.matcher, token)
    if grammar == "error":
        error = ParrotError(f"constrained decoding failed: {job.matcher.get_error()}", code="grammar_error")
        return Ending([], "error", error=error)
    text = job.stops.push(job.decoder.feed(token))
    if job.stops.stopped:
        return Ending([token], "stop", text, lps)
    if grammar == "stop":  # the grammar admits nothing more: the output is complete
        rest = job.stops.push(job.decoder.flush()) + job.stops.flush()
        return Ending([token], "stop", text + rest, lps)
    if job.generated >= sp.max_tokens or ctx.length >= max_seq_len:
        rest = job.stops.push(job.decoder.flush()) + job.stops.flush()
        return Ending([token], "length", text + rest, lps)
    if job.on_chunk is not None:
        job.on_chunk(GenerateChunk(token_ids=[token], text=text, logprobs=lps))
    return None

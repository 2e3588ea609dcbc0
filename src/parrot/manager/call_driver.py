"""One run of a placed call on its engine: fill, generate, transform, materialise.

:func:`drive` runs a call's rendered engine steps in a context of its own: fill
the text before each output (the engine reuses any cached prefix of it and says how
many tokens it reused: the call's ``prefix_reused_tokens`` and ``filled_tokens``),
generate the output (streaming each piece of text into the variable's
``partial``), apply the output's transform (a failure names the call and output and
keeps the raw text in the error's detail), materialise the value, which may
make consumer calls ready (handed to ``on_ready``).  No value travels to the
client on the way.  With ``metrics``, each run's time from placement to its first
token and each output's time per output token are observed.

Invariants: the call is marked done as its last value is set, before anything
else is awaited, so whoever reads that value and then the call sees it done;
the engine context is freed however the run ends (while the engine is alive).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from parrot.manager.backends.pool import EngineHandle
from parrot.manager.dag.graph import Call, OutputSpec, materialise
from parrot.manager.dag.render import FillStep, Rendered
from parrot.manager.metrics import ManagerMetrics
from parrot.protocol import clock
from parrot.protocol.errors import CallFailed
from parrot.protocol.transforms import TransformFailed

__all__ = ["RAW_TEXT_CHARS", "drive"]

RAW_TEXT_CHARS = 8192
"""Characters of an output's generated text kept in the error when its transform fails."""
RAW_IN_MESSAGE_CHARS = 200
"""... and quoted in that error's message."""


async def drive(
    call: Call,
    handle: EngineHandle,
    rendered: Rendered,
    on_ready: Callable[[Call], None],
    metrics: ManagerMetrics | None = None,
    *,
    priority: int = 0,
) -> None:
    """Run ``rendered``'s steps for ``call`` on ``handle`` (see the module docstring),
    observing its time to first token and each output's time per token in ``metrics``.
    Engine failures propagate (an EngineError); the caller decides about re-running.
    Every fill and generation carries ``priority`` (:meth:`~parrot.protocol.engine_api.EngineAPI.generate`).

    An output with forks (``n`` samples) is generated in ``n`` contexts forked from the
    filled prompt's, concurrently: the prompt is computed once and every sample reads
    its KV blocks in place."""
    api = handle.api
    context_id = handle.new_context_id()
    opened = False
    call.prefix_reused_tokens, call.filled_tokens = 0, 0
    try:
        for step in rendered.steps:
            if isinstance(step, FillStep):
                opened = True
                reused = await api.fill(
                    step.tokens, context_id, cache_salt=call.cache_salt, priority=priority
                )
                _count_fill(call, len(step.tokens), reused)
                continue
            out = step.output
            if out.forks:
                values = await _generate_forked(
                    call, handle, context_id, [out, *out.forks], metrics, priority
                )
            else:
                values = [await _generate(call, handle, out, context_id, None, metrics, priority)]
            for spec, value in zip([out, *out.forks], values, strict=True):
                if spec.transform is not None:
                    value = await _transform(call, spec, value)
                for ready in materialise(spec.var, value):
                    on_ready(ready)
        # done as its last value is set, before the await below: whoever reads that
        # value (a get, a stream's end) and then the call sees it done, never running
        call.state = "done"
        call.finished_at = clock.wall()
    finally:
        if opened and handle.alive:
            with contextlib.suppress(Exception):
                await asyncio.shield(api.free_context(context_id))


async def _transform(call: Call, spec: OutputSpec, raw: str) -> str:
    """``spec``'s transform applied to its generated text ``raw`` (off the loop: a regex
    may take its whole budget).  A failure names the call and the output and keeps the
    raw text (its first :data:`RAW_TEXT_CHARS` characters) in the error's detail, which
    the call, its failed variables and the session's graph all show."""
    assert spec.transform is not None
    try:
        return await asyncio.to_thread(spec.transform.apply, raw)
    except TransformFailed as exc:
        who = f"call {call.name} ({call.call_id})" if call.name else f"call {call.call_id}"
        raise TransformFailed(
            f"{who}: the transform of output {spec.name!r} failed: {exc.message}; "
            f"the generated text was {raw[:RAW_IN_MESSAGE_CHARS]!r}"
            + ("..." if len(raw) > RAW_IN_MESSAGE_CHARS else ""),
            code=exc.code,
            detail={
                **exc.detail,
                "call_id": call.call_id,
                "function": call.name,
                "output": spec.name,
                "raw_text": raw[:RAW_TEXT_CHARS],
                "raw_text_truncated": len(raw) > RAW_TEXT_CHARS,
                "finish_reason": spec.finish_reason,
            },
        ) from None


def _count_fill(call: Call, tokens: int, reused: int | None) -> None:
    """Add one fill's tokens to the call's prefix figures; once an engine does not say how
    many it reused (None), both figures are unknown (None) for this run."""
    if reused is None or call.prefix_reused_tokens is None or call.filled_tokens is None:
        call.prefix_reused_tokens = call.filled_tokens = None
        return
    call.prefix_reused_tokens += reused
    call.filled_tokens += tokens - reused


async def _generate(
    call: Call,
    handle: EngineHandle,
    out: OutputSpec,
    context_id: int,
    parent_id: int | None = None,
    metrics: ManagerMetrics | None = None,
    priority: int = 0,
) -> str:
    """Generate ``out`` in ``context_id`` (created forked from ``parent_id`` if given),
    streaming its text into the variable's ``partial``; returns the whole text."""
    text: list[str] = []
    out.generated_tokens, out.finish_reason = 0, None
    out.logprobs.clear()
    first_at = last_at = 0.0
    async for chunk in handle.api.generate(out.sampling, context_id, parent_id, priority=priority):
        if chunk.finish_reason == "cancelled":  # the manager never cancels this way
            raise CallFailed(
                f"call {call.call_id}: the engine stopped its generation after "
                f"{call.generated_tokens} tokens because its context was freed or "
                "cancelled from outside the manager"
            )
        if chunk.logprobs:  # before the text is announced: a stream sends both together
            out.logprobs.extend(chunk.logprobs)
        if chunk.token_ids:
            last_at = clock.monotonic()
            first_at = first_at if out.generated_tokens else last_at
            if call.first_token_at is None:
                call.first_token_at = clock.wall()
                if metrics is not None and call.dispatched_at is not None:
                    metrics.first_token(handle.engine_id, call.first_token_at - call.dispatched_at)
        if chunk.text:
            text.append(chunk.text)
            out.var.partial.append(chunk.text)
            out.var.notify()
        call.generated_tokens += len(chunk.token_ids)
        out.generated_tokens += len(chunk.token_ids)
        if chunk.done:
            out.finish_reason = chunk.finish_reason
    if metrics is not None:
        metrics.output_done(handle.engine_id, out.generated_tokens, first_at, last_at)
    return "".join(text)


async def _generate_forked(
    call: Call,
    handle: EngineHandle,
    parent_id: int,
    outs: list[OutputSpec],
    metrics: ManagerMetrics | None = None,
    priority: int = 0,
) -> list[str]:
    """Generate each of ``outs`` in a context of its own forked from ``parent_id``, all
    at once; if one fails the others are cancelled.  The forks are freed however it ends."""
    children = [handle.new_context_id() for _ in outs]
    tasks = [
        asyncio.ensure_future(_generate(call, handle, out, child, parent_id, metrics, priority))
        for out, child in zip(outs, children, strict=True)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if handle.alive:
            for child in children:
                with contextlib.suppress(Exception):
                    await asyncio.shield(handle.api.free_context(child))

"""Early prefill: compute a waiting call's constant prompt start before its inputs exist.

A call submitted before its inputs are materialised (a chain's next step, a reduce, an
agent's next turn) waits in the graph.  Its template's leading constant text, with the
chat markup that opens it, is the same whatever the inputs will be, so while the call
waits the manager fills that text on the engine most likely to run it: one that holds
the prefix already, else the live engine with the least token load.  The fill

* runs at :data:`BACKGROUND_PRIORITY`, behind every call's own fills and generations: an
  engine computes it with the room its steps have left (a decode step of a chain's
  current call carries it), never ahead of work that is ready;
* creates a *retained* context: the engine evicts its KV only after every other idle
  context's (:mod:`parrot.engine.core.memory`), so a prefix a submitted call will read is kept
  and a finished application's is not (workflow-aware retention);
* records the prefix's key on that engine (:class:`~parrot.manager.dag.prefix.PrefixIndex`),
  so the scheduler's prefix affinity places the call there when it is ready.

Calls of one template (one prefix key: the text, the tenant's salt, chat or not) that
wait together share one *hold*: one early fill, kept while any of them has not started.
The context is freed once each of those calls has started its first output (its own fill
is done, having taken the start from the engine's prefix cache) or ended: an agent's
system prompt stays on its engine until the last of its submitted steps has read it,
then is the first to go.

What the model sees does not change: the call's own prompt is still rendered and
tokenized whole; the engine's prefix cache reuses only whole KV blocks whose tokens equal
the call's own from position 0 (a text whose last token merges with the input after it
loses at most its last block).

Torch-free; no I/O but the engine API; the tokenization of a long text runs off the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from parrot.manager.backends.pool import EngineHandle, EnginePool
from parrot.manager.dag.graph import Call
from parrot.manager.dag.prefix import PrefixIndex, leading_text_key, user_pieces
from parrot.protocol.template import Text

__all__ = ["BACKGROUND_PRIORITY", "EarlyPrefill"]

log = logging.getLogger(__name__)

BACKGROUND_PRIORITY = (1 << 63) - 1
"""The engine priority of early fills: after every call's own work (the largest there is)."""

RELEASE_CHECK_S = 30.0
"""Longest wait on a call's output variable between checks that the call still exists
(a variable notifies on every change; this only bounds a missed one)."""


@dataclass(eq=False)
class _Hold:
    """One early-filled start on one engine and the waiting calls that will read it."""

    engine: EngineHandle
    key: str
    calls: list[Call] = field(default_factory=list)


class EarlyPrefill:
    """Early fills of waiting calls' constant starts (see the module docstring).
    ``min_tokens``: a start shorter than this (characters / 4, before tokenizing) is not
    worth a fill of its own."""

    def __init__(self, pool: EnginePool, prefixes: PrefixIndex, min_tokens: int = 64):
        self.pool = pool
        self.prefixes = prefixes
        self.min_tokens = min_tokens
        self._tasks: set[asyncio.Task[None]] = set()
        self._holds: dict[str, _Hold] = {}  # prefix key -> its hold (salt and chat mode are in the key)
        self.fills = 0  # early fills started (for tests and metrics)

    def waiting(self, call: Call) -> None:
        """``call`` was submitted and waits for inputs: it joins the hold of its constant
        start, or one is started if the start is worth a fill and an engine can take it."""
        text = _constant_start(call)
        key = leading_text_key(call) if text is not None else None
        if text is None or key is None or len(text) < 4 * self.min_tokens:
            return
        hold = self._holds.get(key)
        if hold is not None and hold.engine.alive:
            hold.calls.append(call)
            return
        engine = self._engine_for(call, key)
        if engine is None:
            return
        hold = self._holds[key] = _Hold(engine, key, [call])
        self.fills += 1
        task = asyncio.get_running_loop().create_task(
            self._run(hold, call, text), name=f"early fill of {call.call_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def held(self) -> int:
        """How many starts are held (filled or being filled) now."""
        return len(self._holds)

    def _engine_for(self, call: Call, key: str) -> EngineHandle | None:
        engines = self.pool.candidates(call.model)
        holding = [h for h in engines if self.prefixes.holds(key, h.engine_id)]
        return min(holding or engines, key=lambda h: (h.stats.token_load, h.engine_id), default=None)

    async def _run(self, hold: _Hold, call: Call, text: str) -> None:
        engine = hold.engine
        api, context_id, opened = engine.api, engine.new_context_id(), False
        try:
            tokenizer = api.tokenizer
            if call.chat:
                if tokenizer.chat is None:
                    return
                text = tokenizer.chat.wrap()[0] + text  # as render() opens a chat prompt
            _, got = await asyncio.to_thread(tokenizer.encode_unlocked, text)  # off the loop and the GIL
            ids = list(got or ())
            if tokenizer.add_bos and tokenizer.bos_token_id is not None:
                ids.insert(0, tokenizer.bos_token_id)
            if not ids or len(ids) >= engine.max_seq_len:
                return
            opened = True
            await api.fill(
                ids, context_id, cache_salt=call.cache_salt, priority=BACKGROUND_PRIORITY, retain=True
            )
            self.prefixes.record(engine.engine_id, (hold.key,))
            while True:  # calls may join while it waits; those that started leave the list
                hold.calls[:] = [c for c in hold.calls if not _started_or_ended(c)]
                if not hold.calls:
                    break
                await _until_started_or_ended(hold.calls[0])
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an early fill is an optimisation: the calls run without it
            log.info("early fill for call %s on %s failed: %r", call.call_id, engine.engine_id, exc)
        finally:
            if self._holds.get(hold.key) is hold:
                del self._holds[hold.key]
            if opened and engine.alive:
                with contextlib.suppress(Exception):
                    await asyncio.shield(api.free_context(context_id))

    async def close(self) -> None:
        """Cancel every early fill (their contexts are freed on the way out)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _constant_start(call: Call) -> str | None:
    """The text every prompt of ``call``'s template starts with (before a chat prompt's
    opening markup, which is the engine tokenizer's), when it starts with text followed
    by another piece; None otherwise."""
    if call.prompt_ids is not None:
        return None
    pieces = user_pieces(call)
    if len(pieces) < 2 or not isinstance(pieces[0], Text):
        return None
    return pieces[0].text


def _started_or_ended(call: Call) -> bool:
    """Whether ``call``'s first output has text or is no longer pending, or the call ended."""
    out = next(iter(call.outputs.values())).var
    return call.state in ("done", "failed") or out.state != "pending" or bool(out.partial)


async def _until_started_or_ended(call: Call) -> None:
    out = next(iter(call.outputs.values())).var
    while not _started_or_ended(call):
        await out.wait_change(RELEASE_CHECK_S)

"""Runs calls as soon as their inputs exist, entirely inside the server.

When a call becomes ready the executor picks an engine, renders the prompt
from the materialised inputs, and drives the engine: fill the text before
each output, generate the output (streaming it into the variable), apply the
output's transform, materialise it — which may make consumer calls ready,
which are dispatched at once.  No value travels to the client on the way.

Guarantees: every call ends ``done`` or ``failed``; a failure fails the
call's outputs and everything downstream; the engine context of a call is
freed however the call ends (success, failure, cancellation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from parrot.manager.engines import EngineHandle, EnginePool
from parrot.manager.graph import Call, fail_call, materialise
from parrot.manager.prefix import PrefixEntry, PrefixIndex, prefix_keys
from parrot.manager.render import FillStep, Rendered, render
from parrot.protocol.errors import CallFailed, EngineError, NoEngine, ParrotError

log = logging.getLogger(__name__)


class _EngineLost(str):
    """Cancellation message marking a call whose engine was dropped."""


class Executor:
    def __init__(
        self,
        pool: EnginePool,
        prefixes: PrefixIndex | None = None,
        *,
        min_prefix_tokens: int = 32,
        max_attempts: int = 3,
        engine_wait_s: float = 30.0,
    ):
        self.pool = pool
        self.max_attempts = max_attempts
        self.engine_wait_s = engine_wait_s
        self.prefixes = prefixes or PrefixIndex()
        self.min_prefix_tokens = min_prefix_tokens
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._by_engine: dict[str, set[str]] = {}
        pool.on_drop(self._engine_dropped)

    @property
    def running(self) -> int:
        return len(self._tasks)

    def dispatch(self, call: Call) -> None:
        """Start a ready call in the background."""
        if call.call_id in self._tasks or call.state not in ("ready", "waiting"):
            return
        call.state = "ready"
        # registered now, before any task runs, so calls made ready together
        # see each other's interest in a shared prefix
        self.prefixes.add_interest(call, prefix_keys(call))
        self._tasks[call.call_id] = asyncio.get_running_loop().create_task(
            self._run(call), name=f"call {call.call_id}"
        )

    def cancel(self, call: Call, error: ParrotError) -> None:
        task = self._tasks.get(call.call_id)
        fail_call(call, error)
        if task is not None:
            task.cancel()

    async def drain(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _engine_dropped(self, handle: EngineHandle, reason: str) -> None:
        self.prefixes.forget_engine(handle.engine_id)
        for call_id in self._by_engine.pop(handle.engine_id, set()):
            task = self._tasks.get(call_id)
            if task is not None:
                task.cancel(_EngineLost(f"engine {handle.engine_id} dropped: {reason}"))

    async def _run(self, call: Call) -> None:
        """Run ``call`` to completion, re-running it on another engine when its
        engine fails before any of its outputs was materialised (the manager
        holds everything needed: template and input values)."""
        excluded: set[str] = set()
        try:
            for attempt in range(1, self.max_attempts + 1):
                lost = await self._attempt(call, excluded)
                if lost is None:
                    return
                if attempt == self.max_attempts or any(
                    o.var.state != "pending" for o in call.outputs.values()
                ):
                    fail_call(call, EngineError(f"call {call.call_id} failed on its engine: {lost}"))
                    return
                log.warning("call %s: %s; re-running it elsewhere", call.call_id, lost)
                for out in call.outputs.values():
                    out.var.partial.clear()
                    out.var.notify()
                call.state = "ready"
                if not await self._wait_for_engine(call.model, excluded):
                    fail_call(
                        call,
                        NoEngine(
                            f"call {call.call_id} lost its engine ({lost}) and no other "
                            f"engine serves {call.model or 'its model'}"
                        ),
                    )
                    return
        finally:
            self._tasks.pop(call.call_id, None)

    async def _wait_for_engine(self, model: str | None, excluded: set[str]) -> bool:
        deadline = time.monotonic() + self.engine_wait_s
        while not [h for h in self.pool.candidates(model) if h.engine_id not in excluded]:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def _attempt(self, call: Call, excluded: set[str]) -> str | None:
        """One try on one engine.  Returns None when the call ended (done or
        failed), or why its engine was lost."""
        handle: EngineHandle | None = None
        try:
            handle = self.pool.pick(call.model, exclude=excluded)
            call.engine_id, call.generated_tokens = handle.engine_id, 0
            rendered = render(call, handle.api.tokenizer, handle.max_seq_len)
            call.prompt_tokens = rendered.prompt_tokens
            call.state = "running"
            call.started_at = time.time()
            handle.running_calls += 1
            self._by_engine.setdefault(handle.engine_id, set()).add(call.call_id)
            await self._drive(call, handle, rendered)
            call.state = "done"
            call.finished_at = time.time()
        except asyncio.CancelledError as exc:
            lost = exc.args[0] if exc.args and isinstance(exc.args[0], _EngineLost) else None
            if lost is None or call.state in ("done", "failed"):
                if call.state not in ("done", "failed"):
                    fail_call(call, EngineError(f"call {call.call_id} was cancelled"))
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # handled: we re-run the call
            excluded.add(handle.engine_id if handle else "")
            return str(lost)
        except EngineError as exc:
            if handle is None or call.state in ("done", "failed"):
                fail_call(call, exc)
                return None
            excluded.add(handle.engine_id)
            return exc.message
        except ParrotError as exc:
            fail_call(call, exc)
        except Exception as exc:
            log.exception("call %s failed", call.call_id)
            fail_call(call, CallFailed(f"internal error while running the call: {exc!r}"))
        finally:
            if handle is not None and call.call_id in self._by_engine.get(handle.engine_id, set()):
                handle.running_calls -= 1
                self._by_engine[handle.engine_id].discard(call.call_id)
        return None

    async def _drive(self, call: Call, handle: EngineHandle, rendered: Rendered) -> None:
        api = handle.api
        context_id = handle.new_context_id()
        used: list[PrefixEntry] = []
        opened = False
        try:
            steps = list(rendered.steps)
            first = steps.pop(0)
            assert isinstance(first, FillStep)  # render guarantees a prompt before any output
            parent, start = await self._share_prefix(handle, rendered, first.tokens, used)
            opened = True
            await api.fill(first.tokens[start:], context_id, parent)
            for step in steps:
                if isinstance(step, FillStep):
                    await api.fill(step.tokens, context_id)
                    continue
                out = step.output
                text: list[str] = []
                async for chunk in api.generate(out.sampling, context_id):
                    if chunk.text:
                        text.append(chunk.text)
                        out.var.partial.append(chunk.text)
                        out.var.notify()
                    call.generated_tokens += len(chunk.token_ids)
                value = "".join(text)
                if out.transform is not None:
                    value = out.transform.apply(value)  # type: ignore[attr-defined]
                for ready in materialise(out.var, value):
                    self.dispatch(ready)
        finally:
            for entry in used:
                self.prefixes.release(entry)
            if handle.alive:
                with contextlib.suppress(Exception):
                    if opened:
                        await asyncio.shield(api.free_context(context_id))
                    await self._evict(handle)

    async def _share_prefix(
        self, handle: EngineHandle, rendered: Rendered, tokens: list[int], used: list[PrefixEntry]
    ) -> tuple[int | None, int]:
        """Fork from the deepest prefix of this prompt already on the engine, and
        keep new shareable prefixes as contexts of their own.  Returns (parent
        context, number of leading tokens it covers).

        A prefix becomes a shared context when it is at least
        ``min_prefix_tokens`` past the previous one and is either the leading
        constant text (a system prompt: cheap to keep, likely reused) or
        wanted by another unfinished call.  Filling a prefix context costs no
        extra compute: the call's own fill just starts where it ends.
        """
        keys = [k for k, _ in rendered.prefixes]
        parent: int | None = None
        start = 0
        first_new = 0
        hit = self.prefixes.longest(keys, handle.engine_id)
        if hit is not None:
            i, entry = hit
            try:
                await entry.ready  # type: ignore[misc]  # another call may still be filling it
            except Exception:
                pass  # its fill failed; fill everything ourselves
            else:
                self.prefixes.acquire(entry)
                used.append(entry)
                parent, start, first_new = entry.context_id, entry.num_tokens, i + 1
        for i in range(first_new, len(rendered.prefixes)):
            key, end = rendered.prefixes[i]
            if end - start < self.min_prefix_tokens or self.prefixes.lookup(key, handle.engine_id):
                continue
            if i > 0 and self.prefixes.interest(key) < 2:
                continue
            entry = PrefixEntry(key, handle.engine_id, handle.new_context_id(), end)
            ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry.ready = ready
            self.prefixes.add(entry)
            self.prefixes.acquire(entry)
            used.append(entry)
            try:
                await handle.api.fill(tokens[start:end], entry.context_id, parent)
            except BaseException as exc:
                self.prefixes.remove(entry)
                ready.set_exception(EngineError(f"prefix fill failed: {exc!r}"))
                ready.exception()  # mark retrieved: waiters fall back to a full fill
                raise
            ready.set_result(None)
            parent, start = entry.context_id, end
        return parent, start

    async def _evict(self, handle: EngineHandle) -> None:
        for entry in self.prefixes.evictable(handle.engine_id):
            self.prefixes.remove(entry)
            await handle.api.free_context(entry.context_id)

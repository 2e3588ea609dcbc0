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
from parrot.manager.render import FillStep, render
from parrot.protocol.errors import CallFailed, EngineError, ParrotError

log = logging.getLogger(__name__)


class Executor:
    def __init__(self, pool: EnginePool):
        self.pool = pool
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
        for call_id in self._by_engine.pop(handle.engine_id, set()):
            task = self._tasks.get(call_id)
            if task is not None:
                task.cancel(f"engine {handle.engine_id} dropped: {reason}")

    async def _run(self, call: Call) -> None:
        handle: EngineHandle | None = None
        try:
            handle = self.pool.pick(call.model)
            call.engine_id = handle.engine_id
            steps = render(call, handle.api.tokenizer, handle.max_seq_len)
            call.prompt_tokens = sum(len(s.tokens) for s in steps if isinstance(s, FillStep))
            call.state = "running"
            call.started_at = time.time()
            handle.running_calls += 1
            self._by_engine.setdefault(handle.engine_id, set()).add(call.call_id)
            await self._drive(call, handle, steps)
            call.state = "done"
            call.finished_at = time.time()
        except asyncio.CancelledError as exc:
            if call.state not in ("done", "failed"):
                why = str(exc.args[0]) if exc.args else "cancelled"
                fail_call(call, EngineError(f"call {call.call_id} interrupted: {why}"))
        except ParrotError as exc:
            fail_call(call, exc)
        except Exception as exc:
            log.exception("call %s failed", call.call_id)
            fail_call(call, CallFailed(f"internal error while running the call: {exc!r}"))
        finally:
            self._tasks.pop(call.call_id, None)
            if handle is not None and call.started_at is not None:
                handle.running_calls -= 1
                self._by_engine.get(handle.engine_id, set()).discard(call.call_id)

    async def _drive(self, call: Call, handle: EngineHandle, steps: list) -> None:
        api = handle.api
        context_id = handle.new_context_id()
        opened = False
        try:
            for step in steps:
                opened = True
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
            if opened and handle.alive:
                with contextlib.suppress(Exception):
                    await asyncio.shield(api.free_context(context_id))

"""One OpenAI completion request as it runs on the manager, and its answer in OpenAI's shapes.

A request (``/v1/completions`` or ``/v1/chat/completions``) becomes a short-lived
internal session holding one call per prompt, whose template is
``{{input:prompt}}{{output:text}}`` with the prompt bound as a constant *value*
(so user text such as ``{{x}}`` is never parsed as a placeholder) or, for a
token-id prompt, filled as the given ids.  With ``n > 1`` the call's output has
``n - 1`` forks: the prompt is filled once and the ``n`` samples are generated
in contexts forked from it (:func:`parrot.manager.call_driver.drive`).  The
calls run on the normal executor (same engine choice, same scheduling), and the
session is closed when the response is complete or the client goes away, so
nothing is left in ``manager.sessions`` afterwards.

Choices are numbered as OpenAI numbers them: prompt ``p``'s sample ``j`` is
``choices[p * n + j]``.  A streamed answer interleaves the choices' chunks as
their text arrives, each chunk carrying its choice's ``index``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from parrot.manager.dag.graph import Call, OutputSpec, Session, Variable
from parrot.manager.openai.logprobs import chat_logprobs, completion_logprobs, text_length
from parrot.manager.service import Manager
from parrot.manager.views import error_info
from parrot.protocol import clock
from parrot.protocol.errors import CallFailed, EngineError, NoEngine, ParrotError
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import PlaceholderBinding, SubmitCall, TokenLogprob
from parrot.protocol.tokenizer import TextTokenizer

__all__ = ["COMPLETION_TEMPLATE", "Choice", "Completion", "Prompt", "answer", "check_model"]

COMPLETION_TEMPLATE = "{{input:prompt}}{{output:text}}"
_TASK_GRACE_S = 30.0  # how long to wait for a finished call to free its engine context
log = logging.getLogger(__name__)


Prompt = str | tuple[int, ...]
"""A prompt: text, or token ids filled as given."""


def check_model(manager: Manager, model: str | None) -> None:
    if not manager.engines_serving(model):
        known = sorted({h.model for h in manager.engines_serving(None)})
        what = f"model {model!r}" if model else "any model"
        raise NoEngine(f"no live engine serves {what}; served models: {known or 'none'}")


@dataclass(frozen=True)
class Choice:
    """One answer of a request: sample ``out`` of ``call``, at ``index`` in ``choices``."""

    index: int
    call: Call
    out: OutputSpec

    @property
    def var(self) -> Variable:
        return self.out.var


class Completion:
    """One completion request (``chat``: a chat completion): its internal session, calls
    and choices, and its answers in OpenAI's shapes; closes the session exactly once."""

    def __init__(
        self, manager: Manager, model: str | None, session: Session, calls: list[Call], *, chat: bool
    ):
        self.manager = manager
        self.requested_model = model
        self.created = int(clock.wall())
        self.session: Session | None = session
        self.calls = calls
        self.choices = [
            Choice(i, c, o) for i, (c, o) in enumerate((c, o) for c in calls for o in c.all_outputs())
        ]
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{calls[0].call_id}"

    @classmethod
    async def open(
        cls,
        manager: Manager,
        prompts: str | Sequence[Prompt],
        sampling: SamplingParams,
        model: str | None,
        tenant: str,
        *,
        chat: bool,
        n: int = 1,
    ) -> Completion:
        """Submit one call per prompt (``n`` samples each) in an internal session of
        ``tenant``'s (each prompt tokenized off the event loop when long:
        :meth:`Manager.run_tokenized`).  If any prompt is refused, nothing is left."""
        check_model(manager, model)
        if isinstance(prompts, str):
            prompts = [prompts]
        session, token = manager.create_session(tenant)
        calls: list[Call] = []
        try:
            for i, prompt in enumerate(prompts):
                if i:
                    await asyncio.sleep(0)  # other requests run between prompts: one holds the loop briefly
                submit = SubmitCall(
                    template=COMPLETION_TEMPLATE,
                    placeholders=[
                        PlaceholderBinding(
                            name="prompt", direction="input", value=prompt if isinstance(prompt, str) else ""
                        ),
                        PlaceholderBinding(name="text", direction="output", sampling=sampling.to_dict()),
                    ],
                    name="openai.chat" if chat else "openai.completion",
                    model=model,
                )
                ids = None if isinstance(prompt, str) else tuple(prompt)
                calls.append(
                    await manager.run_tokenized(
                        lambda submit=submit, ids=ids: manager.submit_call(
                            manager.authorize(session.session_id, token), submit, prompt_ids=ids, samples=n
                        )
                    )
                )
        except BaseException:
            manager.close_session(session)
            raise
        return cls(manager, model, session, calls, chat=chat)

    @property
    def call(self) -> Call:
        """The first prompt's call."""
        return self.calls[0]

    @property
    def var(self) -> Variable:
        """The first choice's variable."""
        return self.choices[0].var

    @property
    def model(self) -> str:
        engine_id = self.calls[0].engine_id
        if engine_id is not None:
            with contextlib.suppress(ParrotError):
                return self.manager.engine(engine_id).model
        return self.requested_model or "unknown"

    async def wait_call(self, calls: Sequence[Call] | None = None) -> None:
        """Wait until the calls' tasks end (their engine contexts are then freed)."""
        for call in self.calls if calls is None else calls:
            await self.manager.wait_call_freed(call, _TASK_GRACE_S)

    async def wait_value(self) -> None:
        """Wait until every choice's value is ready or failed."""
        for choice in self.choices:
            while choice.var.state == "pending":
                await choice.var.wait_change(30.0)

    def error(self) -> ParrotError:
        for choice in self.choices:
            if choice.var.state == "failed":
                err = choice.var.error or choice.call.error
                if err is not None:
                    return err
        return CallFailed("the completion failed")

    def finish_reason(self, choice: Choice) -> str:
        """The engine's reason when it gave one, else "length" when ``max_tokens`` or the
        context was used up, and "stop" otherwise."""
        if choice.out.finish_reason in ("stop", "length"):
            return choice.out.finish_reason
        gen, call = choice.out.generated_tokens, choice.call
        if gen >= choice.out.sampling.max_tokens:
            return "length"
        if call.engine_id is not None and call.prompt_tokens is not None:
            with contextlib.suppress(ParrotError):
                if call.prompt_tokens + gen >= self.manager.engine(call.engine_id).max_seq_len:
                    return "length"
        return "stop"

    def usage(self) -> dict[str, int]:
        """Each prompt counted once however many samples it has, as OpenAI counts."""
        prompt = sum(c.prompt_tokens or 0 for c in self.calls)
        completion = sum(c.generated_tokens for c in self.calls)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def tokenizer(self, call: Call) -> TextTokenizer | None:
        """The tokenizer of the engine that ran ``call`` (to show its tokens)."""
        handle = None
        if call.engine_id is not None:
            with contextlib.suppress(ParrotError):
                handle = self.manager.engine(call.engine_id)
        if handle is None:
            handle = self.manager.longest_context(self.requested_model)
        return None if handle is None else handle.api.tokenizer

    def logprobs(
        self, choice: Choice, entries: Sequence[TokenLogprob], offset: int = 0
    ) -> dict[str, Any] | None:
        """``entries`` in the request's shape (the first token at character ``offset`` of
        the choice's text); None when the request asked for no logprobs."""
        tokenizer = self.tokenizer(choice.call)
        if choice.out.sampling.logprobs is None or tokenizer is None:
            return None
        if self.chat:
            return chat_logprobs(tokenizer, entries)
        return completion_logprobs(tokenizer, entries, offset)

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        *,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A streamed piece of choice ``index``'s answer (``role``: a chat stream's first,
        naming the role), with the logprobs of the tokens it adds when they were asked for."""
        if not self.chat:
            choice = {"text": text, "index": index, "finish_reason": finish_reason, "logprobs": logprobs}
            return self._envelope("text_completion", [choice])
        delta: dict[str, str] = {"role": "assistant"} if role else {}
        if text or role:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        return self._envelope("chat.completion.chunk", [choice])

    def body(self) -> dict[str, Any]:
        """The whole answer, when not streamed (every choice ready)."""
        choices: list[dict[str, Any]] = []
        for c in self.choices:
            text, reason, lp = c.var.value or "", self.finish_reason(c), self.logprobs(c, c.out.logprobs)
            if not self.chat:
                choices.append({"text": text, "index": c.index, "finish_reason": reason, "logprobs": lp})
            else:
                message = {"role": "assistant", "content": text}
                choices.append(
                    {"index": c.index, "message": message, "finish_reason": reason, "logprobs": lp}
                )
        out = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        out["usage"] = self.usage()
        return out

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = self.usage()
        return out

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            self.manager.close_session(session)


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def answer(
    comp: Completion, request: Request, stream: bool, stream_options: dict[str, Any] | None
) -> Any:
    """The response to a submitted completion: SSE chunks when ``stream``, else the whole
    answer once ready; the internal session is closed however it ends."""
    if stream:
        include_usage = bool((stream_options or {}).get("include_usage"))
        return StreamingResponse(
            _stream(comp, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        if not await _unless_disconnected(request, comp.wait_value()):
            log.info("completion %s: the client went away; its calls are cancelled", comp.id)
            return Response(status_code=499)  # nobody reads it; closing the session cancels the calls
        await comp.wait_call()
        if any(c.var.state != "ready" for c in comp.choices):
            raise comp.error()
        if any(c.out.sampling.logprobs is not None for c in comp.choices):
            return await asyncio.to_thread(comp.body)  # thousands of tokens to show: off the loop
        return comp.body()
    finally:
        comp.close()


async def _unless_disconnected(request: Request, work: Awaitable[None]) -> bool:
    """Await ``work`` unless the client goes away first; False if it did (``work`` is then
    cancelled).  A task waits on the request's receive channel the whole time, as
    Starlette's streaming responses do: a check that gives up at once (Starlette's
    ``is_disconnected``) sometimes went on answering "connected" for a client that had
    closed its connection long before, until the work ended (uvicorn 0.55, h11)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
            return True
        return False
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t


async def _client_gone(request: Request) -> None:
    """Return once the client has closed its connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _wait_any(vars_: list[Variable], timeout: float) -> None:
    """Wait until one of ``vars_`` changes (state or partial text) or ``timeout`` passes.

    The waits are registered before the first ``await``: the caller has just read the
    variables, so a change made after that read must end this wait."""
    futures = [v.change_future() for v in vars_]
    try:
        await asyncio.wait(futures, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for v, fut in zip(vars_, futures, strict=True):
            fut.cancel()
            v.forget(fut)


_DIVERGED = "the call was re-run on another engine and its output changed"


class _Sent:
    """What a stream sent of one choice: its text, and its tokens' logprobs (how many,
    and the characters they read as, which offset the next ones)."""

    def __init__(self) -> None:
        self.text = ""
        self.tokens = 0
        self.chars = 0

    def take(self, comp: Completion, choice: Choice) -> dict[str, Any] | None:
        """The logprobs of the choice's tokens not sent yet, in the request's shape (None
        when it asked for none); they count as sent from now on."""
        entries = choice.out.logprobs[self.tokens :]
        shaped = comp.logprobs(choice, entries, self.chars)
        self.tokens += len(entries)
        tokenizer = comp.tokenizer(choice.call)
        if shaped is not None and tokenizer is not None:
            self.chars += text_length(tokenizer, entries)
        return shaped


async def _stream(comp: Completion, include_usage: bool) -> AsyncIterator[bytes]:
    """SSE chunks of the choices' text as it is generated, interleaved by arrival, each
    choice ended by a chunk with its ``finish_reason``; the session is closed however it
    ends (including the client going away, which cancels the calls).

    Text already sent cannot be retracted: if the executor re-runs a call on another
    engine (its partial text restarts) the stream continues only while the new text
    extends what was sent (greedy or seeded sampling), and ends with an
    ``engine_error`` event otherwise."""
    try:
        if comp.chat:
            for c in comp.choices:
                yield _sse(comp.chunk(c.index, "", None, role=True))
        sent = [_Sent() for _ in comp.choices]  # what each choice has sent
        open_ = list(comp.choices)  # choices not ended yet
        failed: ParrotError | None = None
        while open_ and failed is None:
            # A pass that sends or awaits anything lets other tasks run, and a choice read
            # before that may have changed since: only a pass that did neither waits, so the
            # wait is registered right after the reads it depends on.
            idle = True
            for c in list(open_):
                text = (c.var.value if c.var.state == "ready" else "".join(c.var.partial)) or ""
                done = sent[c.index]
                if text.startswith(done.text):
                    if len(text) > len(done.text):
                        piece = text[len(done.text) :]
                        done.text = text
                        idle = False
                        yield _sse(comp.chunk(c.index, piece, None, logprobs=done.take(comp, c)))
                elif not done.text.startswith(text) or c.var.state == "ready":
                    failed = EngineError(_DIVERGED)  # a re-run diverged from what the client has
                    break
                if c.var.state == "failed":
                    failed = comp.error()
                    break
                if c.var.state == "ready":
                    idle = False
                    await comp.wait_call([c.call])
                    yield _sse(comp.chunk(c.index, "", comp.finish_reason(c), logprobs=done.take(comp, c)))
                    open_.remove(c)
            if open_ and failed is None and idle:
                await _wait_any([c.var for c in open_], 30.0)
        await comp.wait_call()
        if failed is None and include_usage:
            yield _sse(comp.usage_chunk())
        if failed is not None:
            err = error_info(failed)
            yield _sse({"error": err.model_dump() if err else {"code": "call_failed", "message": ""}})
        yield b"data: [DONE]\n\n"
    finally:
        comp.close()

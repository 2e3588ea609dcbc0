"""OpenAI-compatible text completions on the manager: ``POST /v1/completions``
and ``GET /v1/models``.

This is the request-by-request interface: the client renders its prompt
itself and sends it whole, as LangChain-style code does against any OpenAI
server.  It lets a baseline client drive Parrot's engines, and lets
throughput benchmarks drive Parrot and vLLM with identical requests.

Each request becomes a short-lived internal session holding one call whose
template is ``{{input:prompt}}{{output:text}}`` with the prompt bound as a
constant *value* (so user text such as ``{{x}}`` is never parsed as a
placeholder), run by the normal executor (same engine choice, same
scheduling), and closed when the response is complete or the client goes
away.  Nothing is left in ``manager.sessions`` afterwards.  On a manager
with API keys the request's ``Authorization: Bearer <key>`` names its tenant
(401 without a valid one), whose quotas and prefix cache it uses.

Supported: ``model``, ``prompt`` (a string, or a list of exactly one string),
``max_tokens`` (default 16, as OpenAI), ``temperature`` (default 1),
``top_p``, ``top_k`` (vLLM's extension; -1 or 0 = off), ``seed``, ``stop``
(string or list), ``stream`` (server-sent events ``data: {...}`` then
``data: [DONE]``; ``stream_options.include_usage`` adds a usage chunk),
``n``/``best_of`` = 1 only, and vLLM's ``ignore_eos`` / ``stop_token_ids``.
Parameters Parrot cannot honour (``logprobs``, ``echo``, ``suffix``, non-zero
penalties, a non-empty ``logit_bias``) are rejected with 400 rather than
silently ignored.  Errors use Parrot's JSON error body
``{"error": {"code", "message"}}`` with its HTTP status (400 invalid
parameters, 503 ``no_engine`` for a model no live engine serves).

``GET /v1/models`` lists each served model with ``max_model_len`` and, as an
extension, ``chat_format``: the chat markup ``chat=True`` calls are wrapped in
(the fields of :class:`~parrot.protocol.tokenizer.ChatFormat`; ``null`` for a
model without one), so that a request-level client can send a chat-wrapped
prompt that reads exactly like a semantic function's
(:meth:`parrot.SemanticFunction.render`).

``finish_reason`` is derived from token counts ("length" when ``max_tokens``
or the context was used up, else "stop"), since calls do not record the
engine's reason; a stop token sampled exactly at ``max_tokens`` reads "length".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import Field

from parrot.manager.graph import Call, Session, Variable
from parrot.manager.service import Manager
from parrot.manager.views import error_info
from parrot.protocol import clock
from parrot.protocol.asgi import OffLoopJsonRoute, bearer_token
from parrot.protocol.errors import BadRequest, CallFailed, EngineError, NoEngine, ParrotError
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import PlaceholderBinding, StrictBody, SubmitCall

COMPLETION_TEMPLATE = "{{input:prompt}}{{output:text}}"
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_TASK_GRACE_S = 30.0  # how long to wait for a finished call to free its engine context


class OpenAIRequest(StrictBody):
    """The fields ``/v1/completions`` and ``/v1/chat/completions`` share (OpenAI's plus
    vLLM's ``top_k``, ``ignore_eos`` and ``stop_token_ids``).  Unknown fields are rejected."""

    model: str | None = Field(default=None, description="Model to run on; any live engine's if omitted.")
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # Accepted only at their no-op values:
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(default=None, max_length=1000)


def unsupported(what: str) -> BadRequest:
    return BadRequest(f"{what} is not supported", code="unsupported_parameter")


def check_shared(req: OpenAIRequest) -> None:
    """Refuse the shared fields Parrot cannot honour (400) rather than ignore them."""
    if req.n != 1:
        raise unsupported(f"n={req.n} (only n=1)")
    if req.presence_penalty or req.frequency_penalty:
        raise unsupported("presence_penalty / frequency_penalty other than 0")
    if req.logit_bias:
        raise unsupported("logit_bias")
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options needs stream=true", code="invalid_request")


class CompletionRequest(OpenAIRequest):
    """The body of ``POST /v1/completions``."""

    prompt: str | list[Any]
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    best_of: int | None = None
    # Accepted only at their no-op values:
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


def _prompt_text(req: CompletionRequest) -> str:
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise BadRequest(
                "prompt must be a string (or a list of exactly one string); batched and token-id "
                "prompts are not supported",
                code="invalid_request",
            )
        prompt = prompt[0]
    return prompt


def _check_supported(req: CompletionRequest) -> None:
    check_shared(req)
    if req.best_of not in (None, 1):
        raise unsupported(f"best_of={req.best_of} (only 1)")
    if req.logprobs is not None:
        raise unsupported("logprobs")
    if req.echo:
        raise unsupported("echo")
    if req.suffix:
        raise unsupported("suffix")


def sampling_of(req: Any, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> SamplingParams:
    """Parrot sampling settings for an OpenAI request (a completion's or a chat's, which
    share these fields; raises InvalidSampling, 400)."""
    top_k = req.top_k
    if top_k is None or top_k == -1:  # vLLM's "disabled"
        top_k = 0
    stop = req.stop
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    return SamplingParams(
        max_tokens=default_max_tokens if req.max_tokens is None else req.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        seed=req.seed,
        stop=tuple(stop),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
    )


def check_model(manager: Manager, model: str | None) -> None:
    if not manager.pool.candidates(model):
        known = sorted({h.model for h in manager.pool if h.alive})
        what = f"model {model!r}" if model else "any model"
        raise NoEngine(f"no live engine serves {what}; served models: {known or 'none'}")


class Completion:
    """One completion (``chat``: a chat completion): its internal session and call, and its
    answers in OpenAI's shapes; closes the session exactly once."""

    def __init__(self, manager: Manager, model: str | None, session: Session, call: Call, *, chat: bool):
        self.manager = manager
        self.requested_model = model
        self.max_tokens = call.outputs["text"].sampling.max_tokens
        self.created = int(clock.wall())
        self.session: Session | None = session
        self.call = call
        self.var: Variable = call.outputs["text"].var
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{call.call_id}"

    @classmethod
    async def open(
        cls,
        manager: Manager,
        prompt: str,
        sampling: SamplingParams,
        model: str | None,
        tenant: str,
        *,
        chat: bool,
    ) -> Completion:
        """Submit ``prompt``'s call in an internal session of ``tenant``'s (the prompt
        tokenized off the event loop when long: :meth:`Manager.run_tokenized`)."""
        check_model(manager, model)
        session, token = manager.create_session(tenant)
        submit = SubmitCall(
            template=COMPLETION_TEMPLATE,
            placeholders=[
                PlaceholderBinding(name="prompt", direction="input", value=prompt),
                PlaceholderBinding(name="text", direction="output", sampling=sampling.to_dict()),
            ],
            name="openai.chat" if chat else "openai.completion",
            model=model,
        )
        try:
            call = await manager.run_tokenized(
                lambda: manager.submit_call(manager.authorize(session.session_id, token), submit)
            )
        except BaseException:
            manager.close_session(session)
            raise
        return cls(manager, model, session, call, chat=chat)

    @property
    def model(self) -> str:
        if self.call.engine_id is not None:
            with contextlib.suppress(ParrotError):
                return self.manager.pool.get(self.call.engine_id).model
        return self.requested_model or "unknown"

    async def wait_call(self) -> None:
        """Wait until the call's task ends (its engine context is then freed)."""
        task = self.manager.executor.task(self.call.call_id)
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=_TASK_GRACE_S)  # neither raises nor cancels the task

    async def wait_value(self) -> None:
        while self.var.state == "pending":
            await self.var.wait_change(30.0)

    def error(self) -> ParrotError:
        err = self.var.error or self.call.error
        return err if err is not None else CallFailed("the completion failed")

    def finish_reason(self) -> str:
        gen = self.call.generated_tokens
        if gen >= self.max_tokens:
            return "length"
        if self.call.engine_id is not None and self.call.prompt_tokens is not None:
            with contextlib.suppress(ParrotError):
                if self.call.prompt_tokens + gen >= self.manager.pool.get(self.call.engine_id).max_seq_len:
                    return "length"
        return "stop"

    def usage(self) -> dict[str, int]:
        prompt = self.call.prompt_tokens or 0
        completion = self.call.generated_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chunk(self, text: str, finish_reason: str | None, *, role: bool = False) -> dict[str, Any]:
        """A streamed piece of the answer (``role``: a chat stream's first, naming the role)."""
        if not self.chat:
            choice = {"text": text, "index": 0, "finish_reason": finish_reason, "logprobs": None}
            return self._envelope("text_completion", choice)
        delta: dict[str, str] = {"role": "assistant"} if role else {}
        if text or role:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return self._envelope("chat.completion.chunk", choice)

    def body(self, text: str) -> dict[str, Any]:
        """The whole answer, when not streamed."""
        if not self.chat:
            out = self.chunk(text, self.finish_reason())
        else:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "finish_reason": self.finish_reason(), "logprobs": None}
            out = self._envelope("chat.completion", choice)
        out["usage"] = self.usage()
        return out

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", None)
        out["usage"] = self.usage()
        return out

    def _envelope(self, kind: str, choice: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [] if choice is None else [choice],
        }

    def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            self.manager.close_session(session)


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def openai_router(manager: Manager) -> APIRouter:
    """Routes ``POST /v1/completions`` and ``GET /v1/models`` for ``manager``.

    Mount with ``app.include_router(openai_router(manager))`` on an app made by
    :func:`parrot.manager.app.create_app` (whose error handlers give the JSON
    error bodies).
    """
    router = APIRouter(tags=["openai"], route_class=OffLoopJsonRoute)

    @router.get("/v1/models")
    async def list_models() -> dict:
        models: dict[str, int] = {}
        chat: dict[str, dict[str, Any] | None] = {}
        for h in manager.pool:
            if h.alive:
                models[h.model] = max(models.get(h.model, 0), h.max_seq_len)
                fmt = h.api.tokenizer.chat
                chat.setdefault(h.model, None if fmt is None else dataclasses.asdict(fmt))
        return {
            "object": "list",
            "data": [
                {
                    "id": m,
                    "object": "model",
                    "created": 0,
                    "owned_by": "parrot",
                    "max_model_len": n,
                    "chat_format": chat[m],
                }
                for m, n in sorted(models.items())
            ],
        }

    @router.post(
        "/v1/completions",
        responses={200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream"}},
    )
    async def completions(req: CompletionRequest, request: Request) -> Any:
        tenant = manager.api_keys.tenant(bearer_token(request.headers.get("authorization")))
        _check_supported(req)
        sampling = sampling_of(req)  # validate before creating anything
        prompt = _prompt_text(req)
        comp = await Completion.open(manager, prompt, sampling, req.model, tenant, chat=False)
        return await answer(comp, request, req.stream, req.stream_options)

    return router


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
            return Response(status_code=499)  # nobody reads it; closing the session cancels the call
        await comp.wait_call()
        if comp.var.state != "ready":
            raise comp.error()
        return comp.body(comp.var.value or "")
    finally:
        comp.close()


DISCONNECT_POLL_S = 0.25


async def _unless_disconnected(request: Request, work: Awaitable[None]) -> bool:
    """Await ``work`` unless the client goes away first (checked every
    :data:`DISCONNECT_POLL_S`); False if it did (``work`` is then cancelled)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()
                return True
            if await request.is_disconnected():
                return False
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _stream(comp: Completion, include_usage: bool) -> AsyncIterator[bytes]:
    """SSE chunks of the output as it is generated; the session is closed however it ends
    (including the client going away, which cancels the call).

    Text already sent cannot be retracted: if the executor re-runs the call on
    another engine (its partial text restarts) the stream continues only while
    the new text extends what was sent (greedy or seeded sampling), and ends
    with an ``engine_error`` event otherwise."""
    try:
        var = comp.var
        if comp.chat:
            yield _sse(comp.chunk("", None, role=True))
        sent = ""  # text already sent
        failed: ParrotError | None = None
        while True:
            text = "".join(var.partial)
            if text.startswith(sent):
                if len(text) > len(sent):
                    yield _sse(comp.chunk(text[len(sent) :], None))
                    sent = text
            elif not sent.startswith(text):  # a re-run diverged from what the client has
                failed = EngineError("the call was re-run on another engine and its output changed")
                break
            if var.state != "pending":
                break
            await var.wait_change(30.0)
        await comp.wait_call()
        if failed is None and var.state == "ready":
            value = var.value or ""
            if not value.startswith(sent):
                failed = EngineError("the call was re-run on another engine and its output changed")
            else:
                if len(value) > len(sent):
                    yield _sse(comp.chunk(value[len(sent) :], None))
                yield _sse(comp.chunk("", comp.finish_reason()))
                if include_usage:
                    yield _sse(comp.usage_chunk())
        elif failed is None:
            failed = comp.error()
        if failed is not None:
            err = error_info(failed)
            yield _sse({"error": err.model_dump() if err else {"code": "call_failed", "message": ""}})
        yield b"data: [DONE]\n\n"
    finally:
        comp.close()

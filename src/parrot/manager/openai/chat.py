"""OpenAI-compatible chat completions on the manager: ``POST /v1/chat/completions``.

The messages are rendered into one prompt with the model's own chat template
(:func:`parrot.protocol.chat_template.render_chat`, sandboxed Jinja, as transformers
and vLLM render it), and the prompt then runs exactly like a ``/v1/completions``
request (:mod:`parrot.manager.openai.completions`), so a conversation's earlier turns
are a cached prefix of its next request.  Answers are OpenAI's ``chat.completion`` or,
streamed, ``chat.completion.chunk`` shapes.  What is supported, field by field:
docs/openai.md.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from parrot.manager.openai.completions import (
    OpenAIRequest,
    check_shared,
    context_of,
    samples_of,
    sampling_of,
    unsupported,
)
from parrot.manager.openai.constraint import constraint_of
from parrot.manager.openai.response import Completion, answer
from parrot.manager.service import Manager
from parrot.protocol.asgi import OffLoopJsonRoute, bearer_token
from parrot.protocol.chat_template import ChatMessage, render_chat
from parrot.protocol.errors import BadRequest, NoEngine
from parrot.protocol.sampling import MAX_LOGPROBS
from parrot.protocol.schemas import StrictBody

__all__ = ["MAX_MESSAGES", "ChatCompletionRequest", "chat_router"]

MAX_MESSAGES = 4096
"""Messages one request may hold."""
INLINE_RENDER_CHARS = 64 * 1024
"""Conversations with more characters than this are rendered in a worker thread."""


class ChatMessageIn(StrictBody):
    role: str = Field(max_length=32)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = Field(default=None, max_length=200)


class ChatCompletionRequest(OpenAIRequest):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Accepted only at their no-op values:
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


def _check_supported(req: ChatCompletionRequest) -> None:
    check_shared(req)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", code="invalid_request")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise BadRequest(
                f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {req.top_logprobs}",
                code="invalid_request",
            )
    if req.tools or req.tool_choice not in (None, "none"):
        raise unsupported("tools")
    both = req.max_tokens is not None and req.max_completion_tokens is not None
    if both and req.max_tokens != req.max_completion_tokens:
        raise BadRequest("max_tokens and max_completion_tokens disagree", code="invalid_request")


def _messages(req: ChatCompletionRequest) -> list[ChatMessage]:
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise BadRequest(
                        f"messages[{i}]: only text content parts are supported", code="unsupported_parameter"
                    )
                texts.append(part["text"])
            content = "".join(texts)
        out.append(ChatMessage(m.role, content))
    return out


def chat_router(manager: Manager) -> APIRouter:
    """Routes ``POST /v1/chat/completions`` for ``manager`` (mounted by
    :func:`parrot.manager.api.app.create_app`)."""
    router = APIRouter(tags=["openai"], route_class=OffLoopJsonRoute)

    @router.post(
        "/v1/chat/completions",
        responses={200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE when stream"}},
    )
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        tenant = manager.api_keys.tenant(bearer_token(request.headers.get("authorization")))
        _check_supported(req)
        max_seq_len = context_of(manager, req.model)
        engine = manager.longest_context(req.model)
        if engine is None:  # gone since the check
            raise NoEngine(f"no live engine serves model {req.model!r}")
        if req.max_tokens is None and req.max_completion_tokens is not None:
            req = req.model_copy(update={"max_tokens": req.max_completion_tokens})
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        sampling = sampling_of(req, max_seq_len, logprobs, await constraint_of(req))
        messages = _messages(req)
        tokenizer = engine.api.tokenizer
        if sum(len(m.content) for m in messages) > INLINE_RENDER_CHARS:
            prompt = await asyncio.to_thread(render_chat, tokenizer, messages)
        else:
            prompt = render_chat(tokenizer, messages)
        comp = await Completion.open(
            manager, prompt, sampling, req.model, tenant, chat=True, n=samples_of(req)
        )
        return await answer(comp, request, req.stream, req.stream_options)

    return router

"""OpenAI-compatible text completions on the manager: ``POST /v1/completions``
and ``GET /v1/models``.

The request-by-request interface: the client renders its prompt itself and sends it
whole, as LangChain-style code does against any OpenAI server, so a baseline client can
drive Parrot's engines and benchmarks can drive Parrot and vLLM with identical
requests.  Each request runs as an internal session (:mod:`parrot.manager.openai.response`)
of the tenant its API key names.  Parameters Parrot cannot honour are refused with 400
rather than ignored.  What is supported, field by field: docs/openai.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from parrot.manager.openai.constraint import constraint_of
from parrot.manager.openai.response import Completion, Prompt, answer, check_model
from parrot.manager.service import Manager
from parrot.protocol.asgi import OffLoopJsonRoute, bearer_token
from parrot.protocol.constraint import Constraint
from parrot.protocol.errors import BadRequest, NoEngine
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import StrictBody

__all__ = ["MAX_CHOICES", "MAX_N", "MAX_PROMPTS", "MAX_STOP", "Completion", "openai_router"]

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 16
"""Samples per prompt (``n``)."""
MAX_PROMPTS = 64
"""Prompts in one ``/v1/completions`` request."""
MAX_CHOICES = 128
"""Choices (prompts times ``n``) in one request."""
MAX_STOP = 4
"""Stop strings per request, as OpenAI allows."""
MAX_COMPLETION_LOGPROBS = 5
"""Most likely tokens a completion's ``logprobs`` may ask for, as OpenAI allows."""


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
    n: int | None = 1
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    # structured outputs (parrot.manager.openai.constraint): at most one of these
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    # Accepted only at its no-op value:
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(default=None, max_length=1000)


def unsupported(what: str) -> BadRequest:
    return BadRequest(f"{what} is not supported", code="unsupported_parameter")


def invalid(message: str) -> BadRequest:
    return BadRequest(message, code="invalid_request")


def samples_of(req: OpenAIRequest) -> int:
    """``n``, checked against :data:`MAX_N` (400)."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise invalid(f"n must be between 1 and {MAX_N}, got {n}")
    return n


def check_shared(req: OpenAIRequest) -> None:
    """Refuse the shared fields Parrot cannot honour (400) rather than ignore them."""
    samples_of(req)
    if req.logit_bias:
        raise unsupported("logit_bias")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options needs stream=true")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP:
        raise invalid(f"stop holds at most {MAX_STOP} strings, got {len(req.stop)}")


class CompletionRequest(OpenAIRequest):
    """The body of ``POST /v1/completions``."""

    prompt: str | list[Any]
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    best_of: int | None = None
    logprobs: int | None = None
    # Accepted only at their no-op values:
    echo: bool = False
    suffix: str | None = None


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def prompts_of(prompt: str | list[Any]) -> list[Prompt]:
    """The request's prompts: a string, a list of strings, a list of token ids (one
    prompt) or a list of token-id lists; 400 for anything else or more than
    :data:`MAX_PROMPTS`.  Ids are checked against the model's vocabulary when rendered."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt is an empty list")
    if all(_is_id(x) for x in prompt):
        out: list[Prompt] = [tuple(prompt)]
    elif all(isinstance(x, str) for x in prompt):
        out = list(prompt)
    elif all(isinstance(x, list) and all(_is_id(t) for t in x) for x in prompt):
        out = [tuple(x) for x in prompt]
    else:
        raise invalid(
            "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"
        )
    if len(out) > MAX_PROMPTS:
        raise invalid(f"at most {MAX_PROMPTS} prompts per request, got {len(out)}")
    for i, p in enumerate(out):
        if not isinstance(p, str) and any(t < 0 for t in p):
            raise BadRequest(f"prompt {i}: token ids must be non-negative", code="invalid_token_id")
    return out


def _check_supported(req: CompletionRequest, n_prompts: int) -> int:
    """Refuse what Parrot cannot honour; returns ``n``."""
    check_shared(req)
    n = samples_of(req)
    if req.best_of is not None and req.best_of != n:
        if req.best_of < n:
            raise invalid(f"best_of ({req.best_of}) must be at least n ({n})")
        raise unsupported(f"best_of={req.best_of} greater than n={n} (best_of may only equal n)")
    if n * n_prompts > MAX_CHOICES:
        raise invalid(f"at most {MAX_CHOICES} choices (prompts x n) per request, got {n * n_prompts}")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise invalid(f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {req.logprobs}")
    if req.echo:
        raise unsupported("echo")
    if req.suffix:
        raise unsupported("suffix")
    return n


def sampling_of(
    req: Any,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    logprobs: int | None = None,
    constraint: Constraint | None = None,
) -> SamplingParams:
    """Parrot sampling settings for an OpenAI request (a completion's or a chat's, which
    share these fields; raises InvalidSampling, 400).  ``max_tokens`` null or absent
    means ``default_max_tokens``; ``logprobs``: how many most likely tokens to report
    per generated token (None: no logprobs); ``constraint``: the structured output
    asked for (:func:`~parrot.manager.openai.constraint.constraint_of`)."""
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
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logprobs=logprobs,
        constraint=constraint,
    )


def context_of(manager: Manager, model: str | None) -> int:
    """The longest context of a live engine serving ``model`` (503 when none does)."""
    check_model(manager, model)
    engine = manager.longest_context(model)
    if engine is None:  # gone since the check
        raise NoEngine(f"no live engine serves model {model!r}")
    return engine.max_seq_len


def openai_router(manager: Manager) -> APIRouter:
    """Routes ``POST /v1/completions`` and ``GET /v1/models`` for ``manager``.

    Mount with ``app.include_router(openai_router(manager))`` on an app made by
    :func:`parrot.manager.api.app.create_app` (whose error handlers give the JSON
    error bodies).
    """
    router = APIRouter(tags=["openai"], route_class=OffLoopJsonRoute)

    @router.get("/v1/models")
    async def list_models() -> dict:
        models: dict[str, int] = {}
        chat: dict[str, dict[str, Any] | None] = {}
        for h in manager.engines():
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
        prompts = prompts_of(req.prompt)
        n = _check_supported(req, len(prompts))
        # validate before creating anything; an explicit null max_tokens: up to the context
        max_tokens = context_of(manager, req.model)
        sampling = sampling_of(req, max_tokens, req.logprobs, await constraint_of(req))
        comp = await Completion.open(manager, prompts, sampling, req.model, tenant, chat=False, n=n)
        return await answer(comp, request, req.stream, req.stream_options)

    return router

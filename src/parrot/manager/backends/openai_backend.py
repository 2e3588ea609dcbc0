"""An external OpenAI-compatible completions server (vLLM, SGLang, any such server,
or another Parrot) driven as one of the manager's engines.

:class:`OpenAIBackend` implements :class:`parrot.protocol.engine_api.EngineAPI` over
``POST /v1/completions``: a context is a list of token ids kept here, and ``generate``
sends the whole of it as the prompt and streams the answer back.  At most
``max_inflight`` requests are in flight per backend; ``send_priority`` passes the
call's place in the manager's order to a vLLM started with ``--scheduling-policy
priority``; the latency cap is fitted here from the gaps between streamed tokens.
Connection errors, timeouts, 5xx, 408, 429 and malformed streams raise
:class:`EngineError` (the manager re-runs the call elsewhere); any other 4xx fails the
call.  How and why: docs/backends.md, "How the adapter drives a backend".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import httpx

from parrot.engine.core.latency_fit import StepLatency  # stdlib only: the fit Parrot's engine uses too
from parrot.manager.backends.openai_stream import FINISH_REASONS, MalformedAnswer, parse_sse_line
from parrot.protocol.constraint import Constraint
from parrot.protocol.errors import BadRequest, CallFailed, ContextTooLong, EngineError, NotFound, ParrotError
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import DEFAULT_BACKEND_MAX_INFLIGHT, EngineStats, GenerateChunk
from parrot.protocol.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

BACKEND_KINDS = ("vllm", "sglang", "openai")
_TOKEN_ID_KINDS = ("vllm", "sglang")  # servers whose /v1/completions takes a list[int] prompt
_RETRYABLE_4XX = (408, 429)
STATS_TIMEOUT_S = 5.0
"""The longest a stats poll waits for ``GET /v1/models``: the manager polls every engine
together, so one hung backend must not hold back the others' stats for long."""
NO_CAPACITY_CAP = 1 << 20
"""The measured cap's upper bound for a backend without a token capacity of its own (the
manager's scheduler clamps every cap at the capacity it applies)."""


@dataclass
class BackendOptions:
    """How to drive one kind of backend.

    ``kind``: ``vllm`` and ``sglang`` take token-id prompts and vLLM's extensions
    (``top_k``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``, ``cache_salt``);
    ``openai`` sends text prompts and only the standard fields (a non-default ``top_k``,
    ``stop_token_ids`` or ``ignore_eos`` is sent anyway, and a server that rejects it
    fails the call with its message).  ``timeout_s``: the longest wait for a connection
    or for any byte of an answer.  ``token_capacity``: the KV tokens the manager may
    place on the backend (0: the manager's default).  ``warm_prefix``: a fill of at
    least ``warm_min_tokens`` also sends that prefix with ``max_tokens=1`` so the
    backend's prefix cache holds it before the generation (off by default: it costs a
    request, and automatic prefix caching already keeps what the first call computed).
    ``send_priority``: send each generation's ``priority`` (vLLM's field; its server must
    run ``--scheduling-policy priority``, or it refuses any priority but 0) and let the
    manager dispatch latency calls up to the backend's capacity."""

    kind: str = "openai"
    model: str | None = None
    api_key: str | None = None
    max_inflight: int = DEFAULT_BACKEND_MAX_INFLIGHT
    timeout_s: float = 60.0
    token_capacity: int = 0
    warm_prefix: bool = False
    warm_min_tokens: int = 64
    send_priority: bool = False

    def __post_init__(self) -> None:
        if self.kind not in BACKEND_KINDS:
            raise ValueError(f"backend kind must be one of {', '.join(BACKEND_KINDS)}, got {self.kind!r}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.send_priority and self.kind != "vllm":
            raise ValueError(f"request priorities are vLLM's: a {self.kind!r} backend has no such field")

    @property
    def token_id_prompts(self) -> bool:
        return self.kind in _TOKEN_ID_KINDS

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class _Context:
    ids: list[int]
    salt: str


class OpenAIBackend:
    """One backend replica as an engine (see the module docstring).  Built by
    :func:`parrot.manager.backends.connect.connect_backend`, which reads the model's
    name and context length from the backend and checks the tokenizer against it."""

    def __init__(
        self, url: str, options: BackendOptions, model_name: str, max_seq_len: int, tokenizer: TextTokenizer
    ):
        self.url = url.rstrip("/")
        self.options = options
        self._model = model_name
        self._max_seq_len = max_seq_len
        self._tokenizer = tokenizer
        self._client: httpx.AsyncClient | None = None  # made on first use, on the serving loop
        self._slots: asyncio.Semaphore | None = None
        self._contexts: dict[int, _Context] = {}
        self._running = self._waiting = self._load = 0
        self.latency = StepLatency()  # step time against load, from the answers' token gaps
        self._counts = {"fills": 0, "filled_tokens": 0, "generates": 0, "generated_tokens": 0}

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def tokenizer(self) -> TextTokenizer:
        return self._tokenizer

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.url,
                timeout=httpx.Timeout(self.options.timeout_s),
                headers=self.options.headers(),
            )
            self._slots = asyncio.Semaphore(self.options.max_inflight)
        return self._client

    async def close(self) -> None:
        """Close the HTTP client (a later request opens a new one)."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    # ------------------------------------------------------------ contexts
    async def fill(
        self,
        tokens: Sequence[int],
        context_id: int,
        parent_context_id: int | None = None,
        cache_salt: str = "",
        *,
        priority: int = 0,
        retain: bool = False,
    ) -> None:
        ctx = self._contexts.get(context_id)
        if ctx is None:
            parent = None if parent_context_id is None else self._context(parent_context_id)
            ctx = _Context(list(parent.ids), parent.salt) if parent else _Context([], cache_salt)
        if len(ctx.ids) + len(tokens) >= self._max_seq_len:
            raise ContextTooLong(
                f"context {context_id} would hold {len(ctx.ids) + len(tokens)} tokens; "
                f"the backend {self.url} serves {self._max_seq_len}"
            )
        ctx.ids.extend(tokens)
        self._contexts[context_id] = ctx
        self._counts["fills"] += 1
        self._counts["filled_tokens"] += len(tokens)
        if self.options.warm_prefix and len(tokens) >= self.options.warm_min_tokens:
            await self._warm(ctx)

    async def free_context(self, context_id: int) -> None:
        self._contexts.pop(context_id, None)

    def _context(self, context_id: int) -> _Context:
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise NotFound(
                f"context {context_id} does not exist on backend {self.url}", code="context_not_found"
            )
        return ctx

    # ------------------------------------------------------------ generate
    async def generate(
        self,
        sampling: SamplingParams,
        context_id: int,
        parent_context_id: int | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[GenerateChunk]:
        """Stream the backend's answer for the context (forked from the parent first when
        it does not exist yet); the last chunk has ``done`` and the finish reason."""
        if context_id not in self._contexts and parent_context_id is not None:
            parent = self._context(parent_context_id)
            self._contexts[context_id] = _Context(list(parent.ids), parent.salt)
        ctx = self._context(context_id)
        room = self._max_seq_len - len(ctx.ids)
        if room <= 0:
            raise ContextTooLong(f"context {context_id} fills the backend's {self._max_seq_len} tokens")
        body = self._body(ctx, sampling, min(sampling.max_tokens, room), stream=True)
        if self.options.send_priority:
            body["priority"] = priority
        client = self._http()
        slots = await self._acquire_slot()
        self._running += 1
        prompt_len = len(ctx.ids)
        self._load += prompt_len
        self._counts["generates"] += 1
        text: list[str] = []
        ids: list[int] = []
        exact = True  # every chunk carried the server's token ids
        last_at: float | None = None  # when the previous piece of this answer arrived
        try:
            finish = None
            async with contextlib.aclosing(self._stream(client, body)) as pieces:
                async for piece in pieces:
                    if piece.text or piece.token_ids:
                        now = time.perf_counter()
                        piece_ids = piece.token_ids
                        if piece_ids is None:
                            exact = False
                            piece_ids = await self._encode(piece.text)
                        if last_at is not None and piece_ids:
                            self.latency.record(self._load, (now - last_at) / len(piece_ids))
                        last_at = now
                        text.append(piece.text)
                        ids.extend(piece_ids)
                        self._load += len(piece_ids)
                        self._counts["generated_tokens"] += len(piece_ids)
                        yield GenerateChunk(text=piece.text, token_ids=piece_ids)
                    finish = piece.finish_reason or finish
            self._check_finish(finish)
            ctx.ids.extend(ids if exact else await self._encode("".join(text)))
            yield GenerateChunk(done=True, finish_reason=finish)  # type: ignore[arg-type]
        finally:
            self._running -= 1
            self._load -= prompt_len + len(ids)
            slots.release()

    def _check_finish(self, finish: str | None) -> None:
        """EngineError naming the backend unless ``finish`` is a finish reason Parrot knows."""
        if finish not in FINISH_REASONS:
            raise EngineError(
                f"backend {self.url} ended the generation with finish_reason {finish!r}"
                if finish
                else f"backend {self.url} ended the stream without a finish_reason"
            )

    async def _acquire_slot(self) -> asyncio.Semaphore:
        """Wait for one of the backend's in-flight slots (counted as waiting meanwhile);
        returns the semaphore to release it to."""
        assert self._slots is not None
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        return self._slots

    async def _stream(self, client: httpx.AsyncClient, body: dict):
        """The parsed pieces of one streamed request, up to ``[DONE]``; every failure
        becomes an EngineError or CallFailed naming the backend."""
        try:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise self._status_error(resp)
                async for line in resp.aiter_lines():
                    piece = parse_sse_line(line, self._tokenizer.vocab_size)
                    if piece is None:
                        continue
                    if piece.done:
                        return
                    yield piece
            raise EngineError(f"backend {self.url} closed the stream before data: [DONE]")
        except MalformedAnswer as exc:
            raise EngineError(f"backend {self.url} sent a malformed answer: {exc}") from exc
        except httpx.TimeoutException as exc:
            raise EngineError(
                f"backend {self.url} sent nothing for {self.options.timeout_s:g}s (timeout): {exc!r}"
            ) from exc
        except httpx.HTTPError as exc:
            raise EngineError(f"backend {self.url} failed during a completion: {exc!r}") from exc

    def _body(self, ctx: _Context, sampling: SamplingParams, max_tokens: int, *, stream: bool) -> dict:
        """The /v1/completions request for ``ctx``; fields a plain OpenAI server may not
        know are sent only when they differ from their defaults."""
        opts = self.options
        body: dict = {
            "model": self._model,
            "prompt": list(ctx.ids)
            if opts.token_id_prompts
            else self._tokenizer.decode(ctx.ids, skip_special_tokens=False),
            "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stream": stream,
        }
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.ignore_eos:
            body["ignore_eos"] = True
        if opts.kind == "vllm":
            body["return_token_ids"] = True
            if ctx.salt:
                body["cache_salt"] = ctx.salt
        if sampling.constraint is not None:
            body["structured_outputs"] = self._structured(sampling.constraint)
        return body

    def _structured(self, constraint: Constraint) -> dict:
        """vLLM's ``structured_outputs`` for ``constraint``; other kinds of backend cannot be
        trusted to enforce one (a server that ignores unknown fields would answer
        unconstrained), so a constrained call on them fails with a clear 400."""
        if self.options.kind != "vllm":
            raise BadRequest(
                f"backend {self.url} (kind {self.options.kind!r}) cannot enforce a {constraint.field} "
                "constraint: structured outputs need a Parrot engine or a vLLM backend",
                code="constraint_unsupported",
            )
        field = {"json_schema": "json", "regex": "regex", "choice": "choice"}
        return {field[constraint.kind]: constraint.value}

    async def _encode(self, text: str) -> list[int]:
        """Token ids of answer text: inline when short (one streamed piece), off the loop
        when long (a whole answer to re-tokenize)."""
        if len(text) < 4096:
            return self._tokenizer.encode(text)
        return (await asyncio.to_thread(self._tokenizer.encode_unlocked, text))[1] or []

    async def _warm(self, ctx: _Context) -> None:
        """Send the context with max_tokens=1 so the backend's prefix cache holds it; a
        failure here is logged only (the generation that follows meets it for real)."""
        client = self._http()
        assert self._slots is not None
        body = self._body(ctx, SamplingParams(max_tokens=1), 1, stream=False)
        async with self._slots:
            try:
                resp = await client.post("/v1/completions", json=body)
                if resp.status_code >= 400:
                    log.warning("backend %s: warming a prefix answered %d", self.url, resp.status_code)
            except httpx.HTTPError as exc:
                log.warning("backend %s: warming a prefix failed: %r", self.url, exc)

    def _status_error(self, resp: httpx.Response) -> ParrotError:
        detail = resp.text[:300]
        message = f"backend {self.url} answered {resp.status_code}: {detail}"
        if resp.status_code >= 500 or resp.status_code in _RETRYABLE_4XX:
            return EngineError(message)
        return CallFailed(message, detail={"backend": self.url, "status": resp.status_code})

    # --------------------------------------------------------------- stats
    async def stats(self) -> EngineStats:
        """The adapter's counters, once the backend answers ``GET /v1/models`` (an
        EngineError when it does not: the manager keeps a suspected backend out)."""
        try:
            resp = await self._http().get("/v1/models", timeout=min(self.options.timeout_s, STATS_TIMEOUT_S))
        except httpx.HTTPError as exc:
            raise EngineError(f"backend {self.url} unreachable: {exc!r}") from exc
        if resp.status_code >= 400:
            raise EngineError(f"backend {self.url} answered GET /v1/models with {resp.status_code}")
        if self.latency.fit is None:
            self.latency.refit()  # the first fit as soon as the samples allow, not 64 tokens later
        capacity = self.options.token_capacity or NO_CAPACITY_CAP
        cap = self.latency.report(capacity)
        if self.options.send_priority:  # the backend orders by priority: nothing to hold back
            cap = {**cap, "latency_cap_tokens": capacity, "latency_cap_source": "priority"}
        return EngineStats(
            num_contexts=len(self._contexts),
            num_running=self._running,
            num_waiting=self._waiting,
            token_load=self._load,
            token_capacity=self.options.token_capacity,
            **self._counts,
            **cap,
        )

    async def set_token_capacity(self, n: int) -> None:
        """Change the KV tokens the manager may place on this backend."""
        self.options.token_capacity = n

"""A manager session for ``asyncio`` code (``async with P.aconnect(url) as s:``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from parrot.frontend.batching import RecordedBatch
from parrot.frontend.session_base import CURRENT_SESSION, SessionBase
from parrot.frontend.streaming import StreamedText
from parrot.frontend.variable import SemanticVariable
from parrot.frontend.wire import (
    BACKOFF_MAX,
    BACKOFF_START,
    DEFAULT_TIMEOUT,
    POLL_MAX_WAIT,
    NoSession,
    Outputs,
    create_body,
    decode_json,
    fmt_wait,
    one_or_tuple,
    parse_as,
    raise_for_status,
)
from parrot.protocol.errors import BadRequest, ParrotError
from parrot.protocol.schemas import SessionCreated, VariableInfo
from parrot.protocol.tls import tls_context

if TYPE_CHECKING:
    from parrot.frontend.function import SemanticFunction

__all__ = ["AsyncSession", "QueuedRequest"]


class QueuedRequest:
    """One queued request of an async session; ``done`` is set once it was
    answered (or abandoned), ``error`` holds why it failed."""

    __slots__ = ("done", "error", "opens")

    def __init__(self) -> None:
        self.done = asyncio.Event()
        self.error: ParrotError | None = None
        self.opens = False  # a batch that creates the (deferred) session itself


class AsyncSession(SessionBase):
    """A manager session for ``asyncio`` code.

    Calling a semantic function never blocks: it returns futures whose ids
    are unknown yet and queues the submission; one background task sends the
    queue in order, so the manager still sees one POST per call (or per
    :meth:`batch`) in program order.  A submission that fails is raised by
    :meth:`SemanticVariable.aget` of its outputs (and of everything that
    consumes them), and by the ``async with`` exit if nothing observed it.

    With ``defer_open``, opening the session sends nothing: the manager session
    is created by the first queued request, and when that is a :meth:`batch`,
    in the same request (``POST /v1/sessions`` carrying the batch), so a whole
    app costs one round trip.  ``session_id`` is None until then.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
        defer_open: bool = False,
        api_key: str | None = None,
    ):
        super().__init__(url, timeout=timeout, api_key=api_key)
        self._transport = transport
        self._defer_open = defer_open
        self._http: httpx.AsyncClient | None = None
        self._queue: (
            asyncio.Queue[tuple[QueuedRequest, Callable[[], Coroutine[Any, Any, None]]] | None] | None
        ) = None
        self._worker: asyncio.Task[None] | None = None
        self._failed: list[ParrotError] = []
        self._observed: list[ParrotError] = []

    # ----------------------------------------------------------- lifecycle
    async def open(self) -> AsyncSession:
        """Create the manager session (unless ``defer_open``) and start the sender task; idempotent."""
        if self.closed:
            raise NoSession(f"session to {self.url} is closed")
        if self.session_id is not None or self._queue is not None:
            return self
        if self._http is None:
            self._http = httpx.AsyncClient(
                base_url=self.url,
                timeout=self.timeout,
                transport=self._transport,
                headers=self._opening_headers(),
                verify=tls_context(),
            )
        if not self._defer_open:
            try:
                await self._create()
            except BaseException:
                await self._http.aclose()
                self._http = None
                raise
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._send_loop(), name=f"parrot-session-{id(self):x}")
        return self

    async def _create(self, batch: RecordedBatch | None = None) -> None:
        """``POST /v1/sessions`` (carrying ``batch``, whose ids it settles)."""
        body = None if batch is None else {"batch": batch.body()}
        read = None if body is None else RecordedBatch.read_timeout(self.timeout, body["batch"])
        data = await self._request("POST", "/v1/sessions", json=body, read=read)
        created = parse_as(SessionCreated, data, "session creation")
        if batch is not None:
            if created.batch is None:
                raise ParrotError("the manager's session carries no batch result", code="bad_response")
            batch.settle(created.batch.model_dump())
        self.session_id, self.token = created.session_id, created.token
        assert self._http is not None
        self._http.headers["Authorization"] = f"Bearer {created.token}"

    def _require_open(self) -> None:
        if self._defer_open and not self.closed and self._queue is not None:
            return  # opened; the manager session comes with the first request
        super()._require_open()

    async def close(self, *, drain: bool = True) -> None:
        """Send what is queued (unless ``drain`` is false), then close the
        manager session (``DELETE``) and the HTTP client; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._worker is not None and self._queue is not None:
                if drain:
                    self._queue.put_nowait(None)
                else:
                    self._worker.cancel()
                await asyncio.wait([self._worker])
                self._abandon_queued()
            if self.session_id is not None:
                await self._request("DELETE", self._sp)
        finally:
            if self._http is not None:
                await self._http.aclose()

    async def flush(self) -> None:
        """Wait until every submission queued so far has been answered (errors are not raised here)."""
        self._require_open()
        job = QueuedRequest()
        queue = self._queue
        if queue is None:
            raise NoSession(f"session to {self.url} is not open")

        async def nothing() -> None:
            return None

        queue.put_nowait((job, nothing))
        await job.done.wait()

    async def __aenter__(self) -> AsyncSession:
        await self.open()
        self._ctx.append(CURRENT_SESSION.set(self))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._ctx:
            CURRENT_SESSION.reset(self._ctx.pop())
        close_error: ParrotError | None = None
        try:
            await self.close(drain=exc_type is None)
        except ParrotError as error:
            close_error = error
        if exc_type is not None:
            return  # the body's exception is the one to see
        unobserved = [e for e in self._failed if not any(e is o for o in self._observed)]
        if unobserved:
            raise unobserved[0]
        if close_error is not None:
            raise close_error

    # ---------------------------------------------------------------- http
    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, str] | None = None,
        read: float | None = None,
    ) -> Any:
        http = self._http
        if http is None:
            raise NoSession(f"session to {self.url} is not open")
        timeout = httpx.Timeout(self.timeout, read=read if read is not None else self.timeout)
        try:
            response = await http.request(method, path, json=json, params=params, timeout=timeout)
        except httpx.HTTPError as exc:
            raise self._transport_error(method, path, exc) from exc
        raise_for_status(response)
        return decode_json(response, f"{method} {path}")

    # -------------------------------------------------------------- queue
    def _enqueue(
        self, make: Callable[[QueuedRequest], Coroutine[Any, Any, None]], job: QueuedRequest | None = None
    ) -> QueuedRequest:
        self._require_open()
        if self._queue is None:
            raise NoSession(f"session to {self.url} is not open")
        job = job if job is not None else QueuedRequest()
        self._queue.put_nowait((job, lambda: make(job)))
        return job

    async def _send_loop(self) -> None:
        queue = self._queue
        if queue is None:
            return
        while True:
            item = await queue.get()
            if item is None:
                return
            job, run = item
            try:
                if self.session_id is None and not job.opens:
                    await self._create()  # a deferred open: this request needs the session
                await run()
            except ParrotError as error:
                job.error = error
            except asyncio.CancelledError:
                job.error = NoSession("the session was closed before this request was answered")
                raise
            except Exception as error:  # a client bug must not stall every later submission
                job.error = ParrotError(f"internal client error: {error!r}", code="client_error")
            finally:
                job.done.set()
                if job.error is not None and not any(job.error is e for e in self._failed):
                    self._failed.append(job.error)

    def _abandon_queued(self) -> None:
        """Fail whatever the sender never reached (after cancellation)."""
        queue = self._queue
        while queue is not None and not queue.empty():
            item = queue.get_nowait()
            if item is not None:
                job = item[0]
                job.error = NoSession("the session was closed before this request was sent")
                job.done.set()

    async def _await_id(
        self, var: SemanticVariable, deadline: float | None, timeout: float | None, *, observe: bool = True
    ) -> None:
        """Wait for the request that assigns ``var.id`` and raise its error if it
        failed (``observe``: the user sees it, so the session exit need not)."""
        job: QueuedRequest | None = var._pending
        if job is None:
            if var.id is None:
                raise ParrotError(
                    f"variable {var.name!r} has no id and no pending request", code="client_error"
                )
            return
        if not job.done.is_set():
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                await asyncio.wait_for(job.done.wait(), remaining)
            except TimeoutError:
                raise self._timeout_error(var, timeout) from None
        if job.error is not None:
            if observe:
                self._observed.append(job.error)
            raise job.error

    # ----------------------------------------------------------- user API
    @contextlib.asynccontextmanager
    async def batch(self, *, fetch_outputs: bool = False) -> AsyncIterator[None]:
        """Record the block's calls, :meth:`variable` creations and ``await var.aset()``
        and send them at its end as one request (queued after everything
        submitted before), applied all or none; the exit waits for the answer.

        Variables created in the block get their ids at its end; reading one
        inside the block raises :class:`BadRequest`.  A rejected batch raises
        here (its message names the op), as does the ``aget`` of every
        variable it created; if the block raises, nothing is sent.  While the
        block records, every operation on this session, from any task, goes
        into the batch.

        With ``fetch_outputs`` the request also waits (up to 60 s) for the values of
        the block's final outputs, the outputs no call of the block reads, and they
        come back with its answer: their ``aget`` sends nothing, so a whole app
        (with ``defer_open``, its session too) is one round trip.  Every input they
        depend on must then be set in the block or earlier (else the batch is
        rejected with ``wait_needs_input``), and the session's later requests queue
        behind the answer.
        """
        job = QueuedRequest()
        batch = self._start_batch(job, fetch_outputs)
        try:
            yield
        except BaseException:
            abandon_batch(
                batch, job, BadRequest("the batch was not sent: its block raised", code="batch_abandoned")
            )
            raise
        finally:
            self._batch = None
        if not len(batch):
            return
        job.opens = True  # if the session is still to be created, the batch does it
        try:
            self._enqueue(lambda _: self._send_batch(batch), job)
        except ParrotError as error:  # the session was closed meanwhile
            abandon_batch(batch, job, error)
            raise
        await job.done.wait()
        if job.error is not None:
            self._observed.append(job.error)
            raise job.error

    async def _send_batch(self, batch: RecordedBatch) -> None:
        try:
            for var in batch.outside:
                if var.id is None:  # queued earlier, so already answered; its failure fails the batch
                    await self._await_id(var, None, None, observe=False)
            if self.session_id is None:  # a deferred open: the session comes with the batch
                await self._create(batch)
                return
            body = batch.body()
            read = batch.read_timeout(self.timeout, body)
            batch.settle(await self._request("POST", f"{self._sp}/batch", json=body, read=read))
        except ParrotError as error:
            batch.fail(error)
            raise

    def call(self, fn: SemanticFunction, *args: Any, **kwargs: Any) -> Outputs:
        """Queue ``fn(*args, **kwargs)`` (or record it in a batch); returns its output future(s)
        at once (ids pending)."""
        inputs = self._bind(fn, args, kwargs)
        outputs = [SemanticVariable(self, name=n) for n in fn.outputs]
        if self._batch is not None:
            self._batch.call(fn, inputs, outputs)
            return one_or_tuple(outputs)

        async def submit(job: QueuedRequest) -> None:
            for value in inputs.values():
                if isinstance(value, SemanticVariable) and value.id is None:
                    # queued earlier, so already answered; its failure is this call's failure too
                    await self._await_id(value, None, None, observe=False)
            data = await self._request("POST", f"{self._sp}/calls", json=fn.submit_body(inputs))
            for var, answered in zip(outputs, self._output_vars(fn, data), strict=True):
                var._id = answered.id

        job = self._enqueue(submit)
        for var in outputs:
            var._pending = job
        return one_or_tuple(outputs)

    async def graph(self, value_chars: int = 0) -> dict[str, Any]:
        """The session's DAG as the manager sees it once everything queued so far was
        sent (see :meth:`Session.graph <parrot.frontend.sync_session.Session.graph>`)."""
        params = self._graph_params(value_chars)
        await self.flush()
        if self.session_id is None:
            raise NoSession(f"session to {self.url} has no manager session yet: nothing was sent")
        return await self._request("GET", f"{self._sp}/graph", params=params)

    def variable(self, value: str | None = None, name: str | None = None) -> SemanticVariable:
        """Queue the creation of a variable (or record it in a batch); returns it at once (id pending)."""
        body = create_body(value, name)
        var = SemanticVariable(self, name=name)
        if self._batch is not None:
            self._require_open()
            self._batch.variable(var, body)
            return var

        async def create(job: QueuedRequest) -> None:
            data = await self._request("POST", f"{self._sp}/variables", json=body)
            var._id = parse_as(VariableInfo, data, "variable creation").var_id

        var._pending = self._enqueue(create)
        if body.get("value") is not None:
            var._resolve(body["value"])
        return var

    # ------------------------------------------------- variable internals
    def _get_variable(self, var: SemanticVariable, criteria: str, timeout: float | None) -> str:
        raise BadRequest("this variable belongs to an async session; use `await var.aget()`")

    def _set_variable(self, var: SemanticVariable, value: str) -> None:
        raise BadRequest("this variable belongs to an async session; use `await var.aset(value)`")

    def _stream_variable(self, var: SemanticVariable, criteria: str, timeout: float | None) -> Iterator[str]:
        raise BadRequest("this variable belongs to an async session; use `async for d in var.astream()`")

    async def _aget_variable(self, var: SemanticVariable, criteria: str, timeout: float | None) -> str:
        self._check_owned(var)
        self._check_sent(var)
        deadline = None if timeout is None else time.monotonic() + timeout
        await self._await_id(var, deadline, timeout)
        if self._cached(var):
            return var._value  # type: ignore[return-value]
        self._require_open()
        backoff = BACKOFF_START
        while True:
            wait = (
                POLL_MAX_WAIT
                if deadline is None
                else max(0.0, min(POLL_MAX_WAIT, deadline - time.monotonic()))
            )
            started = time.monotonic()
            params = {"wait": fmt_wait(wait), "criteria": criteria}
            data = await self._request("GET", self._vp(var), params=params, read=self.timeout + wait)
            if self._settle(var, data):
                return var._value  # type: ignore[return-value]
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise self._timeout_error(var, timeout)
            if now - started < wait / 2:
                await asyncio.sleep(backoff if deadline is None else min(backoff, max(0.0, deadline - now)))
                backoff = min(backoff * 2, BACKOFF_MAX)

    async def _aset_variable(self, var: SemanticVariable, value: str) -> None:
        self._check_owned(var)
        if self._batch is not None:
            self._require_open()
            self._batch.set(var, value)
            return
        await self._await_id(var, None, None)
        self._require_open()
        await self._request("PUT", self._vp(var), json={"value": value})
        var._resolve(value)

    def _astream_variable(
        self, var: SemanticVariable, criteria: str, timeout: float | None
    ) -> AsyncIterator[str]:
        self._check_owned(var)
        self._check_sent(var)
        self._require_open()
        return self._aiter_stream(var, criteria, timeout)

    async def _aiter_stream(
        self, var: SemanticVariable, criteria: str, timeout: float | None
    ) -> AsyncIterator[str]:
        await self._await_id(var, None, None)
        path = f"{self._vp(var)}/stream"
        http = self._http
        if http is None:
            raise NoSession(f"session to {self.url} is not open")
        try:
            async with http.stream(
                "GET", path, params={"criteria": criteria}, timeout=httpx.Timeout(self.timeout, read=timeout)
            ) as response:
                if not response.is_success:
                    await response.aread()
                    raise_for_status(response)
                streamed = StreamedText(var)
                async for line in response.aiter_lines():
                    event = self._stream_event(var, line)
                    text = streamed.take(event)
                    if text:
                        yield text
                    if event.done:
                        return
        except httpx.HTTPError as exc:
            raise self._transport_error("GET", path, exc) from exc
        raise ParrotError(
            f"stream of variable {var.id} ended without its final line", code="stream_truncated"
        )


def abandon_batch(batch: RecordedBatch, job: QueuedRequest, error: ParrotError) -> None:
    """An async batch that will never be sent: its variables raise ``error``."""
    job.error = error
    batch.fail(error)
    job.done.set()

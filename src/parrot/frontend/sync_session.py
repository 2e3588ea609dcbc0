"""A manager session driven synchronously (``with P.connect(url) as s:``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

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

__all__ = ["Session"]


class Session(SessionBase):
    """A manager session driven synchronously: each call is one blocking POST.

    Use as a context manager (``with P.connect(url) as s:``) or call
    :meth:`open`/:meth:`close` yourself.  ``transport`` lets tests plug in an
    ``httpx.MockTransport``.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
        api_key: str | None = None,
    ):
        super().__init__(url, timeout=timeout, api_key=api_key)
        self._transport = transport
        self._http: httpx.Client | None = None

    # ----------------------------------------------------------- lifecycle
    def open(self) -> Session:
        """Create the manager session (``POST /v1/sessions``); idempotent."""
        if self.closed:
            raise NoSession(f"session to {self.url} is closed")
        if self.session_id is not None:
            return self
        if self._http is None:
            self._http = httpx.Client(
                base_url=self.url,
                timeout=self.timeout,
                transport=self._transport,
                headers=self._opening_headers(),
                verify=tls_context(),
            )
        try:
            data = self._request("POST", "/v1/sessions")
            created = parse_as(SessionCreated, data, "session creation")
        except BaseException:
            self._http.close()
            self._http = None
            raise
        self.session_id, self.token = created.session_id, created.token
        self._http.headers["Authorization"] = f"Bearer {created.token}"
        return self

    def close(self) -> None:
        """Close the manager session (``DELETE``) and the HTTP client; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.session_id is not None:
                self._request("DELETE", self._sp)
        finally:
            if self._http is not None:
                self._http.close()

    def __enter__(self) -> Session:
        self.open()
        self._ctx.append(CURRENT_SESSION.set(self))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._ctx:
            CURRENT_SESSION.reset(self._ctx.pop())
        try:
            self.close()
        except ParrotError:
            if exc_type is None:
                raise  # otherwise the body's own exception is the one to see

    # ---------------------------------------------------------------- http
    def _request(
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
            response = http.request(method, path, json=json, params=params, timeout=timeout)
        except httpx.HTTPError as exc:
            raise self._transport_error(method, path, exc) from exc
        raise_for_status(response)
        return decode_json(response, f"{method} {path}")

    # ----------------------------------------------------------- user API
    @contextlib.contextmanager
    def batch(self, *, fetch_outputs: bool = False) -> Iterator[None]:
        """Record the block's calls, :meth:`variable` creations and ``var.set()``
        and send them at its end as one request, applied all or none.

        Variables created in the block get their ids at its end; reading one
        inside the block raises :class:`BadRequest`.  A rejected batch raises
        here (its message names the op) and fails every variable it created;
        if the block raises, nothing is sent.  With ``fetch_outputs`` the block's
        end also waits (up to 60 s) for the values of its final outputs, the outputs
        no call of the block reads, which come back with the answer: their ``get``
        sends nothing.  Every input they depend on must then be set by the block or
        earlier (else the batch is rejected with ``wait_needs_input``).
        """
        batch = self._start_batch(None, fetch_outputs)
        try:
            yield
        except BaseException:
            batch.fail(BadRequest("the batch was not sent: its block raised", code="batch_abandoned"))
            raise
        finally:
            self._batch = None
        if not len(batch):
            return
        try:
            body = batch.body()
            read = batch.read_timeout(self.timeout, body)
            batch.settle(self._request("POST", f"{self._sp}/batch", json=body, read=read))
        except ParrotError as error:
            batch.fail(error)
            raise

    def call(self, fn: SemanticFunction, *args: Any, **kwargs: Any) -> Outputs:
        """Submit ``fn(*args, **kwargs)`` here (one POST, or recorded in a batch); returns its output(s)."""
        inputs = self._bind(fn, args, kwargs)
        if self._batch is not None:
            outputs = [SemanticVariable(self, name=n) for n in fn.outputs]
            self._batch.call(fn, inputs, outputs)
            return one_or_tuple(outputs)
        data = self._request("POST", f"{self._sp}/calls", json=fn.submit_body(inputs))
        return one_or_tuple(self._output_vars(fn, data))

    def graph(self, value_chars: int = 0) -> dict[str, Any]:
        """The session's DAG as the manager sees it now (``GET /v1/sessions/{id}/graph``):
        ``calls`` (state, objective, task group, engine, placement, token figures,
        timings) and ``variables`` (state, producer, consumers; with ``value_chars``, up
        to that many characters of each one's text)."""
        self._require_open()
        return self._request("GET", f"{self._sp}/graph", params=self._graph_params(value_chars))

    def variable(self, value: str | None = None, name: str | None = None) -> SemanticVariable:
        """Create a variable, ready if ``value`` is given, else to be :meth:`~SemanticVariable.set`."""
        self._require_open()
        body = create_body(value, name)
        if self._batch is not None:
            var = SemanticVariable(self, name=name)
            self._batch.variable(var, body)
            return var
        data = self._request("POST", f"{self._sp}/variables", json=body)
        info = parse_as(VariableInfo, data, "variable creation")
        var = SemanticVariable(self, name=name, var_id=info.var_id)
        if body.get("value") is not None:
            var._resolve(body["value"])
        return var

    # ------------------------------------------------- variable internals
    def _get_variable(self, var: SemanticVariable, criteria: str, timeout: float | None) -> str:
        self._check_owned(var)
        self._check_sent(var)
        if self._cached(var):
            return var._value  # type: ignore[return-value]
        self._require_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = BACKOFF_START
        while True:
            wait = (
                POLL_MAX_WAIT
                if deadline is None
                else max(0.0, min(POLL_MAX_WAIT, deadline - time.monotonic()))
            )
            started = time.monotonic()
            params = {"wait": fmt_wait(wait), "criteria": criteria}
            data = self._request("GET", self._vp(var), params=params, read=self.timeout + wait)
            if self._settle(var, data):
                return var._value  # type: ignore[return-value]
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise self._timeout_error(var, timeout)
            if now - started < wait / 2:  # the manager answered early: do not spin
                time.sleep(backoff if deadline is None else min(backoff, max(0.0, deadline - now)))
                backoff = min(backoff * 2, BACKOFF_MAX)

    async def _aget_variable(self, var: SemanticVariable, criteria: str, timeout: float | None) -> str:
        return await asyncio.to_thread(self._get_variable, var, criteria, timeout)

    def _set_variable(self, var: SemanticVariable, value: str) -> None:
        self._check_owned(var)
        self._require_open()
        if self._batch is not None:
            self._batch.set(var, value)
            return
        self._request("PUT", self._vp(var), json={"value": value})
        var._resolve(value)

    async def _aset_variable(self, var: SemanticVariable, value: str) -> None:
        await asyncio.to_thread(self._set_variable, var, value)

    def _stream_variable(self, var: SemanticVariable, criteria: str, timeout: float | None) -> Iterator[str]:
        self._check_owned(var)
        self._check_sent(var)
        self._require_open()
        return self._iter_stream(var, criteria, timeout)

    def _iter_stream(self, var: SemanticVariable, criteria: str, timeout: float | None) -> Iterator[str]:
        path = f"{self._vp(var)}/stream"
        http = self._http
        if http is None:
            raise NoSession(f"session to {self.url} is not open")
        try:
            with http.stream(
                "GET", path, params={"criteria": criteria}, timeout=httpx.Timeout(self.timeout, read=timeout)
            ) as response:
                if not response.is_success:
                    response.read()
                    raise_for_status(response)
                streamed = StreamedText(var)
                for line in response.iter_lines():
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

    def _astream_variable(
        self, var: SemanticVariable, criteria: str, timeout: float | None
    ) -> AsyncIterator[str]:
        raise BadRequest("astream() needs an async session (P.aconnect); use stream() here")

"""Sessions: the client's connection to a Parrot manager over HTTP.

``with P.connect(url) as s:`` (or ``async with P.aconnect(url) as s:``)
opens a manager session, makes it the *current* session (a context variable)
so that calling a semantic function submits there, and closes the session on
exit, even when the body raises.

Endpoints used (all JSON; every request after the first carries
``Authorization: Bearer <token>``, the first one the API key if the manager
has keys: ``api_key=`` or ``$PARROT_API_KEY``):

=========================================================  =====================
``POST   /v1/sessions``         (``CreateSession`` or none) -> ``SessionCreated``
``DELETE /v1/sessions/{sid}``                              -> any 2xx
``POST   /v1/sessions/{sid}/calls``          ``SubmitCall`` -> ``CallSubmitted``
``POST   /v1/sessions/{sid}/variables``  ``CreateVariable`` -> ``VariableInfo``
``PUT    /v1/sessions/{sid}/variables/{vid}`` ``SetVariable`` -> any 2xx
``GET    /v1/sessions/{sid}/variables/{vid}?wait=W&criteria=C`` -> ``VariableInfo``
``GET    /v1/sessions/{sid}/variables/{vid}/stream?criteria=C`` -> NDJSON
``POST   /v1/sessions/{sid}/batch``        ``BatchRequest`` -> ``BatchResult``
=========================================================  =====================

``wait`` is a decimal number of seconds in ``[0, 30]``: the manager answers
when the variable leaves ``pending`` or when ``wait`` has passed.  The stream
is lines ``{"text": delta}`` ended by ``{"done": true, "state": "ready" |
"failed", "error": {...} | null}`` (blank lines are ignored; an optional
``"value"`` in the final line is cached as the variable's value).  A line
``{"restart": true}`` says the producing call is re-running on another engine
and its text starts over (``_StreamedText`` keeps what ``stream()`` yields
consistent).

Invariants: one HTTP request per semantic-function call, sent in program order
(the async session sends from one background task, in queue order), except
inside a ``session.batch()`` block, whose calls, variable creations and sets
are recorded and sent at its end as one request, applied all or none; a
non-2xx answer with an ``{"error": ...}`` body becomes the very error class
the server raised (:func:`~parrot.protocol.errors.error_from_body`); transport
failures become :class:`ConnectionFailed` or
:class:`~parrot.protocol.errors.Timeout`, naming the URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextvars import ContextVar, Token
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from parrot.frontend.variable import SemanticVariable, check_value
from parrot.protocol.errors import (
    BadRequest,
    BindingError,
    CallFailed,
    ParrotError,
    Timeout,
    error_from_body,
)
from parrot.protocol.schemas import (
    MAX_BATCH_OPS,
    BatchRequest,
    BatchResult,
    CallSubmitted,
    ErrorInfo,
    SessionCreated,
    VariableInfo,
)

if TYPE_CHECKING:
    from parrot.frontend.function import SemanticFunction

DEFAULT_TIMEOUT = 30.0
API_KEY_ENV = "PARROT_API_KEY"
"""Where a session finds its API key when none is passed."""
"""Seconds allowed for an ordinary request (long polls get their ``wait`` on top)."""
POLL_MAX_WAIT = 30.0
"""Longest ``wait`` asked of the manager in one long poll."""
_BACKOFF_START, _BACKOFF_MAX = 0.01, 1.0

_M = TypeVar("_M", bound=BaseModel)
Outputs = SemanticVariable | tuple[SemanticVariable, ...]


class ConnectionFailed(ParrotError):
    """The manager could not be reached (refused, DNS, reset, bad URL scheme)."""

    status = 503
    default_code = "connection_failed"


class NoSession(BadRequest):
    """A semantic function was called with no open session to submit to."""

    default_code = "no_session"


_CURRENT: ContextVar[Session | AsyncSession | None] = ContextVar("parrot_session", default=None)


def current_session() -> Session | AsyncSession:
    """The innermost session entered with ``with``/``async with`` in this context."""
    session = _CURRENT.get()
    if session is None:
        raise NoSession(
            "no Parrot session is active: call semantic functions inside `with P.connect(url):` "
            "or `async with P.aconnect(url):`, or use session.call(fn, ...)"
        )
    return session


# ------------------------------------------------------------------ helpers
def _raise_for_status(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    raise error_from_body(response.status_code, body)


def _decode(response: httpx.Response, what: str) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        raise ParrotError(
            f"{what}: the manager answered with non-JSON content", code="bad_response"
        ) from None


def _parse(model: type[_M], data: Any, what: str) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ParrotError(
            f"{what}: unexpected response from the manager: {exc}", code="bad_response"
        ) from None


def _error_from_info(info: ErrorInfo | dict[str, Any] | None, what: str) -> ParrotError:
    if info is None:
        return CallFailed(f"{what} failed (the manager gave no reason)")
    body = info.model_dump() if isinstance(info, ErrorInfo) else info
    return error_from_body(CallFailed.status, {"error": body})


def _fmt_wait(seconds: float) -> str:
    return f"{seconds:.3f}".rstrip("0").rstrip(".")


def _quote(part: str) -> str:
    return quote(part, safe="")


def _one_or_tuple(outputs: list[SemanticVariable]) -> Outputs:
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


class _Batch:
    """Operations recorded in a ``session.batch()`` block, sent as one
    ``POST /v1/sessions/{sid}/batch`` when the block ends.

    Invariants: every variable the batch creates (with ``variable()`` or as a
    call's output) has a ref unique in the batch, ``_pending`` set to ``job``
    (async sessions; ``None`` for sync ones) and no id until :meth:`settle`
    assigns the manager's; a variable from outside the batch is named by its
    id, which must be known when :meth:`body` runs (``outside`` lists them).
    Values given to ``set`` are cached on their variables only by
    :meth:`settle`, once the manager accepted the whole batch.
    """

    def __init__(self, job: _Job | None):
        self.job = job
        self.refs: dict[SemanticVariable, str] = {}
        self.outside: list[SemanticVariable] = []
        self.sets: list[tuple[SemanticVariable, str]] = []
        self._ops: list[Callable[[], dict[str, Any]]] = []  # built at send time: outside ids are known then

    def __len__(self) -> int:
        return len(self._ops)

    # ---------------------------------------------------------- recording
    def variable(self, var: SemanticVariable, body: dict[str, Any]) -> None:
        self._check_room()
        op = {"op": "create_variable", "ref": self._new_ref(var), **body}
        self._ops.append(lambda: op)

    def call(self, fn: SemanticFunction, inputs: dict[str, Any], outputs: list[SemanticVariable]) -> None:
        self._check_room()
        for value in inputs.values():
            if isinstance(value, SemanticVariable):
                self._use(value)
        output_refs = {str(var.name): self._new_ref(var) for var in outputs}
        self._ops.append(lambda: fn.batch_op(inputs, self.refs.get, output_refs))

    def set(self, var: SemanticVariable, value: str) -> None:
        self._check_room()
        self._use(var)
        self.sets.append((var, value))
        self._ops.append(lambda: {"op": "set_variable", **self._names(var), "value": value})

    def _check_room(self) -> None:
        if len(self._ops) >= MAX_BATCH_OPS:
            raise BadRequest(f"a batch holds at most {MAX_BATCH_OPS} operations")

    def _new_ref(self, var: SemanticVariable) -> str:
        ref = self.refs[var] = f"r{len(self.refs)}"
        var._pending = self.job
        return ref

    def _use(self, var: SemanticVariable) -> None:
        if var not in self.refs:
            self.outside.append(var)

    def _names(self, var: SemanticVariable) -> dict[str, str]:
        ref = self.refs.get(var)
        if ref is not None:
            return {"ref": ref}
        if var.id is None:
            raise ParrotError(f"variable {var.name!r} has no id yet", code="client_error")
        return {"var_id": var.id}

    # ------------------------------------------------------------ sending
    def body(self) -> dict[str, Any]:
        """The ``BatchRequest`` JSON body, checked against the wire schema."""
        body = {"ops": [op() for op in self._ops]}
        BatchRequest.model_validate(body)
        return body

    def settle(self, data: Any) -> None:
        """Take the manager's ``BatchResult``: ids of created variables, values of set ones."""
        result = _parse(BatchResult, data, "batch")
        missing = [ref for ref in self.refs.values() if ref not in result.refs]
        if missing:
            raise ParrotError(f"the manager's answer to a batch lacks ref(s) {missing}", code="bad_response")
        for var, ref in self.refs.items():
            var._id = result.refs[ref]
        for var, value in self.sets:
            var._resolve(value)

    def fail(self, error: ParrotError) -> None:
        """The batch was not applied: its variables carry ``error`` for ever."""
        for var in self.refs:
            var._fail(error)


class _Base:
    """What both session kinds share: paths, argument checks, response handling."""

    def __init__(self, url: str, *, timeout: float = DEFAULT_TIMEOUT, api_key: str | None = None):
        if not isinstance(url, str) or not url.strip():
            raise BadRequest(f"manager URL must be a non-empty string, got {url!r}")
        self.url = url.strip().rstrip("/")
        # presented when the session is opened (the manager's tenants); later requests
        # present the session's own token
        self._api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        self.timeout = float(timeout)
        self.session_id: str | None = None
        self.token: str | None = None
        self.closed = False
        self._ctx: list[Token[Session | AsyncSession | None]] = []
        self._batch: _Batch | None = None  # while a batch() block records

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open" if self.session_id else "not opened"
        return f"{type(self).__name__}({self.url!r}, session_id={self.session_id!r}, {state})"

    # --------------------------------------------------------------- paths
    @property
    def _sp(self) -> str:
        return f"/v1/sessions/{_quote(self.session_id or '')}"

    def _vp(self, var: SemanticVariable) -> str:
        return f"{self._sp}/variables/{_quote(var.id or '')}"

    def _opening_headers(self) -> dict[str, str]:
        """The headers of a new HTTP client: the API key, if any, until a session token replaces it."""
        return {} if self._api_key is None else {"Authorization": f"Bearer {self._api_key}"}

    def _transport_error(self, method: str, path: str, exc: httpx.HTTPError) -> ParrotError:
        where = f"{method} {self.url}{path}"
        if isinstance(exc, httpx.TimeoutException):
            return Timeout(f"request to the Parrot manager timed out ({where}): {exc!r}")
        return ConnectionFailed(f"cannot reach the Parrot manager at {self.url} ({where}): {exc}")

    # -------------------------------------------------------------- checks
    def _require_open(self) -> None:
        if self.closed:
            raise NoSession(f"session {self.session_id} to {self.url} is closed")
        if self.session_id is None:
            raise NoSession(f"session to {self.url} is not open; use it in a with/async with block")

    def _start_batch(self, job: _Job | None) -> _Batch:
        self._require_open()
        if self._batch is not None:
            raise BadRequest("session.batch() blocks do not nest")
        self._batch = _Batch(job)
        return self._batch

    def _check_sent(self, var: SemanticVariable) -> None:
        """Raise if ``var`` is created by the batch still being recorded (it has no id yet)."""
        if self._batch is not None and var in self._batch.refs:
            raise BadRequest(
                f"variable {var.name!r} is created by the batch being recorded; "
                "read it after the session.batch() block"
            )

    def _check_owned(self, var: SemanticVariable, what: str = "variable") -> None:
        if not isinstance(var, SemanticVariable):
            raise BadRequest(f"{what} must be a SemanticVariable, got {type(var).__name__}")
        if var.session is not self:
            raise BindingError(f"{what} {var!r} belongs to another session")

    def _bind(self, fn: SemanticFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        self._require_open()
        bound = fn.bind(args, kwargs)
        checked: dict[str, Any] = {}
        for name, value in bound.items():
            what = f"input {name!r} of {fn.__name__}()"
            if isinstance(value, SemanticVariable):
                self._check_owned(value, what)
                checked[name] = value
            else:
                checked[name] = check_value(value, what, variable_ok=True)
        return checked

    def _output_vars(self, fn: SemanticFunction, data: Any) -> list[SemanticVariable]:
        submitted = _parse(CallSubmitted, data, f"submit of {fn.__name__}()")
        missing = [n for n in fn.outputs if n not in submitted.outputs]
        if missing:
            raise ParrotError(
                f"the manager's answer to {fn.__name__}() lacks output(s) {missing}", code="bad_response"
            )
        return [SemanticVariable(self, name=n, var_id=submitted.outputs[n]) for n in fn.outputs]  # type: ignore[arg-type]

    def _settle(self, var: SemanticVariable, data: Any) -> bool:
        """Record a ``VariableInfo``; True when ready, raises when failed."""
        info = _parse(VariableInfo, data, f"variable {var.id}")
        if info.state == "ready":
            if info.value is None:
                raise ParrotError(f"variable {var.id} is ready but has no value", code="bad_response")
            var._resolve(info.value)
            return True
        if info.state == "failed":
            error = _error_from_info(info.error, f"variable {var.name or var.id}")
            var._fail(error)
            raise error
        return False

    def _stream_event(self, var: SemanticVariable, line: str) -> _Event:
        """One NDJSON line -> its event; raises on a failed end."""
        if not line.strip():
            return _Event()
        try:
            event = json.loads(line)
        except ValueError:
            raise ParrotError(
                f"stream of variable {var.id}: bad line {line[:200]!r}", code="bad_response"
            ) from None
        if not isinstance(event, dict):
            raise ParrotError(f"stream of variable {var.id}: bad line {line[:200]!r}", code="bad_response")
        if event.get("error") or event.get("state") == "failed":
            error = _error_from_info(event.get("error"), f"variable {var.name or var.id}")
            var._fail(error)
            raise error
        if event.get("done"):
            value = event.get("value")
            if isinstance(value, str):
                var._resolve(value)
                return _Event(done=True, value=value)
            return _Event(done=True)
        if event.get("restart"):
            return _Event(restart=True)
        text = event.get("text", "")
        return _Event(text=text if isinstance(text, str) else "")

    def _cached(self, var: SemanticVariable) -> bool:
        if var._error is not None:
            raise var._error
        return var._has_value

    def _timeout_error(self, var: SemanticVariable, timeout: float | None) -> Timeout:
        label = f"{var.name!r} ({var.id})" if var.name else str(var.id)
        return Timeout(f"variable {label} not ready after {timeout} s")


# --------------------------------------------------------------------- sync
class Session(_Base):
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
            )
        try:
            data = self._request("POST", "/v1/sessions")
            created = _parse(SessionCreated, data, "session creation")
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
        self._ctx.append(_CURRENT.set(self))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._ctx:
            _CURRENT.reset(self._ctx.pop())
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
        _raise_for_status(response)
        return _decode(response, f"{method} {path}")

    # ----------------------------------------------------------- user API
    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Record the block's calls, :meth:`variable` creations and ``var.set()``
        and send them at its end as one request, applied all or none.

        Variables created in the block get their ids at its end; reading one
        inside the block raises :class:`BadRequest`.  A rejected batch raises
        here (its message names the op) and fails every variable it created;
        if the block raises, nothing is sent.
        """
        batch = self._start_batch(None)
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
            batch.settle(self._request("POST", f"{self._sp}/batch", json=batch.body()))
        except ParrotError as error:
            batch.fail(error)
            raise

    def call(self, fn: SemanticFunction, *args: Any, **kwargs: Any) -> Outputs:
        """Submit ``fn(*args, **kwargs)`` here (one POST, or recorded in a batch); returns its output(s)."""
        inputs = self._bind(fn, args, kwargs)
        if self._batch is not None:
            outputs = [SemanticVariable(self, name=n) for n in fn.outputs]
            self._batch.call(fn, inputs, outputs)
            return _one_or_tuple(outputs)
        data = self._request("POST", f"{self._sp}/calls", json=fn.submit_body(inputs))
        return _one_or_tuple(self._output_vars(fn, data))

    def variable(self, value: str | None = None, name: str | None = None) -> SemanticVariable:
        """Create a variable, ready if ``value`` is given, else to be :meth:`~SemanticVariable.set`."""
        self._require_open()
        body = _create_body(value, name)
        if self._batch is not None:
            var = SemanticVariable(self, name=name)
            self._batch.variable(var, body)
            return var
        data = self._request("POST", f"{self._sp}/variables", json=body)
        info = _parse(VariableInfo, data, "variable creation")
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
        backoff = _BACKOFF_START
        while True:
            wait = (
                POLL_MAX_WAIT
                if deadline is None
                else max(0.0, min(POLL_MAX_WAIT, deadline - time.monotonic()))
            )
            started = time.monotonic()
            params = {"wait": _fmt_wait(wait), "criteria": criteria}
            data = self._request("GET", self._vp(var), params=params, read=self.timeout + wait)
            if self._settle(var, data):
                return var._value  # type: ignore[return-value]
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise self._timeout_error(var, timeout)
            if now - started < wait / 2:  # the manager answered early: do not spin
                time.sleep(backoff if deadline is None else min(backoff, max(0.0, deadline - now)))
                backoff = min(backoff * 2, _BACKOFF_MAX)

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
                    _raise_for_status(response)
                streamed = _StreamedText(var)
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


# -------------------------------------------------------------------- async
class _Job:
    """One queued request of an async session; ``done`` is set once it was
    answered (or abandoned), ``error`` holds why it failed."""

    __slots__ = ("done", "error", "opens")

    def __init__(self) -> None:
        self.done = asyncio.Event()
        self.error: ParrotError | None = None
        self.opens = False  # a batch that creates the (deferred) session itself


class AsyncSession(_Base):
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
        self._queue: asyncio.Queue[tuple[_Job, Callable[[], Coroutine[Any, Any, None]]] | None] | None = None
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

    async def _create(self, batch: _Batch | None = None) -> None:
        """``POST /v1/sessions`` (carrying ``batch``, whose ids it settles)."""
        body = None if batch is None else {"batch": batch.body()}
        data = await self._request("POST", "/v1/sessions", json=body)
        created = _parse(SessionCreated, data, "session creation")
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
        job = _Job()
        queue = self._queue
        if queue is None:
            raise NoSession(f"session to {self.url} is not open")

        async def nothing() -> None:
            return None

        queue.put_nowait((job, nothing))
        await job.done.wait()

    async def __aenter__(self) -> AsyncSession:
        await self.open()
        self._ctx.append(_CURRENT.set(self))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._ctx:
            _CURRENT.reset(self._ctx.pop())
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
        _raise_for_status(response)
        return _decode(response, f"{method} {path}")

    # -------------------------------------------------------------- queue
    def _enqueue(self, make: Callable[[_Job], Coroutine[Any, Any, None]], job: _Job | None = None) -> _Job:
        self._require_open()
        if self._queue is None:
            raise NoSession(f"session to {self.url} is not open")
        job = job if job is not None else _Job()
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
        job: _Job | None = var._pending
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
    async def batch(self) -> AsyncIterator[None]:
        """Record the block's calls, :meth:`variable` creations and ``await var.aset()``
        and send them at its end as one request (queued after everything
        submitted before), applied all or none; the exit waits for the answer.

        Variables created in the block get their ids at its end; reading one
        inside the block raises :class:`BadRequest`.  A rejected batch raises
        here (its message names the op), as does the ``aget`` of every
        variable it created; if the block raises, nothing is sent.  While the
        block records, every operation on this session, from any task, goes
        into the batch.
        """
        job = _Job()
        batch = self._start_batch(job)
        try:
            yield
        except BaseException:
            _abandon(
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
            _abandon(batch, job, error)
            raise
        await job.done.wait()
        if job.error is not None:
            self._observed.append(job.error)
            raise job.error

    async def _send_batch(self, batch: _Batch) -> None:
        try:
            for var in batch.outside:
                if var.id is None:  # queued earlier, so already answered; its failure fails the batch
                    await self._await_id(var, None, None, observe=False)
            if self.session_id is None:  # a deferred open: the session comes with the batch
                await self._create(batch)
                return
            batch.settle(await self._request("POST", f"{self._sp}/batch", json=batch.body()))
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
            return _one_or_tuple(outputs)

        async def submit(job: _Job) -> None:
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
        return _one_or_tuple(outputs)

    def variable(self, value: str | None = None, name: str | None = None) -> SemanticVariable:
        """Queue the creation of a variable (or record it in a batch); returns it at once (id pending)."""
        body = _create_body(value, name)
        var = SemanticVariable(self, name=name)
        if self._batch is not None:
            self._require_open()
            self._batch.variable(var, body)
            return var

        async def create(job: _Job) -> None:
            data = await self._request("POST", f"{self._sp}/variables", json=body)
            var._id = _parse(VariableInfo, data, "variable creation").var_id

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
        backoff = _BACKOFF_START
        while True:
            wait = (
                POLL_MAX_WAIT
                if deadline is None
                else max(0.0, min(POLL_MAX_WAIT, deadline - time.monotonic()))
            )
            started = time.monotonic()
            params = {"wait": _fmt_wait(wait), "criteria": criteria}
            data = await self._request("GET", self._vp(var), params=params, read=self.timeout + wait)
            if self._settle(var, data):
                return var._value  # type: ignore[return-value]
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise self._timeout_error(var, timeout)
            if now - started < wait / 2:
                await asyncio.sleep(backoff if deadline is None else min(backoff, max(0.0, deadline - now)))
                backoff = min(backoff * 2, _BACKOFF_MAX)

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
                    _raise_for_status(response)
                streamed = _StreamedText(var)
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


class _Event(NamedTuple):
    """One line of a variable's stream: a text delta, a restart, or the end (with the value)."""

    text: str = ""
    restart: bool = False
    done: bool = False
    value: str | None = None


class _StreamedText:
    """What ``stream()`` has yielded of a variable, kept a prefix of the text the producer
    is generating.

    When the producing call is re-run on another engine the server sends
    ``{"restart": true}`` and streams the new run's text from its start.  What the
    new run repeats of the text already yielded is not yielded again; the rest
    is.  So the pieces ``stream()`` yields always join to the text of the run that
    made the value (the value itself, unless the output has a transform), or, if
    the new run wrote something else where the old one had been yielded, the
    stream raises (``stream_restarted``) instead of yielding text the value will
    not have (``get()`` then reads the value)."""

    def __init__(self, var: SemanticVariable) -> None:
        self.var = var
        self.yielded = ""  # joined pieces given to the caller
        self.current: list[str] = []  # deltas of the run being streamed, since its start
        self.restarted = False

    def take(self, event: _Event) -> str:
        """The text to yield for ``event`` (possibly empty)."""
        if event.restart:
            self.current, self.restarted = [], True
            return ""
        if event.done:  # after a restart the new run may not have reached what was yielded yet
            return self._advance("".join(self.current)) if self.restarted else ""
        if not event.text:
            return ""
        self.current.append(event.text)
        if not self.restarted:  # one run: every delta extends what was yielded
            self.yielded += event.text
            return event.text
        return self._advance("".join(self.current))

    def _advance(self, text: str) -> str:
        known = self.yielded
        if len(text) <= len(known):
            if not known.startswith(text):
                raise self._diverged()
            return ""
        if not text.startswith(known):
            raise self._diverged()
        self.yielded = text
        return text[len(known) :]

    def _diverged(self) -> ParrotError:
        label = self.var.name or self.var.id
        return ParrotError(
            f"stream of variable {label}: its call was re-run on another engine and wrote other text "
            f"than the {len(self.yielded)} characters already streamed; get() returns its value",
            code="stream_restarted",
        )


def _abandon(batch: _Batch, job: _Job, error: ParrotError) -> None:
    """An async batch that will never be sent: its variables raise ``error``."""
    job.error = error
    batch.fail(error)
    job.done.set()


def _create_body(value: Any, name: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if name is not None:
        if not isinstance(name, str):
            raise BadRequest(f"variable name must be a string, got {type(name).__name__}")
        body["name"] = name
    if value is not None:
        body["value"] = check_value(value, "variable value")
    return body


# ------------------------------------------------------------------ openers
def connect(
    url: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    transport: httpx.BaseTransport | None = None,
    api_key: str | None = None,
) -> Session:
    """A synchronous session to the manager at ``url``; opened by ``with`` (or :meth:`Session.open`).
    ``api_key``: for a manager with API keys (default: ``$PARROT_API_KEY``)."""
    return Session(url, timeout=timeout, transport=transport, api_key=api_key)


def aconnect(
    url: str,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    transport: httpx.AsyncBaseTransport | None = None,
    defer_open: bool = False,
    api_key: str | None = None,
) -> AsyncSession:
    """An asyncio session to the manager at ``url``; opened by ``async with`` (or ``await s.open()``).
    ``defer_open``: the manager session is created with the first request (see :class:`AsyncSession`).
    ``api_key``: for a manager with API keys (default: ``$PARROT_API_KEY``)."""
    return AsyncSession(url, timeout=timeout, transport=transport, defer_open=defer_open, api_key=api_key)

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
and its text starts over (``StreamedText`` keeps what ``stream()`` yields
consistent).

Invariants: one HTTP request per semantic-function call, sent in program order
(the async session sends from one background task, in queue order), except
inside a ``session.batch()`` block, whose calls, variable creations and sets
are recorded and sent at its end as one request, applied all or none; a
non-2xx answer with an ``{"error": ...}`` body becomes the very error class
the server raised (:func:`~parrot.protocol.errors.error_from_body`); transport
failures become :class:`ConnectionFailed` or
:class:`~parrot.protocol.errors.Timeout`, naming the URL.

The parts: :mod:`~parrot.frontend.sync_session` and
:mod:`~parrot.frontend.async_session` (the two session kinds, over
:mod:`~parrot.frontend.session_base`), :mod:`~parrot.frontend.batching`
(``session.batch()``), :mod:`~parrot.frontend.streaming` (``stream()``),
:mod:`~parrot.frontend.wire` (limits, errors, decoding).
"""

from __future__ import annotations

import httpx

from parrot.frontend.async_session import AsyncSession
from parrot.frontend.session_base import current_session
from parrot.frontend.sync_session import Session
from parrot.frontend.wire import DEFAULT_TIMEOUT, ConnectionFailed, NoSession

__all__ = [
    "DEFAULT_TIMEOUT",
    "AsyncSession",
    "ConnectionFailed",
    "NoSession",
    "Session",
    "aconnect",
    "connect",
    "current_session",
]


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

"""Semantic variables as seen by a client: futures of values held by the manager.

A :class:`SemanticVariable` is a handle, not a value.  Passing it into a
semantic function wires a server-side dependency; only :meth:`get`,
:meth:`aget`, :meth:`stream` and :meth:`astream` fetch anything.

Invariants: a variable belongs to exactly one session for its whole life;
its ``id`` is assigned once (at creation in a sync session, when the manager
answers the submission in an async session, at the end of the
``session.batch()`` block that created it) and never changes; once a value
or a failure has been observed it is cached and never fetched again (values
are final in Parrot).  All I/O is delegated to the owning session, so this
module does no networking of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Literal

from parrot.protocol.errors import BadRequest, ParrotError

if TYPE_CHECKING:
    from parrot.frontend.client import AsyncSession, Session

Criteria = Literal["LATENCY", "THROUGHPUT"]
LATENCY: Criteria = "LATENCY"
"""Fetch hint: the caller waits on this value; schedule its producers for low latency."""
THROUGHPUT: Criteria = "THROUGHPUT"
"""Fetch hint: the caller only needs the value eventually; favour batching."""
CRITERIA: tuple[Criteria, ...] = (LATENCY, THROUGHPUT)


def check_criteria(criteria: Any) -> Criteria:
    """Normalise a criteria hint to its upper-case wire form; raises :class:`BadRequest`."""
    if isinstance(criteria, str) and criteria.upper() in CRITERIA:
        return criteria.upper()  # type: ignore[return-value]
    raise BadRequest(f"criteria must be one of {list(CRITERIA)}, got {criteria!r}", code="invalid_criteria")


class SemanticVariable:
    """A future for one string value held by the manager.

    ``id`` is ``None`` only while an async session has not yet heard back
    from the manager about the request that creates the variable, or while
    the batch that creates it is being recorded (or was rejected).
    """

    __slots__ = ("_error", "_has_value", "_id", "_pending", "_session", "_value", "name")

    def __init__(
        self, session: Session | AsyncSession, *, name: str | None = None, var_id: str | None = None
    ):
        self._session = session
        self.name = name
        self._id = var_id
        self._value: str | None = None
        self._has_value = False
        self._error: ParrotError | None = None
        self._pending: Any = None  # async sessions: the queued request that assigns ``id``

    # ------------------------------------------------------------ identity
    @property
    def id(self) -> str | None:
        """The manager's variable id; ``None`` until known (async sessions and batches only)."""
        return self._id

    @property
    def session(self) -> Session | AsyncSession:
        return self._session

    @property
    def is_ready(self) -> bool:
        """Whether the value is known locally (no request needed to get it)."""
        return self._has_value

    def __repr__(self) -> str:
        state = "ready" if self._has_value else "failed" if self._error is not None else "unfetched"
        return f"SemanticVariable(name={self.name!r}, id={self._id!r}, {state})"

    # ----------------------------------------------------------- fetching
    def get(self, criteria: Criteria = LATENCY, timeout: float | None = None) -> str:
        """Block until the value is ready and return it.

        Raises :class:`~parrot.protocol.errors.Timeout` after ``timeout``
        seconds (``None``: wait for ever) and the producing call's error
        (e.g. :class:`~parrot.protocol.errors.CallFailed`) if it failed.
        """
        return self._session._get_variable(self, check_criteria(criteria), timeout)

    async def aget(self, criteria: Criteria = LATENCY, timeout: float | None = None) -> str:
        """:meth:`get` for ``asyncio`` code; never blocks the event loop."""
        return await self._session._aget_variable(self, check_criteria(criteria), timeout)

    def stream(self, criteria: Criteria = LATENCY, timeout: float | None = None) -> Iterator[str]:
        """Iterate over text deltas as the value is generated; raises if it fails.

        ``criteria`` tells the manager how the value is wanted, as :meth:`get`'s does.
        ``timeout`` bounds the silence between two chunks (``None``: no limit).
        The deltas are the raw generated text; an output transform applies to
        the final value only, which :meth:`get` returns.
        """
        return self._session._stream_variable(self, check_criteria(criteria), timeout)

    def astream(self, criteria: Criteria = LATENCY, timeout: float | None = None) -> AsyncIterator[str]:
        """:meth:`stream` for ``asyncio`` code: ``async for delta in var.astream(): ...``."""
        return self._session._astream_variable(self, check_criteria(criteria), timeout)

    # ------------------------------------------------------------ setting
    def set(self, value: str) -> None:
        """Give a variable created with :meth:`Session.variable` its value (once)."""
        self._session._set_variable(self, check_value(value, "value"))

    async def aset(self, value: str) -> None:
        """:meth:`set` for ``asyncio`` code."""
        await self._session._aset_variable(self, check_value(value, "value"))

    # ---------------------------------------------- session-side bookkeeping
    def _resolve(self, value: str) -> None:
        self._value = value
        self._has_value = True

    def _fail(self, error: ParrotError) -> None:
        self._error = error


def check_value(value: Any, what: str, *, variable_ok: bool = False) -> str:
    """A constant for the wire: ``str`` as is, ``int``/``float`` via ``str()``.

    Anything else (including ``bool`` and ``None``) raises :class:`BadRequest`.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    kinds = "a str or a SemanticVariable" if variable_ok else "a str"
    raise BadRequest(f"{what} must be {kinds} (int and float are converted), got {type(value).__name__}")

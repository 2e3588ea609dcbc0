"""The order in which the executor's queued calls are offered to the scheduler.

A queued call's *rank* (lower goes first) is made of two parts:

* **Its place among its tenant's calls.**  With program-level scheduling
  (``by_service``; ``parrot serve --program-scheduling``) a call ranks first by
  its application's *service level*, then as under app-FIFO.  An application's
  attained service is the estimated tokens (prompt and output) of its calls that
  ended so far; its level is how many of the thresholds
  :data:`SERVICE_LEVEL_TOKENS` times 1, 4, 16, ... it has passed (least attained
  service, discretised as Autellix's PLAS, arXiv 2502.13965).  So a new chat, or
  a chain's first step, goes ahead of a map-reduce whose earlier maps already
  ran, and among applications of one level the one that came first goes first
  (app-FIFO, which finishes them one after another instead of slowing all of
  them down together).  A long application is delayed only while work of
  shorter ones is queued.  With application-level
  FIFO alone (the paper's app-FIFO) a call ranks by its *application's* place in
  the queue: a session takes its place when a call of it is queued while none
  of its calls is queued or placed, and keeps it while any is, so a chain's
  next step, which becomes ready inside the server while its producer is still
  placed, does not wait behind applications that arrived later.  A session
  whose work all ended gives its place up, so a long-lived session does not
  stay ahead of later ones for ever.  Calls of one session rank by submission
  order (a queued call's producers are all done, so this is also producers
  first).  Each ``/v1/completions`` request is a session of its own, so
  request-level clients get plain FIFO.  Without app-FIFO (``fifo_by_app``
  False: the option off, or a request-level baseline policy) a call ranks by
  when it was queued.
* **Its tenant's turn** (start-time fair queuing, one unit per call): while
  calls of several tenants (:mod:`parrot.manager.tenants`) are queued, a
  tenant's k-th queued call's turn is k after the tenant's virtual finish time
  (or the current virtual time, if later: an idle tenant gains no credit).
  Placing a call advances its tenant's finish time by one and the virtual time
  to the call's turn.  So a tenant with a thousand calls queued delays another
  tenant's single call by about one call, not a thousand.

Pure bookkeeping: no I/O, no asyncio.
"""

from __future__ import annotations

from collections.abc import Iterable

from parrot.manager.dag.graph import Call
from parrot.protocol.schemas import ENGINE_PRIORITY_MAX

__all__ = ["SERVICE_LEVEL_TOKENS", "QueueOrder", "service_level"]

_ORDER_BITS = 64  # an app-FIFO rank is (application's place << _ORDER_BITS) | the call's own order
_TURN_SHIFT = 192  # a rank is (tenant's turn << _TURN_SHIFT) | the call's rank within its tenant
_LEVEL_SHIFT = 128  # a program-level rank is (level << _LEVEL_SHIFT) | the app-FIFO rank (< 2**128)
_PRIORITY_SHIFT = 40  # an engine priority is (level << _PRIORITY_SHIFT) | the place (at most 2**40 - 1)
_MAX_LEVEL = (ENGINE_PRIORITY_MAX >> _PRIORITY_SHIFT) - 1
SERVICE_LEVEL_TOKENS = 512
"""The first service level's threshold in tokens; each next one is four times the last
(512, 2,048, 8,192, ...): a ShareGPT-like chat stays at level 0, a map-reduce of a dozen
maps passes two thresholds as its maps end."""
_TENANTS_REMEMBERED = 1024  # past this many, tenants owing nothing are forgotten


def service_level(attained_tokens: int) -> int:
    """How many service thresholds (:data:`SERVICE_LEVEL_TOKENS`, then x4 each) an
    application with ``attained_tokens`` of service has passed."""
    level, threshold = 0, SERVICE_LEVEL_TOKENS
    while attained_tokens >= threshold and level < _MAX_LEVEL:
        level, threshold = level + 1, threshold * 4
    return level


class QueueOrder:
    """Application places, their attained service, and tenants' turns.  Calls are named by
    ``(call, arrival)``: ``arrival`` is the executor's count of queueings when the call was
    first queued.  ``by_service``: program-level scheduling (ranks start with the
    application's service level)."""

    def __init__(self, by_service: bool = False) -> None:
        self.by_service = by_service
        # session id -> estimated tokens of its calls that ended (kept while it is active)
        self.attained: dict[str, int] = {}
        # session id -> its place in the queue (the arrival of its first call queued since
        # none of its calls was queued or placed), and how many of its calls are
        self.app_ranks: dict[str, int] = {}
        self.app_active: dict[str, int] = {}
        # call id -> its turn (with several tenants queued), each tenant's virtual finish
        # time and the virtual time (in calls placed)
        self.turns: dict[str, int] = {}
        self.tenant_finish: dict[str, int] = {}
        self.virtual_time = 0

    # ------------------------------------------------------ applications
    def enter(self, call: Call, arrival: int) -> None:
        """A call was queued for the first time: with nothing of its application in
        flight, the application takes its place now."""
        sid = call.session_id
        active = self.app_active.get(sid, 0)
        if not active:
            self.app_ranks[sid] = arrival
        self.app_active[sid] = active + 1

    def leave(self, call: Call) -> None:
        """A call left the executor for good (ended, failed or cancelled, queued or
        placed): once none of its application's calls is queued or placed, the
        application gives up its place and its attained service (its next call starts a
        new application: a session that a client drives turn by turn is not held back
        for ever by its earlier turns)."""
        sid = call.session_id
        active = self.app_active.get(sid, 0) - 1
        if active > 0:
            self.app_active[sid] = active
        else:
            self.app_active.pop(sid, None)
            self.app_ranks.pop(sid, None)
            self.attained.pop(sid, None)

    def forget_session(self, session_id: str) -> None:
        """The session was closed: drop its place and its service."""
        self.app_ranks.pop(session_id, None)
        self.app_active.pop(session_id, None)
        self.attained.pop(session_id, None)

    def level(self, call: Call, fifo_by_app: bool) -> int:
        """The service level of ``call``'s application (0 without program-level scheduling,
        or for request-level ranking, where each request is its own application)."""
        if not (self.by_service and fifo_by_app):
            return 0
        return service_level(self.attained.get(call.session_id, 0))

    # ------------------------------------------------------------- ranks
    def own_rank(self, call: Call, arrival: int, fifo_by_app: bool) -> int:
        """A call's place among its own tenant's queued calls."""
        if not fifo_by_app:
            return arrival
        app = self.app_ranks.get(call.session_id, arrival)
        return (self.level(call, fifo_by_app) << _LEVEL_SHIFT) | (app << _ORDER_BITS) | call.seq

    def rank(self, call: Call, arrival: int, fifo_by_app: bool) -> int:
        """A queued call's place in the queue: its tenant's turn, then its own rank."""
        turn = self.turns.get(call.call_id, 0) << _TURN_SHIFT
        return turn | self.own_rank(call, arrival, fifo_by_app)

    def engine_priority(self, call: Call, arrival: int, fifo_by_app: bool) -> int:
        """The priority a placed call's fills and generations carry to an engine that orders
        its own queue by it (lower first; :meth:`parrot.protocol.engine_api.EngineAPI.generate`):
        its application's service level (:meth:`level`, taken when the call is placed), then
        the application's place (its own arrival without app-FIFO), within 63 bits (vLLM's
        int64).  So a chain's next call keeps its application's place, ahead of applications
        that came later, and an application with less service goes ahead of one with more.
        Tenants' turns are not in it: they order what the manager dispatches, and what it
        has dispatched the engine orders by application."""
        place = self.app_ranks.get(call.session_id, arrival) if fifo_by_app else arrival
        place = min(place, (1 << _PRIORITY_SHIFT) - 1)
        return (self.level(call, fifo_by_app) << _PRIORITY_SHIFT) | place

    # ----------------------------------------------------------- tenants
    def share(self, queued: Iterable[tuple[Call, int]], fifo_by_app: bool) -> None:
        """Give the queued calls their tenant's turns.  With one tenant queued,
        nothing: its own order stands.  O(queue log queue) with several."""
        by_tenant: dict[str, list[tuple[Call, int]]] = {}
        for entry in queued:
            by_tenant.setdefault(entry[0].tenant, []).append(entry)
        if len(by_tenant) < 2:
            self.turns = {}
            return
        turns: dict[str, int] = {}
        for tenant, entries in by_tenant.items():
            entries.sort(key=lambda e: self.own_rank(e[0], e[1], fifo_by_app))
            start = max(self.tenant_finish.get(tenant, 0), self.virtual_time)
            for k, (call, _) in enumerate(entries):
                turns[call.call_id] = start + k
        self.turns = turns

    def attain(self, call: Call, tokens: int) -> None:
        """A call of ``tokens`` estimated tokens ended: its application's attained service
        grows by them.  (Counted when a call ends, not when it is placed, so the calls an
        application has running together, a map-reduce's maps, share one level and run as a
        group instead of its later maps falling behind everyone else's work.)"""
        sid = call.session_id
        if sid in self.app_active:
            self.attained[sid] = self.attained.get(sid, 0) + tokens

    def served(self, call: Call) -> None:
        """A call was placed: its tenant's next call starts one unit later in virtual time,
        which moves to this call's start (so a tenant that was idle gains no credit)."""
        tenant = call.tenant
        start = max(self.tenant_finish.get(tenant, 0), self.virtual_time)
        self.tenant_finish[tenant] = start + 1
        self.virtual_time = start
        if len(self.tenant_finish) > _TENANTS_REMEMBERED:  # those at or behind now owe nothing
            now = self.virtual_time
            self.tenant_finish = {t: f for t, f in self.tenant_finish.items() if f > now}

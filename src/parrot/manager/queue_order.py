"""The order in which the executor's queued calls are offered to the scheduler.

A queued call's *rank* (lower goes first) is made of two parts:

* **Its place among its tenant's calls.**  With application-level FIFO (the
  paper's app-FIFO, the default) a call ranks by its *application's* place in
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

from parrot.manager.graph import Call

__all__ = ["QueueOrder"]

_ORDER_BITS = 64  # an app-FIFO rank is (application's place << _ORDER_BITS) | the call's own order
_TURN_SHIFT = 192  # a rank is (tenant's turn << _TURN_SHIFT) | the call's rank within its tenant
_PRIORITY_MAX = (1 << 63) - 1  # an engine priority fits a signed 64-bit integer
_TENANTS_REMEMBERED = 1024  # past this many, tenants owing nothing are forgotten


class QueueOrder:
    """Application places and tenants' turns.  Calls are named by ``(call, arrival)``:
    ``arrival`` is the executor's count of queueings when the call was first queued."""

    def __init__(self) -> None:
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
        application gives up its place."""
        sid = call.session_id
        active = self.app_active.get(sid, 0) - 1
        if active > 0:
            self.app_active[sid] = active
        else:
            self.app_active.pop(sid, None)
            self.app_ranks.pop(sid, None)

    def forget_session(self, session_id: str) -> None:
        """The session was closed: drop its place."""
        self.app_ranks.pop(session_id, None)
        self.app_active.pop(session_id, None)

    # ------------------------------------------------------------- ranks
    def own_rank(self, call: Call, arrival: int, fifo_by_app: bool) -> int:
        """A call's place among its own tenant's queued calls."""
        if not fifo_by_app:
            return arrival
        app = self.app_ranks.get(call.session_id, arrival)
        return (app << _ORDER_BITS) | call.seq

    def rank(self, call: Call, arrival: int, fifo_by_app: bool) -> int:
        """A queued call's place in the queue: its tenant's turn, then its own rank."""
        turn = self.turns.get(call.call_id, 0) << _TURN_SHIFT
        return turn | self.own_rank(call, arrival, fifo_by_app)

    def engine_priority(self, call: Call, arrival: int, fifo_by_app: bool) -> int:
        """The priority a placed call's generations carry to an engine that orders its own
        queue by it (lower first; :meth:`parrot.protocol.engine_api.EngineAPI.generate`):
        its application's place (its own arrival without app-FIFO), clamped to 63 bits
        (vLLM's int64).  Calls of one application share it, so a chain's next call keeps
        its application's place, ahead of applications that came later.  Tenants' turns
        are not in it: they order what the manager dispatches, and what it has dispatched
        the engine orders by application."""
        place = self.app_ranks.get(call.session_id, arrival) if fifo_by_app else arrival
        return min(place, _PRIORITY_MAX)

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

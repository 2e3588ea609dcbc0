"""Runs calls as soon as their inputs exist, entirely inside the server.

A call that becomes ready joins the executor's queue.  A scheduling round
(run on every event that may change a decision — a call ready or finished,
an engine joining, a session gaining a call or a criterion — and on a short
tick while calls wait) deduces each
session's objectives from its DAG (:mod:`parrot.manager.objectives`; only
sessions that changed are deduced again), snapshots the engines, and asks the
scheduler (:mod:`parrot.manager.scheduler`, the paper's Algorithm 1) where
queued calls go.  The scheduler's engine state is kept between rounds
(:class:`~parrot.manager.scheduler.Scheduler`): only engines whose load,
recent prefixes or pool state changed get a new snapshot, and the placements
are those of the pure ``schedule(queue, snapshots, config)``.  A placed call's
prefix keys are recorded for its engine, so later calls sharing a prefix go
where the engine's prefix cache holds it.  A placed call renders its prompt
from the materialised inputs and drives its engine in a context of its own:
fill the text before each output (the engine reuses any cached prefix of it),
generate the output (streaming it into the variable), apply the output's
transform, materialise it — which may make consumer calls ready.  No value
travels to the client on the way.

Queue order.  The scheduler takes queued calls in rank order.  With
application-level FIFO (``app_fifo``, the default) a call ranks by its
*application's* place in the queue: a session takes its place when a call of
it is queued while none of its calls is queued or placed, and keeps it while
any is — a chain's next step, which becomes ready inside the server while its
producer is still placed, does not wait behind applications that arrived
later.  A session whose work all ended gives its place up, so a long-lived
session does not stay ahead of later ones for ever.  Calls of one session rank by submission
order (a queued call's producers are all done, so this is also producers
first).  Each ``/v1/completions`` request is a session of its own, so
request-level clients get plain FIFO.  Without app-FIFO, and always under
the request-level baseline policies, a call ranks by when it was queued.

Between tenants the queue takes turns (start-time fair queuing, one unit per
call): while calls of several tenants (:mod:`parrot.manager.tenants`) are
queued, each tenant's calls are ordered as above among themselves, and its
k-th queued call's turn is k after the tenant's virtual finish time (or the
current virtual time, if later: an idle tenant gains no credit).  Placing a
call advances its tenant's finish time by one and the virtual time to the
call's turn.  Lower turns go first, so a tenant with a thousand calls queued
delays another tenant's single call by about one call, not a thousand.

Guarantees: every call ends ``done`` or ``failed``; an unexpected error
while one queued call is scheduled fails that call alone (rounds go on); a
failure fails the call's outputs and everything downstream; a call no engine
can ever serve fails at once, one that waits longer than ``queue_timeout_s``
fails with a timeout; a call whose engine is lost before any of its outputs
materialised is queued again and re-run elsewhere (waiting up to
``engine_wait_s`` for an engine); the engine context of a call is freed
however the call ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from parrot.manager.engines import EngineHandle, EnginePool
from parrot.manager.graph import Call, fail_call, materialise
from parrot.manager.objectives import CallObjective, deduce
from parrot.manager.prefix import PrefixIndex, prefix_keys
from parrot.manager.render import FillStep, Rendered, render
from parrot.manager.scheduler import (
    DEFAULT_LATENCY_CAP_TOKENS,
    EngineSnapshot,
    QueuedCall,
    Scheduler,
    SchedulerConfig,
)
from parrot.manager.tokens import INLINE_TOKENIZE_BYTES, NeedsTokenizing, TokenSource
from parrot.protocol.errors import (
    CallFailed,
    ContextTooLong,
    EngineError,
    NoEngine,
    NotFound,
    ParrotError,
    Timeout,
)

log = logging.getLogger(__name__)

TICK_S = 0.1
_ORDER_BITS = 64  # an app-FIFO rank is (application's place << _ORDER_BITS) | the call's own order
_TURN_SHIFT = 192  # a rank is (tenant's turn << _TURN_SHIFT) | the call's rank within its tenant
_TENANTS_REMEMBERED = 1024  # past this many, tenants owing nothing are forgotten
MIN_ROUND_GAP_S = 0.0005
_LATENCY_DEFAULT = CallObjective("latency", reason="not deduced yet")
# Stamps of placements (EngineSnapshot.last_assigned): increasing in placement order, process-wide.
_assignments = itertools.count(1)


class _EngineLost(str):
    """Cancellation message marking a call whose engine was dropped."""


@dataclass
class _Usage:
    """Manager-side load of one engine: what the calls placed there will hold."""

    load: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # objective -> running calls
    groups: dict[str, int] = field(default_factory=dict)  # task group -> running calls
    prefixes: dict[str, int] = field(default_factory=dict)  # shared prefix key -> running calls
    group_set: frozenset[str] = frozenset()  # the keys of ``groups``, rebuilt when they change
    last_assigned: int = 0  # stamp of the last call placed there (0: none yet); ties go to the oldest

    @property
    def mode(self) -> str | None:
        if self.kinds.get("latency", 0) > 0:
            return "latency"
        return "throughput" if self.kinds.get("throughput", 0) > 0 else None


@dataclass(eq=False)
class _Ticket:
    """Executor-side state of one ready or running call."""

    call: Call
    arrival: int  # when it was first queued, in the executor's order of queueing
    queued_at: float = field(default_factory=time.monotonic)
    # Estimated KV tokens of its own: prompt + max new tokens, less ``shared_prefix``'s.
    tokens: int | None = None
    # (key, tokens) of its leading constant text when long enough to be shared (a system
    # prompt): an engine's load counts it once however many calls there fork from it.
    shared_prefix: tuple[str, int] | None = None
    rendered: dict[str, Rendered] = field(default_factory=dict)  # by model
    attempts: int = 0
    lost: str | None = None  # why the last engine was lost
    retry_deadline: float | None = None
    engine: EngineHandle | None = None
    prefix_keys: tuple[str, ...] = ()
    started: bool = False  # its task began running (a task cancelled before that never runs at all)
    queued: QueuedCall | None = None  # what the last round saw (reused while nothing changes)
    # long text of its prompt, tokenized off the loop before a round renders it
    token_source: TokenSource | None = None
    tokenizing: asyncio.Task[None] | None = None  # while that runs, rounds pass the call over


class Executor:
    def __init__(
        self,
        pool: EnginePool,
        prefixes: PrefixIndex | None = None,
        *,
        calls_of_session: Callable[[str], Iterable[Call]] | None = None,
        scheduler: SchedulerConfig | None = None,
        engine_token_capacity: int = 32768,
        min_prefix_tokens: int = 32,
        max_attempts: int = 3,
        engine_wait_s: float = 30.0,
        queue_timeout_s: float | None = 600.0,
        app_fifo: bool = True,
        inline_tokenize_bytes: int | None = INLINE_TOKENIZE_BYTES,
    ):
        self.pool = pool
        self.prefixes = prefixes or PrefixIndex()
        self.scheduler = scheduler or SchedulerConfig()
        self.engine_token_capacity = engine_token_capacity
        self.min_prefix_tokens = min_prefix_tokens
        self.max_attempts = max_attempts
        self.engine_wait_s = engine_wait_s
        self.queue_timeout_s = queue_timeout_s
        self.app_fifo = app_fifo
        self.inline_tokenize_bytes = inline_tokenize_bytes
        self._calls_of_session = calls_of_session
        self._queue: dict[str, _Ticket] = {}
        self._placed: dict[str, _Ticket] = {}
        self._usage: dict[str, _Usage] = {}  # engine id -> load of the calls placed there
        # Scheduler state kept between rounds (the fast path of scheduler.schedule): it is told
        # of engines whose snapshot changed — their usage or prefixes (_stale), or what the pool
        # says of them (_seen: handle, alive, capacity, latency cap, as of the last round).
        self._sched: Scheduler | None = None
        self._pool_seen: list[tuple[EngineHandle, bool, int, int]] = []
        self._seen: dict[str, tuple[EngineHandle, bool, int, int]] = {}
        self._stale: set[str] = set()
        self._last_round = 0.0
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._tokenizing: set[asyncio.Task[None]] = set()  # prompts being tokenized off the loop
        self._arrivals = itertools.count()
        # session id -> its place in the queue (the arrival of its first call queued since
        # none of its calls was queued or placed), and how many of its calls are
        self._app_ranks: dict[str, int] = {}
        self._app_active: dict[str, int] = {}
        # fair queuing between tenants: call id -> its turn (with several tenants queued),
        # each tenant's virtual finish time and the virtual time (in calls placed)
        self._turns: dict[str, int] = {}
        self._tenant_finish: dict[str, int] = {}
        self._virtual_time = 0
        self._kicked = False
        self._ticker: asyncio.Task[None] | None = None
        # session id -> call id -> objective, for sessions whose graph did not change since
        self._objectives: dict[str, dict[str, CallObjective]] = {}
        self._dirty: set[str] = set()  # sessions whose DAG or criteria changed since deduction
        self.rounds = 0
        pool.on_drop(self._engine_dropped)

    def task(self, call_id: str) -> asyncio.Task[None] | None:
        """The task running a placed call, if any."""
        return self._tasks.get(call_id)

    # ----------------------------------------------------------- queueing
    def dispatch(self, call: Call) -> None:
        """Queue a ready call; a scheduling round places it."""
        if (
            call.call_id in self._queue
            or call.call_id in self._placed
            or call.state not in ("ready", "waiting")
        ):
            return
        call.state = "ready"
        keys = prefix_keys(call)  # final: every input is known
        arrival = next(self._arrivals)
        sid = call.session_id
        active = self._app_active.get(sid, 0)
        if not active:  # nothing of the application in flight: it takes its place now
            self._app_ranks[sid] = arrival
        self._app_active[sid] = active + 1
        self._queue[call.call_id] = _Ticket(call, arrival, prefix_keys=tuple(keys))
        self.kick()

    def forget_session(self, session_id: str) -> None:
        """The session was closed: drop its place in the application queue."""
        self._app_ranks.pop(session_id, None)
        self._app_active.pop(session_id, None)

    def _retire(self, call: Call) -> None:
        """A call left the executor for good (ended, failed or cancelled, queued or
        placed): once none of its application's calls is queued or placed, the
        application gives up its place in the queue."""
        sid = call.session_id
        active = self._app_active.get(sid, 0) - 1
        if active > 0:
            self._app_active[sid] = active
        else:
            self._app_active.pop(sid, None)
            self._app_ranks.pop(sid, None)

    def graph_changed(self, session_id: str) -> None:
        """A session gained a call or an output criterion: its objectives are deduced
        again in a round that runs at once when calls are queued, so they are re-ranked
        (their QueuedCall rebuilt with the new objective) before anything else is placed."""
        self._dirty.add(session_id)
        if self._queue:
            with contextlib.suppress(RuntimeError):  # no running loop: the next round does it
                self.kick()

    def kick(self) -> None:
        """Run a scheduling round soon (coalesced: one per loop iteration)."""
        if self._kicked:
            return
        self._kicked = True
        loop = asyncio.get_running_loop()
        # Under a burst of events, rounds run at most every MIN_ROUND_GAP_S so one
        # round places many calls; an idle manager schedules at once.
        wait = self._last_round + MIN_ROUND_GAP_S - time.monotonic()
        if wait > 0:
            loop.call_later(wait, self._round)
        else:
            loop.call_soon(self._round)
        if self._ticker is None or self._ticker.done():
            self._ticker = loop.create_task(self._tick())

    async def _tick(self) -> None:
        """While calls wait, re-run rounds: deadlines pass, engines come and go.  An
        unexpected error in a round is logged and the ticking goes on."""
        while self._queue:
            await asyncio.sleep(TICK_S)
            try:
                self._round()
            except Exception:
                log.exception("scheduling round failed")

    def cancel(self, call: Call, error: ParrotError) -> None:
        if self._queue.pop(call.call_id, None) is not None:
            self._retire(call)
        task = self._tasks.get(call.call_id)
        fail_call(call, error)
        if task is not None:
            task.cancel()
            self._cancelled_before_start(call.call_id, None)

    async def drain(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
        tasks = [*self._tasks.values(), *self._tokenizing]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _engine_dropped(self, handle: EngineHandle, reason: str) -> None:
        self.prefixes.forget_engine(handle.engine_id)
        self._usage.pop(handle.engine_id, None)
        self._stale.add(handle.engine_id)
        for ticket in list(self._placed.values()):
            task = self._tasks.get(ticket.call.call_id)
            if ticket.engine is handle and task is not None:
                lost = _EngineLost(f"engine {handle.engine_id} dropped: {reason}")
                task.cancel(lost)
                self._cancelled_before_start(ticket.call.call_id, str(lost))

    def _cancelled_before_start(self, call_id: str, lost: str | None) -> None:
        """A task cancelled before its first step never runs ``_run`` (not even its
        ``finally``): do its bookkeeping here, or the call would stay placed for ever."""
        ticket = self._placed.get(call_id)
        if ticket is not None and not ticket.started:
            self._finish(ticket, lost, kick=False)
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to schedule
                self.kick()

    # ------------------------------------------------------------- rounds
    def _round(self) -> None:
        self._kicked = False
        self.rounds += 1
        now = self._last_round = time.monotonic()
        for ticket in list(self._queue.values()):
            call = ticket.call
            if call.state != "ready":  # failed meanwhile (session closed, input failed)
                del self._queue[call.call_id]
                self._retire(call)
                self._forget_objective(call)
                call.rendered = None
            elif self.queue_timeout_s is not None and now - ticket.queued_at > self.queue_timeout_s:
                del self._queue[call.call_id]
                self._retire(call)
                fail_call(
                    call,
                    Timeout(f"call {call.call_id} waited more than {self.queue_timeout_s:g}s for an engine"),
                )
        if not self._queue:
            return
        self._deduce()
        self._share_between_tenants()
        queue: list[QueuedCall] = []
        for ticket in list(self._queue.values()):
            try:
                queued = self._queued(ticket)
            except Exception as exc:  # one call's bug must not stop the round
                self._fail_queued(ticket, exc)
            else:
                if queued is not None:
                    queue.append(queued)
        sched = self._sync_engines()
        failed = False
        for call_id, reason in sched.unservable(queue):
            ticket = self._queue[call_id]
            if ticket.retry_deadline is not None and now < ticket.retry_deadline:
                continue  # its engine was lost: wait a while for another one
            del self._queue[call_id]
            self._retire(ticket.call)
            failed = True
            why = f" lost its engine ({ticket.lost}) and" if ticket.lost else ""
            fail_call(ticket.call, NoEngine(f"call {call_id}{why} cannot be served: {reason}"))
        if failed:
            queue = [q for q in queue if q.call_id in self._queue]
        for placement in sched.schedule(queue):
            ticket = self._queue.pop(placement.call_id)
            ticket.engine = self.pool.get(placement.engine_id)
            self.prefixes.record(placement.engine_id, ticket.prefix_keys)
            ticket.call.placement = placement.reason
            ticket.call.dispatched_at = time.time()
            self._served(ticket.call)
            self._start(ticket)

    def _queued(self, ticket: _Ticket) -> QueuedCall | None:
        """What the scheduler sees of a queued call this round (reused while nothing changed);
        None while its prompt is being tokenized off the loop (it waits for a later round)."""
        call = ticket.call
        if ticket.tokenizing is not None:
            return None
        try:
            tokens = self._estimate(ticket)
        except NeedsTokenizing:
            self._tokenize_ahead(ticket)
            return None
        objective = self._objectives[call.session_id].get(call.call_id, _LATENCY_DEFAULT)
        call.objective, call.task_group = objective.kind, objective.task_group
        rank = self._rank(ticket)
        queued = ticket.queued
        if (
            queued is None
            or queued.objective is not objective
            or queued.tokens != tokens
            or queued.topo_rank != rank
        ):
            queued = ticket.queued = QueuedCall(
                call.call_id, call.model, objective, ticket.prefix_keys, tokens, rank
            )
        return queued

    def _rank(self, ticket: _Ticket) -> int:
        """A queued call's place in the queue (see the module docstring): its tenant's
        turn, then its arrival (request-level FIFO) or its application's place and its
        submission order."""
        turn = self._turns.get(ticket.call.call_id, 0) << _TURN_SHIFT
        return turn | self._own_rank(ticket)

    def _own_rank(self, ticket: _Ticket) -> int:
        """A call's place among its own tenant's queued calls."""
        if not self.app_fifo or self.scheduler.policy in ("baseline-latency", "baseline-throughput"):
            return ticket.arrival
        call = ticket.call
        app = self._app_ranks.get(call.session_id, ticket.arrival)
        return (app << _ORDER_BITS) | call.seq

    def _share_between_tenants(self) -> None:
        """Give queued calls their tenant's turns (start-time fair queuing, one unit per
        call; see the module docstring).  With one tenant queued, nothing: its own order
        stands.  O(queue log queue) with several."""
        by_tenant: dict[str, list[_Ticket]] = {}
        for ticket in self._queue.values():
            by_tenant.setdefault(ticket.call.tenant, []).append(ticket)
        if len(by_tenant) < 2:
            self._turns = {}
            return
        turns: dict[str, int] = {}
        for tenant, tickets in by_tenant.items():
            tickets.sort(key=self._own_rank)
            start = max(self._tenant_finish.get(tenant, 0), self._virtual_time)
            for k, ticket in enumerate(tickets):
                turns[ticket.call.call_id] = start + k
        self._turns = turns

    def _served(self, call: Call) -> None:
        """A call was placed: its tenant's next call starts one unit later in virtual time,
        which moves to this call's start (so a tenant that was idle gains no credit)."""
        tenant = call.tenant
        start = max(self._tenant_finish.get(tenant, 0), self._virtual_time)
        self._tenant_finish[tenant] = start + 1
        self._virtual_time = start
        if len(self._tenant_finish) > _TENANTS_REMEMBERED:  # those at or behind now owe nothing
            now = self._virtual_time
            self._tenant_finish = {t: f for t, f in self._tenant_finish.items() if f > now}

    def _fail_queued(self, ticket: _Ticket, exc: Exception) -> None:
        """Take a call out of the queue and fail it: with ``exc`` itself if it is a
        ParrotError (a call that cannot be served), else with a CallFailed naming the
        call and the unexpected exception (a bug, logged with its traceback)."""
        call = ticket.call
        if self._queue.pop(call.call_id, None) is not None:
            self._retire(call)
        self._forget_objective(call)
        call.rendered = None
        if isinstance(exc, ParrotError):
            error = exc
        else:
            log.error("call %s could not be scheduled", call.call_id, exc_info=exc)
            error = CallFailed(
                f"call {call.call_id} failed while being scheduled: internal error {exc!r}",
                detail={"call_id": call.call_id, "exception": repr(exc)},
            )
        fail_call(call, error)

    def _deduce(self) -> None:
        """Deduce the objectives of every queued call.  Deduction runs per session
        over its unfinished calls, only for sessions with a queued call that were
        changed since (or never deduced); other sessions keep their results.  A
        changed session without queued calls only loses its results: it is deduced
        again when one of its calls is queued."""
        dirty = self._dirty
        known = self._objectives
        stale: set[str] = set()
        for t in self._queue.values():
            call = t.call
            sid = call.session_id
            if sid in dirty or call.call_id not in known.get(sid, ()):
                stale.add(sid)
        for sid in dirty:
            if sid not in stale:
                known.pop(sid, None)
        dirty.clear()
        for sid in stale:
            known[sid] = self._deduce_session(sid)

    def _deduce_session(self, sid: str) -> dict[str, CallObjective]:
        """Objectives of a session's unfinished calls; should deduction fail (a bug), its
        calls keep the default objective and are still scheduled."""
        if self._calls_of_session is None:
            calls = [t.call for t in self._queue.values() if t.call.session_id == sid]
        else:
            calls = list(self._calls_of_session(sid))
        try:
            return deduce(calls)
        except Exception:  # kept until the session changes again: no retry every round
            log.exception("objective deduction failed for session %s; its calls keep the default", sid)
            return {c.call_id: _LATENCY_DEFAULT for c in calls}

    def _forget_objective(self, call: Call) -> None:
        """A call ended: drop its objective (and its session's entry once empty)."""
        of_session = self._objectives.get(call.session_id)
        if of_session is not None:
            of_session.pop(call.call_id, None)
            if not of_session:
                del self._objectives[call.session_id]

    def _estimate(self, ticket: _Ticket) -> int:
        if ticket.tokens is None:
            call = ticket.call
            new_tokens = sum(o.sampling.max_tokens for o in call.outputs.values())
            if call.rendered is not None:  # rendered at submit for the longest-context engine
                _, rendered, max_len = call.rendered
            else:
                longest = self.pool.longest_context(call.model)
                if longest is None:
                    return 1  # no engine yet: unservable() says so
                rendered, max_len = self._rendered(ticket, longest), longest.max_seq_len
            constant = rendered.constant_prefix  # type: ignore[attr-defined]
            if constant is not None and constant[1] >= self.min_prefix_tokens:
                ticket.shared_prefix = constant
            shared = ticket.shared_prefix[1] if ticket.shared_prefix else 0
            # engines stop generating at their context: a call never holds more than that
            total = min(rendered.prompt_tokens + new_tokens, max_len)  # type: ignore[attr-defined]
            ticket.tokens = max(1, total - shared)
        return ticket.tokens

    def _tokenize_ahead(self, ticket: _Ticket) -> None:
        """Tokenize the long text a round found in a call's prompt, off the loop; a
        round runs when it is done, and renders the call from those tokens."""
        ticket.tokenizing = task = asyncio.get_running_loop().create_task(
            self._tokenize(ticket), name=f"tokenize {ticket.call.call_id}"
        )
        self._tokenizing.add(task)
        task.add_done_callback(self._tokenizing.discard)

    async def _tokenize(self, ticket: _Ticket) -> None:
        try:
            assert ticket.token_source is not None
            await ticket.token_source.resolve()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a tokenizer failing on some text fails that call alone
            self._fail_queued(ticket, exc)
        finally:
            ticket.tokenizing = None
            self.kick()

    async def _render_on(self, ticket: _Ticket, handle: EngineHandle) -> Rendered:
        """:meth:`_rendered`, tokenizing long text off the loop first if need be (a call
        placed on an engine of another model than the one its round rendered it for)."""
        while True:
            try:
                return self._rendered(ticket, handle)
            except NeedsTokenizing:
                assert ticket.token_source is not None
                await ticket.token_source.resolve()

    def _rendered(self, ticket: _Ticket, handle: EngineHandle) -> Rendered:
        """The call's engine steps for ``handle``'s model, rendered once per model; raises
        NeedsTokenizing when long text of its prompt must first be tokenized off the loop
        (recorded in ``ticket.token_source``)."""
        pre = ticket.call.rendered  # done at submit, when the inputs were already known
        if pre is not None and pre[0] == handle.model and handle.model not in ticket.rendered:
            ticket.rendered[handle.model] = pre[1]  # type: ignore[assignment]
        cached = ticket.rendered.get(handle.model)  # one model, one tokenizer: the same tokens
        if cached is None:
            if ticket.token_source is None:
                ticket.token_source = TokenSource(self.inline_tokenize_bytes)
            ticket.token_source.start_pass()
            cached = render(ticket.call, handle.api.tokenizer, handle.max_seq_len, ticket.token_source)
            ticket.rendered[handle.model] = cached
            ticket.token_source = None  # its tokens are in the steps now
        elif cached.prompt_tokens >= handle.max_seq_len:
            raise ContextTooLong(
                f"the rendered prompt has {cached.prompt_tokens} tokens; "
                f"the model's context is {handle.max_seq_len}"
            )
        return cached

    def _sync_engines(self) -> Scheduler:
        """Bring the scheduler's engine snapshots up to date; rebuild only those that changed.

        The round then sees exactly what :meth:`snapshots` returns, as if the
        pure ``schedule(queue, self.snapshots(), self.scheduler)`` were called.
        """
        sched = self._sched
        if sched is None or sched.config is not self.scheduler:  # (re)configured: start over
            sched = self._sched = Scheduler(self.scheduler)
            self._pool_seen = []
            self._seen.clear()
        stale = self._stale
        stale.update(self.prefixes.take_changed())
        # What the pool says of each engine; an engine joining or leaving, suspected or back,
        # or reporting another capacity or latency cap changes this list.
        default = self.engine_token_capacity
        pool_now = [
            (h, h.alive, h.stats.token_capacity or default, h.stats.latency_cap_tokens) for h in self.pool
        ]
        if pool_now != self._pool_seen:
            self._pool_seen = pool_now
            seen = self._seen
            for polled in pool_now:
                eid = polled[0].engine_id
                if seen.get(eid) != polled:
                    seen[eid] = polled
                    stale.add(eid)
            if len(seen) != len(pool_now):
                live = {polled[0].engine_id for polled in pool_now}
                for eid in [eid for eid in seen if eid not in live]:
                    del seen[eid]
                    sched.remove_engine(eid)
                    stale.discard(eid)
        if stale:
            for eid in stale:
                try:
                    h = self.pool.get(eid)
                except NotFound:  # dropped
                    self._seen.pop(eid, None)
                    sched.remove_engine(eid)
                    continue
                sched.set_engine(self._snapshot(h))
            stale.clear()
        return sched

    def _snapshot(self, h: EngineHandle) -> EngineSnapshot:
        use = self._usage.get(h.engine_id) or _Usage()
        return EngineSnapshot(
            engine_id=h.engine_id,
            model=h.model,
            max_seq_len=h.max_seq_len,
            token_capacity=h.stats.token_capacity or self.engine_token_capacity,
            token_load=use.load,
            mode=use.mode,  # type: ignore[arg-type]
            task_groups=use.group_set,
            prefixes=self.prefixes.keys_on(h.engine_id),
            alive=h.alive,
            latency_cap_tokens=h.stats.latency_cap_tokens or DEFAULT_LATENCY_CAP_TOKENS,
            last_assigned=use.last_assigned,
        )

    def snapshots(self) -> list[EngineSnapshot]:
        """What the scheduler knows of each engine in the pool, built afresh."""
        return [self._snapshot(h) for h in self.pool]

    def _account(self, ticket: _Ticket, sign: int) -> None:
        """Add (+1) or remove (-1) a placed call's share of its engine's load."""
        if ticket.engine is None:
            return
        eid = ticket.engine.engine_id
        use = self._usage.get(eid)
        if use is None:
            use = self._usage[eid] = _Usage()
        self._stale.add(eid)
        use.load += sign * (ticket.tokens or 0)
        if sign > 0:
            use.last_assigned = next(_assignments)
        if ticket.shared_prefix is not None:
            key, n = ticket.shared_prefix
            count = use.prefixes.get(key, 0) + sign
            if count > 0:
                use.prefixes[key] = count
            else:
                use.prefixes.pop(key, None)
            if (sign > 0 and count == 1) or (sign < 0 and count == 0):
                use.load += sign * n  # the first call of an engine brings the prefix, the last takes it
        kind = ticket.call.objective or "latency"
        use.kinds[kind] = use.kinds.get(kind, 0) + sign
        group = ticket.call.task_group
        if group:
            count = use.groups.get(group, 0) + sign
            if count > 0:
                use.groups[group] = count
            else:
                use.groups.pop(group, None)
            if (count > 0) != (group in use.group_set):
                use.group_set = frozenset(use.groups)

    # ------------------------------------------------------------ running
    def _start(self, ticket: _Ticket) -> None:
        call = ticket.call
        ticket.started = False
        self._placed[call.call_id] = ticket
        self._account(ticket, +1)
        self._tasks[call.call_id] = asyncio.get_running_loop().create_task(
            self._run(ticket), name=f"call {call.call_id}"
        )

    async def _run(self, ticket: _Ticket) -> None:
        ticket.started = True
        ticket.attempts += 1
        lost = None
        try:
            lost = await self._attempt(ticket)
        finally:
            self._finish(ticket, lost)

    def _finish(self, ticket: _Ticket, lost: str | None, kick: bool = True) -> None:
        """A placed call's run ended (``lost``: why its engine was lost, to re-run it)."""
        call = ticket.call
        self._tasks.pop(call.call_id, None)
        placed = self._placed.pop(call.call_id, None) is not None
        if placed:
            self._account(ticket, -1)
        if call.state in ("done", "failed"):
            self._forget_objective(call)
            call.rendered = None  # its engine steps are not needed any more
        requeued = lost is not None and self._requeue(ticket, lost)
        if placed and not requeued:
            self._retire(call)
        if kick:
            self.kick()

    def _requeue(self, ticket: _Ticket, lost: str) -> bool:
        """The call's engine was lost: queue it again (True), unless it cannot be re-run."""
        call = ticket.call
        if ticket.attempts >= self.max_attempts or any(
            o.var.state != "pending" for o in call.outputs.values()
        ):
            fail_call(call, EngineError(f"call {call.call_id} failed on its engine: {lost}"))
            return False
        log.warning("call %s: %s; re-running it elsewhere", call.call_id, lost)
        for out in call.outputs.values():
            out.var.partial.clear()
            out.var.notify()
        call.state = "ready"
        ticket.lost, ticket.engine = lost, None
        ticket.retry_deadline = time.monotonic() + self.engine_wait_s
        ticket.queued_at = time.monotonic()
        self._queue[call.call_id] = ticket
        return True

    async def _attempt(self, ticket: _Ticket) -> str | None:
        """One try on the placed engine.  Returns None when the call ended (done
        or failed), or why its engine was lost."""
        call, handle = ticket.call, ticket.engine
        assert handle is not None
        try:
            call.engine_id, call.generated_tokens = handle.engine_id, 0
            rendered = await self._render_on(ticket, handle)
            call.prompt_tokens = rendered.prompt_tokens
            call.state = "running"
            call.started_at, call.first_token_at = time.time(), None
            await self._drive(call, handle, rendered)
        except asyncio.CancelledError as exc:
            lost = exc.args[0] if exc.args and isinstance(exc.args[0], _EngineLost) else None
            if lost is None or call.state in ("done", "failed"):
                if call.state not in ("done", "failed"):
                    fail_call(call, EngineError(f"call {call.call_id} was cancelled"))
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # handled: re-run the call
            return str(lost)
        except EngineError as exc:
            if call.state in ("done", "failed"):
                return None
            self.pool.suspect(handle.engine_id)  # no new work until it heartbeats again
            return exc.message
        except ParrotError as exc:
            fail_call(call, exc)
        except Exception as exc:
            log.exception("call %s failed", call.call_id)
            fail_call(call, CallFailed(f"internal error while running the call: {exc!r}"))
        return None

    async def _drive(self, call: Call, handle: EngineHandle, rendered: Rendered) -> None:
        api = handle.api
        context_id = handle.new_context_id()
        opened = False
        try:
            for step in rendered.steps:
                if isinstance(step, FillStep):
                    opened = True
                    await api.fill(step.tokens, context_id, cache_salt=call.cache_salt)
                    continue
                out = step.output
                text: list[str] = []
                async for chunk in api.generate(out.sampling, context_id):
                    if chunk.finish_reason == "cancelled":  # the manager never cancels this way
                        raise CallFailed(
                            f"call {call.call_id}: the engine stopped its generation after "
                            f"{call.generated_tokens} tokens because its context was freed or "
                            "cancelled from outside the manager"
                        )
                    if chunk.token_ids and call.first_token_at is None:
                        call.first_token_at = time.time()
                    if chunk.text:
                        text.append(chunk.text)
                        out.var.partial.append(chunk.text)
                        out.var.notify()
                    call.generated_tokens += len(chunk.token_ids)
                value = "".join(text)
                if out.transform is not None:  # off the loop: a regex may take its whole budget
                    value = await asyncio.to_thread(out.transform.apply, value)
                for ready in materialise(out.var, value):
                    self.dispatch(ready)
            # done as its last value is set, before the await below: whoever reads that
            # value (a get, a stream's end) and then the call sees it done, never running
            call.state = "done"
            call.finished_at = time.time()
        finally:
            if opened and handle.alive:
                with contextlib.suppress(Exception):
                    await asyncio.shield(api.free_context(context_id))

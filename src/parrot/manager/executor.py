"""Runs calls as soon as their inputs exist, entirely inside the server.

A call that becomes ready joins the executor's queue. A scheduling round (run on every
event that may change a decision — a call ready or finished, an engine joining, a
session gaining a call or a criterion — and on a short tick while calls wait) deduces
each session's objectives from its DAG (:mod:`parrot.manager.dag.objectives`; only
sessions that changed are deduced again), snapshots the engines (only those that
changed), and asks the scheduler (:mod:`parrot.manager.sched.scheduler`, the paper's
Algorithm 1) where queued calls go. A placed call's prefix keys are recorded for its
engine, so later calls sharing a prefix go where the engine's prefix cache holds it. A
placed call renders its prompt from the materialised inputs and drives its engine
(:func:`~parrot.manager.call_driver.drive`); its outputs may make consumer calls
ready, which are queued in turn. No value travels to the client on the way.

Queue order: application-level FIFO within a tenant, fair turns between tenants
(:mod:`parrot.manager.sched.queue_order`).  Its parts: objectives
(:mod:`~parrot.manager.dag.objective_cache`), engine loads
(:mod:`~parrot.manager.sched.engine_loads`), what the scheduler sees of a queued call
(its ticket, token estimate, affinity keys and prompt rendered per model:
:mod:`~parrot.manager.queue_entries`), one run of a call on its engine
(:mod:`~parrot.manager.call_driver`); this module queues, places, runs and retries, and
observes each call's queue wait (:mod:`parrot.manager.metrics`).

Guarantees: every call ends ``done`` or ``failed``; an unexpected error while one
queued call is scheduled fails that call alone (rounds go on); a failure fails the
call's outputs and everything downstream; a call no engine can ever serve fails at
once, one that waits longer than ``queue_timeout_s`` fails with a timeout; a call
whose engine is lost before any of its outputs materialised is queued again and re-run
elsewhere (waiting up to ``engine_wait_s`` for an engine); the engine context of a
call is freed however the call ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable

from parrot.manager.backends.pool import EngineHandle, EnginePool
from parrot.manager.call_driver import drive
from parrot.manager.dag.graph import Call, fail_call
from parrot.manager.dag.objective_cache import ObjectiveCache
from parrot.manager.dag.prefix import PrefixIndex, prefix_keys
from parrot.manager.dag.shared_start import SharedStarts
from parrot.manager.dag.tokens import INLINE_TOKENIZE_BYTES, NeedsTokenizing
from parrot.manager.early_prefill import EarlyPrefill
from parrot.manager.metrics import ManagerMetrics
from parrot.manager.queue_entries import REQUEST_LEVEL_POLICIES, QueueEntries, Ticket
from parrot.manager.sched.engine_loads import EngineLoads, PlacedShare
from parrot.manager.sched.queue_order import QueueOrder
from parrot.manager.sched.scheduler import EngineSnapshot, QueuedCall, SchedulerConfig
from parrot.protocol import clock
from parrot.protocol.errors import CallFailed, EngineError, NoEngine, ParrotError, Timeout

log = logging.getLogger(__name__)

TICK_S = 0.1
MIN_ROUND_GAP_S = 0.0005


class _EngineLost(str):
    """Cancellation message marking a call whose engine was dropped."""


class Executor:
    """The executor of one manager (see the module docstring).  Each call it knows is in
    at most one of ``_queue`` (ready, waiting for a round to place it) and ``_placed``
    (on an engine, with its task in ``_tasks`` until its run ends); a placed call's
    share is counted in its engine's load exactly while it is placed."""

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
        program_scheduling: bool = False,
        early_prefill: bool = True,
        inline_tokenize_bytes: int | None = INLINE_TOKENIZE_BYTES,
        metrics: ManagerMetrics | None = None,
    ):
        self.pool = pool
        self.prefixes = prefixes or PrefixIndex()
        self.scheduler = scheduler or SchedulerConfig()
        self.max_attempts = max_attempts
        self.engine_wait_s = engine_wait_s
        self.queue_timeout_s = queue_timeout_s
        self.app_fifo = app_fifo
        self.metrics = metrics or ManagerMetrics()  # queue waits here, token timings in drive()
        self.loads = EngineLoads(pool, self.prefixes, engine_token_capacity)
        self.shared_starts = SharedStarts(self.prefixes, min_prefix_tokens)
        self.order = QueueOrder(by_service=program_scheduling)
        self.early = EarlyPrefill(pool, self.prefixes, min_prefix_tokens) if early_prefill else None
        self.objectives = ObjectiveCache(calls_of_session)
        self.entries = QueueEntries(
            pool,
            self.loads,
            self.shared_starts,
            self.objectives,
            self.order,
            min_prefix_tokens=min_prefix_tokens,
            inline_tokenize_bytes=inline_tokenize_bytes,
        )
        self._queue: dict[str, Ticket] = {}
        self._placed: dict[str, Ticket] = {}
        self._last_round = 0.0
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._tokenizing: set[asyncio.Task[None]] = set()  # prompts being tokenized off the loop
        self._arrivals = itertools.count()
        self._kicked = False
        self._ticker: asyncio.Task[None] | None = None
        self.rounds = 0
        pool.on_drop(self._engine_dropped)

    def task(self, call_id: str) -> asyncio.Task[None] | None:
        """The task running a placed call, if any."""
        return self._tasks.get(call_id)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def snapshots(self) -> list[EngineSnapshot]:
        """What the scheduler knows of each engine in the pool, built afresh."""
        return self.loads.snapshots()

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
        self.order.enter(call, arrival)
        shares = self.shared_starts.chunks(call)
        self._queue[call.call_id] = Ticket(call, arrival, prefix_keys=tuple(keys), key_shares=shares)
        self.kick()

    def forget_session(self, session_id: str) -> None:
        """The session was closed: drop its place in the application queue."""
        self.order.forget_session(session_id)

    def graph_changed(self, session_id: str) -> None:
        """A session gained a call or an output criterion: its objectives are deduced
        again in a round that runs at once when calls are queued, so they are re-ranked
        (their QueuedCall rebuilt with the new objective) before anything else is placed."""
        self.objectives.mark_changed(session_id)
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
        wait = self._last_round + MIN_ROUND_GAP_S - clock.monotonic()
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
            self.order.leave(call)
        task = self._tasks.get(call.call_id)
        fail_call(call, error)
        if task is not None:
            task.cancel()
            self._cancelled_before_start(call.call_id, None)

    def waiting(self, call: Call) -> None:
        """``call`` was submitted and waits for inputs: compute its constant start early
        (:mod:`parrot.manager.early_prefill`), behind every call's own work on the engine."""
        if self.early is not None:
            self.early.waiting(call)

    async def drain(self) -> None:
        if self.early is not None:
            await self.early.close()
        if self._ticker is not None:
            self._ticker.cancel()
        tasks = [*self._tasks.values(), *self._tokenizing]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _engine_dropped(self, handle: EngineHandle, reason: str) -> None:
        self.prefixes.forget_engine(handle.engine_id)
        self.loads.engine_dropped(handle.engine_id)
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

    def _drop_queued(self, ticket: Ticket) -> None:
        """Take a queued call out of the executor for good."""
        call = ticket.call
        if self._queue.pop(call.call_id, None) is not None:
            self.order.leave(call)
        self.objectives.forget(call)
        call.rendered = None

    # ------------------------------------------------------------- rounds
    def _round(self) -> None:
        self._kicked = False
        self.rounds += 1
        now = self._last_round = clock.monotonic()
        for ticket in list(self._queue.values()):
            call = ticket.call
            if call.state != "ready":  # failed meanwhile (session closed, input failed)
                self._drop_queued(ticket)
            elif self.queue_timeout_s is not None and now - ticket.queued_at > self.queue_timeout_s:
                del self._queue[call.call_id]
                self.order.leave(call)
                fail_call(
                    call,
                    Timeout(f"call {call.call_id} waited more than {self.queue_timeout_s:g}s for an engine"),
                )
        if not self._queue:
            return
        self.objectives.refresh([t.call for t in self._queue.values()])
        self.order.share(((t.call, t.arrival) for t in self._queue.values()), self._fifo_by_app)
        queue: list[QueuedCall] = []
        for ticket in list(self._queue.values()):
            try:
                queued = self._queued(ticket)
            except Exception as exc:  # one call's bug must not stop the round
                self._fail_queued(ticket, exc)
            else:
                if queued is not None:
                    queue.append(queued)
        sched = self.loads.sync(self.scheduler)
        failed = False
        for call_id, reason in sched.unservable(queue):
            ticket = self._queue[call_id]
            if ticket.retry_deadline is not None and now < ticket.retry_deadline:
                continue  # its engine was lost: wait a while for another one
            del self._queue[call_id]
            self.order.leave(ticket.call)
            failed = True
            why = f" lost its engine ({ticket.lost}) and" if ticket.lost else ""
            down = self.pool.down(ticket.call.model)  # "" or " (engines not answering: ...)"
            fail_call(ticket.call, NoEngine(f"call {call_id}{why} cannot be served: {reason}{down}"))
        queue = [q for q in queue if q.call_id in self._queue] if failed else queue
        for placement in sched.schedule(queue):
            ticket = self._queue.pop(placement.call_id)
            ticket.engine = self.pool.get(placement.engine_id)
            self.prefixes.record(placement.engine_id, ticket.prefix_keys)
            ticket.call.placement = placement.reason
            ticket.call.dispatched_at = clock.wall()
            ticket.priority = self.order.engine_priority(ticket.call, ticket.arrival, self._fifo_by_app)
            self.metrics.placed(placement.engine_id, now - ticket.queued_at)
            self.order.served(ticket.call)
            self._start(ticket)
        if any(self._prefix_arrived(t) for t in self._queue.values()):
            self.kick()  # calls that counted a shared prefix this round placed now count less

    def _prefix_arrived(self, ticket: Ticket) -> bool:
        """Whether the round counted ``ticket``'s shared prefix in its tokens (no engine
        held it) and an engine now holds it."""
        shared, queued = ticket.shared_prefix, ticket.queued
        return (
            shared is not None
            and queued is not None
            and queued.tokens > (ticket.tokens or 0)
            and self.loads.prefix_running(shared[0])
        )

    @property
    def _request_level(self) -> bool:  # a request-level baseline: no sharing but a system prompt
        return self.scheduler.policy in REQUEST_LEVEL_POLICIES

    @property
    def _fifo_by_app(self) -> bool:  # else calls rank by their own arrival
        return self.app_fifo and not self._request_level

    def _queued(self, ticket: Ticket) -> QueuedCall | None:
        """What the scheduler sees of a queued call this round (:meth:`QueueEntries.entry`);
        None while its prompt is being tokenized off the loop (it waits for a later round)."""
        if ticket.tokenizing is not None:
            return None
        try:
            return self.entries.entry(
                ticket, fifo_by_app=self._fifo_by_app, request_level=self._request_level
            )
        except NeedsTokenizing:
            self._tokenize_ahead(ticket)
            return None

    def _fail_queued(self, ticket: Ticket, exc: Exception) -> None:
        """Take a call out of the queue and fail it: with ``exc`` itself if it is a
        ParrotError (a call that cannot be served), else with a CallFailed naming the
        call and the unexpected exception (a bug, logged with its traceback)."""
        call = ticket.call
        self._drop_queued(ticket)
        if isinstance(exc, ParrotError):
            error = exc
        else:
            log.error("call %s could not be scheduled", call.call_id, exc_info=exc)
            error = CallFailed(
                f"call {call.call_id} failed while being scheduled: internal error {exc!r}",
                detail={"call_id": call.call_id, "exception": repr(exc)},
            )
        fail_call(call, error)

    def _tokenize_ahead(self, ticket: Ticket) -> None:
        """Tokenize the long text a round found in a call's prompt, off the loop; a
        round runs when it is done, and renders the call from those tokens."""
        ticket.tokenizing = task = asyncio.get_running_loop().create_task(
            self._tokenize(ticket), name=f"tokenize {ticket.call.call_id}"
        )
        self._tokenizing.add(task)
        task.add_done_callback(self._tokenizing.discard)

    async def _tokenize(self, ticket: Ticket) -> None:
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

    # ------------------------------------------------------------ running
    def _start(self, ticket: Ticket) -> None:
        call = ticket.call
        ticket.started = False
        self._placed[call.call_id] = ticket
        assert ticket.engine is not None
        ticket.share = PlacedShare(
            ticket.tokens or 0, ticket.shared_prefix, call.objective or "latency", call.task_group
        )
        self.loads.account(ticket.engine.engine_id, ticket.share, +1)
        self._tasks[call.call_id] = asyncio.get_running_loop().create_task(
            self._run(ticket), name=f"call {call.call_id}"
        )

    async def _run(self, ticket: Ticket) -> None:
        ticket.started = True
        ticket.attempts += 1
        lost = None
        try:
            lost = await self._attempt(ticket)
        finally:
            self._finish(ticket, lost)

    def _finish(self, ticket: Ticket, lost: str | None, kick: bool = True) -> None:
        """A placed call's run ended (``lost``: why its engine was lost, to re-run it)."""
        call = ticket.call
        self._tasks.pop(call.call_id, None)
        placed = self._placed.pop(call.call_id, None) is not None
        if placed and ticket.engine is not None and ticket.share is not None:
            self.loads.account(ticket.engine.engine_id, ticket.share, -1)
            ticket.share = None
        if call.state in ("done", "failed"):
            self.objectives.forget(call)
            call.rendered = None  # its engine steps are not needed any more
        requeued = lost is not None and self._requeue(ticket, lost)
        if placed and not requeued:
            self.order.attain(call, ticket.tokens or 0)
            self.order.leave(call)
        if kick:
            self.kick()

    def _requeue(self, ticket: Ticket, lost: str) -> bool:
        """The call's engine was lost: queue it again (True), unless it cannot be re-run."""
        call = ticket.call
        if ticket.attempts >= self.max_attempts or any(o.var.state != "pending" for o in call.all_outputs()):
            fail_call(call, EngineError(f"call {call.call_id} failed on its engine: {lost}"))
            return False
        log.warning("call %s: %s; re-running it elsewhere", call.call_id, lost)
        for out in call.all_outputs():
            out.var.partial.clear()
            out.var.notify()
        call.state = "ready"
        ticket.lost, ticket.engine = lost, None
        ticket.retry_deadline = clock.monotonic() + self.engine_wait_s
        ticket.queued_at = clock.monotonic()
        self._queue[call.call_id] = ticket
        return True

    async def _attempt(self, ticket: Ticket) -> str | None:
        """One try on the placed engine.  Returns None when the call ended (done
        or failed), or why its engine was lost."""
        call, handle = ticket.call, ticket.engine
        assert handle is not None
        try:
            call.engine_id, call.generated_tokens = handle.engine_id, 0
            rendered = await self.entries.render_on(ticket, handle)
            call.prompt_tokens = rendered.prompt_tokens
            call.state = "running"
            call.started_at, call.first_token_at = clock.wall(), None
            await drive(call, handle, rendered, self.dispatch, self.metrics, priority=ticket.priority)
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
            self.pool.suspect(handle.engine_id, exc.message)  # no new work until it heartbeats again
            return exc.message
        except ParrotError as exc:
            fail_call(call, exc)
        except Exception as exc:
            log.exception("call %s failed", call.call_id)
            fail_call(call, CallFailed(f"internal error while running the call: {exc!r}"))
        return None

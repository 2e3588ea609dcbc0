"""The manager's operations, independent of HTTP.

Every operation validates completely before it changes anything, so a
rejected request leaves no partial state behind (no half-linked call, no
orphan variable).  Sessions are isolated: an id from another session is
reported as not found.

The operations are synchronous: nothing else runs between a request's first
check and its last change.  Long text they must tokenize (a value's length, a
prompt rendered at submit) is tokenized off the event loop when they are run
through :meth:`Manager.run_tokenized` (see :mod:`parrot.manager.dag.tokens`); called
directly they tokenize everything themselves.

:class:`Manager` is the facade: the HTTP routers (:mod:`parrot.manager.api`,
:mod:`parrot.manager.openai`) call its methods only.  Its validation of calls and text
lengths is in :mod:`parrot.manager.staging`, its operations on engines in
:mod:`parrot.manager.engine_ops`, its settings in :mod:`parrot.manager.config`, what
clients see of the graph in :mod:`parrot.manager.views`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
from collections.abc import Mapping, Sequence

from parrot.manager.backends.pool import EnginePool
from parrot.manager.config import ManagerConfig
from parrot.manager.dag.graph import (
    Call,
    Criteria,
    Session,
    Variable,
    fail_call,
    fail_variable,
    link_call,
    materialise,
    new_id,
)
from parrot.manager.dag.prefix import PrefixIndex
from parrot.manager.dag.tokens import TokenSource
from parrot.manager.engine_ops import EngineOperations
from parrot.manager.executor import Executor
from parrot.manager.metrics import ManagerMetrics
from parrot.manager.sched.scheduler import SchedulerConfig
from parrot.manager.staging import CallStaging, StagedCall, VarLookup, inline_bytes, value_bytes
from parrot.manager.tenants import ANONYMOUS, ApiKeys, TenantBook, cache_salt
from parrot.protocol import clock
from parrot.protocol.errors import (
    CallFailed,
    Conflict,
    Forbidden,
    NotFound,
    ParrotError,
    Unauthorized,
)
from parrot.protocol.schemas import EngineStats, PlaceholderBinding, SubmitCall

log = logging.getLogger(__name__)

MAX_WAIT_S = 60.0


def _hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Manager(EngineOperations, CallStaging):
    """The manager's facade: every operation on sessions, variables, calls and engines.
    One object in three files by responsibility: this one (sessions, variables, calls
    and their commit), :class:`~parrot.manager.staging.CallStaging` (validating calls and
    text lengths) and :class:`~parrot.manager.engine_ops.EngineOperations` (engines).
    The HTTP routers call these methods only, never ``pool`` or ``executor``
    (tests/test_manager_facade.py)."""

    executor: Executor  # EngineOperations asks only for scheduling rounds of it

    def __init__(self, config: ManagerConfig | None = None):
        self.config = config or ManagerConfig()
        self.metrics = ManagerMetrics()  # its own registry: managers in one process never mix series
        self.pool = EnginePool(heartbeat_timeout_s=self.config.heartbeat_timeout_s)
        self.executor = Executor(
            self.pool,
            PrefixIndex(self.config.affinity_keys_per_engine),
            calls_of_session=self._unfinished_calls,
            scheduler=SchedulerConfig(
                self.config.policy,
                latency_cap_tokens=self.config.latency_cap_tokens,
                latency_cap_scope=self.config.latency_cap_scope,
                affinity_spill=self.config.affinity_spill,
                pack_latency=self.config.pack_latency,
                saturation_batching=self.config.saturation_batching,
                prefill_tokens_per_step=self.config.prefill_tokens_per_step,
            ),
            engine_token_capacity=self.config.engine_token_capacity,
            queue_timeout_s=self.config.queue_timeout_s,
            min_prefix_tokens=self.config.min_prefix_tokens,
            max_attempts=self.config.max_attempts,
            engine_wait_s=self.config.engine_wait_s,
            app_fifo=self.config.app_fifo,
            program_scheduling=self.config.program_scheduling,
            early_prefill=self.config.early_prefill,
            inline_tokenize_bytes=self.config.inline_tokenize_bytes,
            metrics=self.metrics,
        )
        self.sessions: dict[str, Session] = {}
        self.api_keys = ApiKeys(self.config.api_keys)
        self.tenants = TenantBook(self.config.quotas)
        cache_salt(ANONYMOUS, self.config.prefix_sharing)  # a bad setting fails here, at start-up
        # the token source of the operation run_tokenized is running (None: tokenize at once)
        self._tokens: TokenSource | None = None
        self._polls: set[asyncio.Task[EngineStats]] = set()  # stats polls of newly registered engines
        self.pool.on_register(self._engine_registered)
        self.metrics.watch(self)

    def _unfinished_calls(self, session_id: str) -> list[Call]:
        session = self.sessions.get(session_id)
        return (
            []
            if session is None
            else [c for c in session.calls.values() if c.state not in ("done", "failed")]
        )

    # ------------------------------------------------------------ sessions
    def create_session(self, tenant: str = ANONYMOUS) -> tuple[Session, str]:
        """A new session of ``tenant`` and its token; QuotaExceeded if the tenant has as
        many sessions open as its quota allows."""
        self.tenants.check(tenant, sessions=1)
        token = secrets.token_urlsafe(32)
        session = Session(new_id("s") + "-" + secrets.token_hex(4), _hash_token(token), tenant=tenant)
        self.sessions[session.session_id] = session
        self.tenants.add_session(tenant)
        return session, token

    def check_room(self, session: Session, *, calls: int = 0, value_bytes: int = 0) -> None:
        """Raise QuotaExceeded unless ``session``'s tenant may add these (nothing changes)."""
        self.tenants.check(session.tenant, calls=calls, value_bytes=value_bytes)

    def charge(self, session: Session, *, calls: list[Call] | None = None, value_bytes: int = 0) -> None:
        """Count admitted calls and client-supplied value bytes against ``session``'s tenant."""
        if calls:
            self.tenants.add_calls(session.tenant, calls)
        if value_bytes:
            session.value_bytes += value_bytes
            self.tenants.add_value_bytes(session.tenant, value_bytes)

    def authorize(self, session_id: str, token: str | None) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"session {session_id} does not exist", code="session_not_found")
        if not token:
            raise Unauthorized("missing session token: send 'Authorization: Bearer <token>'")
        if not hmac.compare_digest(session.token_hash, _hash_token(token)):
            raise Forbidden(f"the token does not open session {session_id}")
        session.last_active = clock.monotonic()
        return session

    def expire_idle_sessions(self, now: float | None = None) -> list[str]:
        """Close every session idle for longer than ``config.session_ttl_s``: no request
        presented its token for that long, none of its calls is queued or running, and
        none ended within the TTL (so a call that ran longer than the TTL leaves its
        client a whole TTL to read the result; calls waiting for an input the client
        never set do not keep it).  Returns the ids closed.  O(sessions), plus the calls
        of the sessions past the TTL."""
        ttl = self.config.session_ttl_s
        if ttl is None:
            return []
        now = clock.monotonic() if now is None else now
        now_wall = clock.wall()

        def keeps_alive(c: Call) -> bool:
            return c.state in ("ready", "running") or (
                c.finished_at is not None and now_wall - c.finished_at <= ttl
            )

        expired = [
            s
            for s in self.sessions.values()
            if now - s.last_active > ttl and not any(keeps_alive(c) for c in s.calls.values())
        ]
        for session in expired:
            self.close_session(session)
        return [s.session_id for s in expired]

    def close_session(self, session: Session) -> None:
        """Cancel the session's running calls, free their contexts, drop its state."""
        session.closed = True
        closed = ParrotError(f"session {session.session_id} was closed", code="session_closed")
        for call in session.calls.values():
            if call.state not in ("done", "failed"):
                self.executor.cancel(call, closed)
        for var in session.variables.values():
            fail_variable(var, closed)
        if self.sessions.pop(session.session_id, None) is not None:
            self.tenants.remove_session(session.tenant, session.value_bytes)
        self.executor.forget_session(session.session_id)

    # ----------------------------------------------------------- variables
    def variable(self, session: Session, var_id: str) -> Variable:
        var = session.variables.get(var_id)
        if var is None:
            raise NotFound(f"variable {var_id} does not exist in this session", code="variable_not_found")
        return var

    def call(self, session: Session, call_id: str) -> Call:
        call = session.calls.get(call_id)
        if call is None:
            raise NotFound(f"call {call_id} does not exist in this session", code="call_not_found")
        return call

    def create_variable(self, session: Session, name: str | None, value: str | None) -> Variable:
        size = value_bytes(value)
        self.check_room(session, value_bytes=size)
        var = self.new_variable(session, name, value)
        self.settle_tokens()
        self.commit(session, [var], value_bytes=size)
        return var

    def new_variable(self, session: Session, name: str | None, value: str | None) -> Variable:
        """A validated variable of ``session``, not added to it yet."""
        if value is not None:
            self._check_value_length(value)
        var = Variable(new_id("v"), session.session_id, name=name)
        if value is not None:
            var.value, var.state = value, "ready"
        return var

    def set_variable(self, session: Session, var_id: str, value: str) -> Variable:
        var = self.variable(session, var_id)
        self.check_settable(var, value)
        size = value_bytes(value)
        self.check_room(session, value_bytes=size)
        self.settle_tokens()
        self.commit(session, [], {var: value}, value_bytes=size)
        return var

    def check_settable(self, var: Variable, value: str) -> None:
        """Raise unless the client may give ``var`` this ``value`` now."""
        if var.producer is not None:
            raise Conflict(
                f"variable {var.var_id} is produced by call {var.producer.call_id}; it cannot be set",
                code="variable_has_producer",
            )
        if var.state != "pending":
            raise Conflict(f"variable {var.var_id} is already {var.state}", code="variable_not_pending")
        self._check_value_length(value)

    def read_with(self, session: Session, var: Variable, criteria: Criteria | None) -> None:
        """A client reads ``var`` (``get`` or ``stream``, however it submitted its calls)
        asking for ``criteria``: the variable takes it, and the calls upstream of it are
        deduced again at once, queued ones included (the last criteria asked wins)."""
        if criteria is not None and var.criteria != criteria:
            var.criteria = criteria
            self.executor.graph_changed(session.session_id)

    async def wait_variable(self, var: Variable, wait_s: float) -> None:
        deadline = clock.monotonic() + min(max(wait_s, 0.0), MAX_WAIT_S)
        while var.state == "pending":
            left = deadline - clock.monotonic()
            if left <= 0:
                return
            await var.wait_change(left)

    # --------------------------------------------------------------- calls
    def submit_call(
        self,
        session: Session,
        req: SubmitCall,
        *,
        prompt_ids: tuple[int, ...] | None = None,
        samples: int = 1,
    ) -> Call:
        """Validate, link and start ``req``'s call (``prompt_ids``, ``samples``: see
        :meth:`stage_call`)."""
        size = inline_bytes(req)
        self.check_room(session, calls=1, value_bytes=size)
        staged = self.stage_call(
            session, req, self.lookup_in(session), prompt_ids=prompt_ids, samples=samples
        )
        self.settle_tokens()
        link_call(staged.call)  # validates (producer conflicts, cycles) before linking anything
        self.commit(session, [staged], value_bytes=size)
        return staged.call

    def lookup_in(self, session: Session) -> VarLookup:
        """The lookup of plain requests: a binding names a variable by ``var_id`` only."""

        def lookup(b: PlaceholderBinding) -> Variable | None:
            return None if b.var_id is None else self.variable(session, b.var_id)

        return lookup

    def add_call(self, session: Session, staged: StagedCall) -> None:
        """Put a linked call and its fresh output variables into the session."""
        call = staged.call
        for name, criteria in staged.criteria.items():
            call.outputs[name].var.criteria = criteria
        for var in staged.new_vars:
            session.variables[var.var_id] = var
        session.calls[call.call_id] = call

    def commit(
        self,
        session: Session,
        steps: Sequence[Variable | StagedCall],
        sets: Mapping[Variable, str] | None = None,
        *,
        value_bytes: int = 0,
    ) -> None:
        """Apply validated changes to ``session``; raises nothing, as the caller validated
        them, quota included (:meth:`check_room`), and linked the staged calls.

        In order: ``steps`` (new variables, staged calls) join the session in their
        order, the tenant is charged ``value_bytes`` and the calls, the session's graph
        is marked changed once if it gained calls, and only then are ``sets`` (pending
        variables and their values) applied and the calls that are ready queued: the
        first scheduling round that may place any of them deduces objectives over all."""
        calls: list[Call] = []
        for step in steps:
            if isinstance(step, StagedCall):
                self.add_call(session, step)
                calls.append(step.call)
            else:
                session.variables[step.var_id] = step
        self.charge(session, calls=calls, value_bytes=value_bytes)
        if calls:
            self.executor.graph_changed(session.session_id)
        made_ready = [c for var, value in (sets or {}).items() for c in materialise(var, value)]
        for call in calls:
            self.start_call(call)
        for call in made_ready:
            self.executor.dispatch(call)

    async def wait_call_freed(self, call: Call, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, until the task running ``call`` on its engine ends
        (the engine context it held is then freed); at once if none runs.  Neither raises
        nor cancels the task."""
        task = self.executor.task(call.call_id)
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=timeout_s)

    async def drain(self) -> None:
        """Stop scheduling and cancel every call's running task, waiting for them to end
        (the server is stopping; engines are left as they are)."""
        await self.executor.drain()

    def start_call(self, call: Call) -> None:
        """Fail a call whose input failed, queue it if it is ready, else leave it waiting."""
        failed = call.failed_input()
        if failed is not None:
            name, var = failed
            origin = {"origin_call": var.producer.call_id} if var.producer else {}
            fail_call(
                call,
                CallFailed(
                    f"input {name!r} failed: {var.error.message if var.error else ''}",
                    code=var.error.code if var.error else "input_failed",
                    detail={**origin, **(var.error.detail if var.error else {})},  # keeps the root cause
                ),
            )
        elif call.is_ready():
            self.executor.dispatch(call)
        else:
            self.executor.waiting(call)

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

(Over 500 lines: one class of operations on sessions, variables and calls that
share one validation discipline; its settings are in :mod:`parrot.manager.config`,
what clients see of the graph in :mod:`parrot.manager.views`.)
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from parrot.manager.backends.pool import EngineHandle, EnginePool
from parrot.manager.config import ManagerConfig
from parrot.manager.dag.graph import (
    Call,
    Criteria,
    OutputSpec,
    PreRendered,
    Session,
    Variable,
    add_forks,
    fail_call,
    fail_variable,
    link_call,
    materialise,
    new_id,
)
from parrot.manager.dag.prefix import PrefixIndex
from parrot.manager.dag.render import check_chat_shape, check_starts_with_text, render
from parrot.manager.dag.tokens import NeedsTokenizing, TokenSource, utf8_len
from parrot.manager.executor import Executor
from parrot.manager.metrics import ManagerMetrics
from parrot.manager.sched.scheduler import SchedulerConfig
from parrot.manager.tenants import ANONYMOUS, ApiKeys, TenantBook, cache_salt
from parrot.protocol import clock
from parrot.protocol.errors import (
    BindingError,
    CallFailed,
    Conflict,
    ContextTooLong,
    Forbidden,
    NotFound,
    ParrotError,
    Unauthorized,
)
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import EngineStats, PlaceholderBinding, SubmitCall
from parrot.protocol.template import Template, parse_template
from parrot.protocol.tokenizer import TextTokenizer
from parrot.protocol.transforms import parse_transforms

log = logging.getLogger(__name__)

MAX_WAIT_S = 60.0
MAX_TOKENIZING_PASSES = 16
"""Passes of :meth:`Manager.run_tokenized` before it gives up deferring (never reached:
each pass defers only text not tokenized yet, and a request holds finitely many)."""

T = TypeVar("T")

VarLookup = Callable[[PlaceholderBinding], Variable | None]
"""The variable a binding names (raises if it names an unknown one), or None if it names none."""


@dataclass
class StagedCall:
    """A validated call not yet linked into the graph nor added to its session."""

    call: Call
    new_vars: list[Variable]  # its outputs' fresh variables, not in the session yet
    criteria: dict[str, Criteria]  # output name -> criteria to put on its variable when added


def _hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Manager:
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

    # ------------------------------------------------------------- engines
    async def poll_engine_stats(self) -> None:
        """One heartbeat for every polled engine (in-process or external): ask it for its
        stats and record them in the pool, where the scheduler reads them (remote engines
        send theirs)."""
        local = [h for h in self.pool if h.polled]
        await asyncio.gather(*(self.refresh_stats(h) for h in local))

    async def refresh_stats(self, handle: EngineHandle) -> EngineStats:
        """Ask a polled engine for its stats now and record them (a remote engine's are
        those of its last heartbeat).  An engine that fails to answer keeps its previous
        stats and, if external, is suspected until it answers; one dropped meanwhile is
        left alone."""
        if not handle.polled:
            return handle.stats
        try:
            stats = await handle.api.stats()
        except Exception as exc:
            log.warning("engine %s: stats poll failed: %r", handle.engine_id, exc)
            self.pool.suspect(handle.engine_id, str(getattr(exc, "message", exc)))
            return handle.stats
        caps = _caps(handle.stats)
        try:
            self.pool.heartbeat(handle.engine_id, stats)
        except NotFound:
            return stats
        if _caps(stats) != caps:
            self.executor.kick()  # queued calls may fit now
        return stats

    def _engine_registered(self, handle: EngineHandle) -> None:
        """Poll a new polled engine's stats at once.  Without a running event loop
        (registered before the server starts) the first poll at start-up does it.

        Also computes its tokenizer's byte bound now, once (a pass over the vocabulary,
        :attr:`TextTokenizer.max_token_bytes`), not on the first request that needs it."""
        tokenizer = getattr(handle.api, "tokenizer", None)
        if isinstance(tokenizer, TextTokenizer):
            _ = tokenizer.max_token_bytes
        if not handle.polled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self.refresh_stats(handle))
        self._polls.add(task)
        task.add_done_callback(self._polls.discard)

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

    # ------------------------------------------------------ tokenization
    async def run_tokenized(self, op: Callable[[], T]) -> T:
        """Run the synchronous operation ``op`` without tokenizing long text on the
        event loop, and return what it returns.

        ``op`` runs in passes, each synchronous from its first check to its last
        change.  In a pass, long text not tokenized yet is recorded and its check
        put off (a value's length, a prompt rendered at submit); the operation then
        stops at :meth:`settle_tokens`, before it changes anything, or at an error.
        Between passes the recorded text is tokenized in worker threads, and the
        next pass finds it.  The pass that records nothing is the one whose outcome
        (result or error) counts, so callers see the errors, in the order, of an
        operation that tokenized everything itself.  ``op`` must take everything
        it uses from the manager's state afresh (authorize the session in it):
        other requests run between passes."""
        source = TokenSource(self.config.inline_tokenize_bytes)
        for _ in range(MAX_TOKENIZING_PASSES):
            source.start_pass()
            self._tokens = source
            try:
                return op()
            except (NeedsTokenizing, ParrotError):
                if not source.pending:
                    raise
            finally:
                self._tokens = None
            await source.resolve()
        log.warning("an operation still deferred tokenization after %d passes", MAX_TOKENIZING_PASSES)
        return op()

    def settle_tokens(self) -> None:
        """Every operation calls this after validating and before changing anything:
        if a check was put off (its text is to be tokenized off the loop), the
        operation stops here, unchanged, and :meth:`run_tokenized` runs it again."""
        if self._tokens is not None and self._tokens.pending:
            raise NeedsTokenizing("the request's text is being tokenized")

    def _check_value_length(self, value: str, longest: EngineHandle | None = None) -> None:
        """Reject a value no engine could hold (``longest``: the live engine with
        the longest context, if the caller already looked it up).

        A value over ``max_seq_len * max_token_bytes`` bytes is rejected without
        being tokenized; a long one is counted off the loop (the check is put off,
        see :meth:`run_tokenized`)."""
        longest = longest or self.pool.longest_context(None)
        if longest is None:
            return
        n_bytes = utf8_len(value)
        if n_bytes <= longest.max_seq_len:  # every token spans at least one UTF-8 byte
            return
        tokenizer = longest.api.tokenizer
        at_least = tokenizer.min_tokens(value)
        if at_least > longest.max_seq_len:
            raise ContextTooLong(
                f"value has at least {at_least} tokens ({n_bytes} bytes, at most "
                f"{tokenizer.max_token_bytes} per token); the longest model context is {longest.max_seq_len}",
                detail={"min_tokens": at_least, "bytes": n_bytes, "max_seq_len": longest.max_seq_len},
            )
        got = (self._tokens or TokenSource(None)).get(tokenizer, value, keep_ids=longest.max_seq_len)
        if got is None:
            return  # put off until it is tokenized (settle_tokens stops the operation)
        if got.count > longest.max_seq_len:
            raise ContextTooLong(
                f"value has {got.count} tokens; the longest model context is {longest.max_seq_len}",
                detail={"tokens": got.count, "max_seq_len": longest.max_seq_len},
            )

    def create_variable(self, session: Session, name: str | None, value: str | None) -> Variable:
        size = value_bytes(value)
        self.check_room(session, value_bytes=size)
        var = self.new_variable(session, name, value)
        self.settle_tokens()
        session.variables[var.var_id] = var
        self.charge(session, value_bytes=size)
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
        self.charge(session, value_bytes=size)
        for call in materialise(var, value):
            self.executor.dispatch(call)
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
        self.add_call(session, staged)
        self.charge(session, calls=[staged.call], value_bytes=size)
        self.executor.graph_changed(session.session_id)
        self.start_call(staged.call)
        return staged.call

    def lookup_in(self, session: Session) -> VarLookup:
        """The lookup of plain requests: a binding names a variable by ``var_id`` only."""

        def lookup(b: PlaceholderBinding) -> Variable | None:
            return None if b.var_id is None else self.variable(session, b.var_id)

        return lookup

    def stage_call(
        self,
        session: Session,
        req: SubmitCall,
        lookup: VarLookup,
        *,
        prompt_ids: tuple[int, ...] | None = None,
        samples: int = 1,
    ) -> StagedCall:
        """Validate ``req`` and build its call, unlinked: the session and every
        variable in it are left untouched (outputs that need a fresh variable get
        one in ``StagedCall.new_vars``, outside the session).  ``prompt_ids``: the
        prompt as token ids, filled in place of the template's text; ``samples``: how
        many samples of its last output (:func:`~parrot.manager.dag.graph.add_forks`)."""
        template, bindings = _bound_template(req)
        names = template.names
        check_starts_with_text(template)
        if req.chat:
            check_chat_shape(template)

        longest = self.pool.longest_context(req.model)  # what the prompt must fit
        inputs: dict[str, Variable | str] = {}
        outputs: dict[str, OutputSpec] = {}
        new_vars: list[Variable] = []
        for name in names:
            b = bindings[name]
            if template.direction_of(name) == "input":
                inputs[name] = self._bind_input(b, lookup, longest)
            else:
                outputs[name] = self._bind_output(session, b, lookup, new_vars)

        call = Call(
            new_id("c"),
            session.session_id,
            req.name,
            template,
            inputs,
            outputs,
            model=req.model,
            chat=req.chat,
            tenant=session.tenant,
            cache_salt=cache_salt(session.tenant, self.config.prefix_sharing),
            prompt_ids=prompt_ids,
        )
        if samples > 1:
            new_vars.extend(add_forks(call, samples))
        self._check_rendered_length(call, longest)
        criteria = {n: c for n in outputs if (c := bindings[n].criteria) is not None}
        return StagedCall(call, new_vars, criteria)

    def add_call(self, session: Session, staged: StagedCall) -> None:
        """Put a linked call and its fresh output variables into the session."""
        call = staged.call
        for name, criteria in staged.criteria.items():
            call.outputs[name].var.criteria = criteria
        for var in staged.new_vars:
            session.variables[var.var_id] = var
        session.calls[call.call_id] = call

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

    def _bind_input(
        self, b: PlaceholderBinding, lookup: VarLookup, longest: EngineHandle | None
    ) -> Variable | str:
        var = lookup(b)
        if (var is None) == (b.value is None):
            raise BindingError(
                f"input {b.name!r} needs exactly one of 'var_id' (or a batch 'ref') or 'value'"
            )
        if b.sampling is not None or b.transform is not None or b.criteria is not None:
            raise BindingError(f"input {b.name!r} cannot carry sampling, transform or criteria")
        if b.value is not None:
            self._check_value_length(b.value, longest)
            return b.value
        return var  # type: ignore[return-value]

    def _bind_output(
        self, session: Session, b: PlaceholderBinding, lookup: VarLookup, new_vars: list[Variable]
    ) -> OutputSpec:
        if b.value is not None:
            raise BindingError(f"output {b.name!r} cannot have a value")
        sampling = SamplingParams.from_dict(b.sampling)
        transform = parse_transforms(b.transform)
        var = lookup(b)
        if var is None:
            var = Variable(new_id("v"), session.session_id, name=b.name)
            new_vars.append(var)
        return OutputSpec(b.name, var, sampling, transform)

    def _check_rendered_length(self, call: Call, longest: EngineHandle | None) -> None:
        """Reject at submit a prompt that can never fit, when all inputs are known."""
        if not all(v.state == "ready" for v in call.input_vars()):
            return
        if longest is None:
            return
        try:
            rendered = render(call, longest.api.tokenizer, longest.max_seq_len, self._tokens)
        except NeedsTokenizing:
            return  # put off until it is tokenized (settle_tokens stops the operation)
        call.rendered = PreRendered(longest.model, rendered, longest.max_seq_len)


def value_bytes(value: str | None) -> int:
    """What a client-supplied value counts against its tenant's quota: its UTF-8 bytes."""
    return 0 if value is None else utf8_len(value)


def inline_bytes(req: SubmitCall) -> int:
    """Bytes of the constant inputs a call binds inline."""
    return sum(value_bytes(b.value) for b in req.placeholders)


def _bound_template(req: SubmitCall) -> tuple[Template, dict[str, PlaceholderBinding]]:
    """``req``'s template with every placeholder's direction (its binding's, else the
    template's, else output when the binding samples or transforms) and its bindings by
    name; BindingError for a placeholder without a binding or a binding without one."""
    template = parse_template(req.template)
    bindings = _index_bindings(req.placeholders)
    missing = [n for n in template.names if n not in bindings]
    if missing:
        raise BindingError(f"placeholder(s) {missing} have no binding")
    extra = [n for n in bindings if n not in template.names]
    if extra:
        raise BindingError(f"binding(s) {extra} match no placeholder in the template")
    directions = {}
    for name, b in bindings.items():
        if b.direction is not None:
            directions[name] = b.direction
        elif template.direction_of(name) is None:
            directions[name] = "output" if (b.sampling is not None or b.transform is not None) else "input"
    return template.with_directions(directions), bindings


def _index_bindings(bindings: list[PlaceholderBinding]) -> dict[str, PlaceholderBinding]:
    out: dict[str, PlaceholderBinding] = {}
    for b in bindings:
        if not b.name:
            raise BindingError("a binding has an empty name")
        if b.name in out:
            raise BindingError(f"placeholder {b.name!r} is bound twice")
        out[b.name] = b
    return out


def _caps(stats: EngineStats) -> tuple[int, int, float]:
    """What of an engine's stats decides which queued calls it takes."""
    return (stats.token_capacity, stats.latency_cap_tokens, stats.prefill_tokens_per_decode_step)

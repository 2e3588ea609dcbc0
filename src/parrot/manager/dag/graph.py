"""Sessions, semantic variables and calls, and the DAG that connects them.

Invariants:
- every variable has at most one producer call; a variable with a producer is
  never set by the client;
- the graph is acyclic: a call never consumes, directly or transitively, a
  variable it produces (checked on insertion);
- a variable's state moves pending -> ready or pending -> failed, once;
- a call is *ready* when every input variable is ready; if any input fails,
  the call fails and so do its outputs (and, transitively, everything
  downstream), so no ``get`` waits on work that can never run.

Pure data structures plus waiter notification; no I/O.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from parrot.protocol import clock
from parrot.protocol.errors import CallFailed, Conflict, CycleError, ParrotError
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import TokenLogprob
from parrot.protocol.template import Template

if TYPE_CHECKING:
    from parrot.manager.dag.render import Rendered

VarState = Literal["pending", "ready", "failed"]
CallState = Literal["waiting", "ready", "running", "done", "failed"]
Criteria = Literal["LATENCY", "THROUGHPUT"]

_ids = itertools.count(1)
_SEED_MASK = (1 << 64) - 1
_seqs = itertools.count()


class _Paths:
    """``epoch`` changes whenever linking or unlinking a call changes which calls already in
    the graph are upstream of which (an output bound to a variable that already has
    consumers, or a rolled-back call): what was cached about ancestry before is stale."""

    epoch = 0


def new_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids):x}"


@dataclass(frozen=True)
class PreRendered:
    """A call's engine steps rendered at submit for ``model`` on the engine of that model
    with the longest context (``max_seq_len``), so that the prompt's length is checked
    before the call is accepted and not tokenized again when it is placed there."""

    model: str
    rendered: Rendered
    max_seq_len: int


@dataclass(eq=False)
class Variable:
    var_id: str
    session_id: str
    name: str | None = None
    value: str | None = None
    state: VarState = "pending"
    error: ParrotError | None = None
    producer: Call | None = None
    consumers: list[Call] = field(default_factory=list)
    criteria: Criteria | None = None
    partial: list[str] = field(default_factory=list)  # streamed text of a running producer
    # futures of wait_change() callers; None while nobody waits (most variables, most of the time)
    _waiters: list[asyncio.Future[None]] | None = field(default=None, repr=False)

    def notify(self) -> None:
        waiters = self._waiters
        if waiters is None:
            return
        self._waiters = None
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def change_future(self) -> asyncio.Future[None]:
        """A future that the next change (state or partial text) completes, registered now.

        Registering synchronously is the point: a waiter registered later (in a task that has
        not started yet) misses a change made in between and waits for the one after it.
        Pair with ``forget`` when giving up on it."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = [fut]
        else:
            self._waiters.append(fut)
        return fut

    def forget(self, fut: asyncio.Future[None]) -> None:
        """Drop a ``change_future`` nobody waits on any more."""
        waiters = self._waiters
        if waiters is not None and fut in waiters:
            waiters.remove(fut)

    async def wait_change(self, timeout: float) -> None:
        """Wait until the variable changes (state or partial text) or ``timeout`` passes."""
        fut = self.change_future()
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            self.forget(fut)


@dataclass(eq=False)
class OutputSpec:
    name: str
    var: Variable
    sampling: SamplingParams
    transform: object | None = None  # parrot.protocol.transforms.TransformChain
    # further samples of this output from the same prompt (OpenAI's ``n``): each is
    # generated in an engine context forked from the filled prompt, so the prompt is
    # computed once; only a call's last output has forks, and forks have no consumers
    forks: list[OutputSpec] = field(default_factory=list)
    # of the last run: tokens generated, the engine's reason for stopping, and the
    # tokens' logprobs when the sampling asked for them
    generated_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(eq=False)
class Call:
    call_id: str
    session_id: str
    name: str | None
    template: Template
    inputs: dict[str, Variable | str]  # placeholder -> variable, or a constant
    outputs: dict[str, OutputSpec]
    model: str | None = None
    chat: bool = False
    # its session's tenant, and the salt of its prompt prefixes (parrot.manager.tenants):
    # calls with different salts never share a cached prefix
    tenant: str = "anonymous"
    cache_salt: str = ""
    state: CallState = "waiting"
    error: ParrotError | None = None
    engine_id: str | None = None
    objective: str | None = None  # deduced: "latency" | "throughput"
    task_group: str | None = None
    placement: str | None = None  # the scheduler's reason for its engine
    # its prompt when rendered at submit (inputs already known); dropped once the call
    # ends (the executor has its own copy while it runs)
    rendered: PreRendered | None = None
    # its prefix keys, once final (see parrot.manager.dag.prefix.prefix_keys)
    prefix_cache: tuple[str, ...] | None = field(default=None, repr=False)
    # (_Paths.epoch, effective_producers()) as last computed
    fanin_cache: tuple[int, tuple[str, ...]] | None = field(default=None, repr=False)
    prompt_tokens: int | None = None
    generated_tokens: int = 0
    # of its last run's prompt: tokens whose KV the engine took from its prefix cache, and
    # tokens it computed; None until it runs, or when its engine does not say
    prefix_reused_tokens: int | None = None
    filled_tokens: int | None = None
    # the prompt as token ids (an OpenAI token-id prompt), filled as given in place of
    # the template's text (whose inputs are then empty)
    prompt_ids: tuple[int, ...] | None = None
    submitted_at: float = field(default_factory=clock.wall)
    # submission order, process-wide (a batch's calls in op order): a session's program order
    seq: int = field(default_factory=lambda: next(_seqs), repr=False)
    dispatched_at: float | None = None  # placed on an engine
    started_at: float | None = None
    first_token_at: float | None = None  # the engine's first generated token of this run
    finished_at: float | None = None

    def input_vars(self) -> list[Variable]:
        return [v for v in self.inputs.values() if isinstance(v, Variable)]

    def all_outputs(self) -> list[OutputSpec]:
        """Its outputs and their forks."""
        return [spec for o in self.outputs.values() for spec in (o, *o.forks)]

    def effective_producers(self) -> tuple[str, ...]:
        """Ids of the distinct calls producing this call's inputs, less any that is
        upstream of another of them: its edge to this call is implied by a longer path
        (this call could not start before the other one, which needs it), so only the
        rest can run in parallel.  The in-edges of the DAG's transitive reduction.

        Ancestry is followed through the whole graph, finished calls included, so the
        answer does not change as calls finish; it is cached until a link changes it."""
        cached = self.fanin_cache
        if cached is not None and cached[0] == _Paths.epoch:
            return cached[1]
        producers = list(dict.fromkeys(v.producer for v in self.input_vars() if v.producer is not None))
        if len(producers) > 1:
            upstream = _upstream_of(producers)
            producers = [p for p in producers if p not in upstream]
        ids = tuple(p.call_id for p in producers)
        self.fanin_cache = (_Paths.epoch, ids)
        return ids

    def is_ready(self) -> bool:
        return all(v.state == "ready" for v in self.input_vars())

    def failed_input(self) -> tuple[str, Variable] | None:
        for name, v in self.inputs.items():
            if isinstance(v, Variable) and v.state == "failed":
                return name, v
        return None


@dataclass(eq=False)
class Session:
    session_id: str
    token_hash: bytes
    variables: dict[str, Variable] = field(default_factory=dict)
    calls: dict[str, Call] = field(default_factory=dict)
    created_at: float = field(default_factory=clock.wall)
    closed: bool = False
    # clock.monotonic() of the last request that presented its token (idle sessions expire)
    last_active: float = field(default_factory=clock.monotonic)
    tenant: str = "anonymous"  # whose API key opened it (parrot.manager.tenants)
    value_bytes: int = 0  # client-supplied values it holds (counted against its tenant's quota)


def _upstream_of(calls: list[Call]) -> set[Call]:
    """Every call strictly upstream of at least one of ``calls`` (a walk over producers)."""
    seen: set[Call] = set()
    stack = [v.producer for c in calls for v in c.input_vars() if v.producer is not None]
    while stack:
        call = stack.pop()
        if call in seen:
            continue
        seen.add(call)
        stack.extend(v.producer for v in call.input_vars() if v.producer is not None)
    return seen


def check_no_cycle(inputs: list[Variable], outputs: list[Variable]) -> None:
    """Raise CycleError if any input is reachable downstream from an output."""
    targets = {id(v) for v in inputs}
    seen: set[int] = set()
    stack = list(outputs)
    while stack:
        var = stack.pop()
        if id(var) in targets:
            raise CycleError(
                f"call would consume its own output: variable {var.var_id} ({var.name or 'unnamed'}) "
                "is both produced by it (directly or downstream) and consumed by it"
            )
        if id(var) in seen:
            continue
        seen.add(id(var))
        for consumer in var.consumers:
            stack.extend(o.var for o in consumer.outputs.values())


def link_call(call: Call) -> None:
    """Insert a validated call into the graph (producer/consumer edges)."""
    outs = [o.var for o in call.outputs.values()]
    for var in outs:
        if var.producer is not None:
            raise Conflict(
                f"variable {var.var_id} is already produced by call {var.producer.call_id}",
                code="variable_has_producer",
            )
        if var.state != "pending":
            raise Conflict(
                f"variable {var.var_id} already has a value; it cannot be a call's output",
                code="variable_has_value",
            )
    if len({id(v) for v in outs}) != len(outs):
        raise Conflict("one variable bound to two outputs of the same call", code="variable_has_producer")
    check_no_cycle(call.input_vars(), outs)
    if any(var.consumers for var in outs):  # calls already in the graph get a new producer
        _Paths.epoch += 1
    for var in outs:
        var.producer = call
    for var in dict.fromkeys(call.input_vars()):
        var.consumers.append(call)


def unlink_call(call: Call) -> None:
    """Undo :func:`link_call` for a call that is in no session yet, so nothing
    else refers to it (a rejected batch removes the edges of its calls)."""
    _Paths.epoch += 1
    for out in call.outputs.values():
        out.var.producer = None
    for var in dict.fromkeys(call.input_vars()):
        var.consumers.remove(call)


def materialise(var: Variable, value: str) -> list[Call]:
    """Set a variable's value; returns consumer calls that became ready."""
    if var.state != "pending":
        raise Conflict(f"variable {var.var_id} is already {var.state}", code="variable_not_pending")
    var.value = value
    var.state = "ready"
    var.notify()
    ready = []
    for call in var.consumers:
        if call.state == "waiting" and call.is_ready():
            call.state = "ready"
            ready.append(call)
    return ready


def fail_call(call: Call, error: ParrotError) -> None:
    """Fail a call, its pending outputs and everything downstream of them."""
    stack: list[tuple[Call, ParrotError]] = [(call, error)]
    while stack:
        c, err = stack.pop()
        if c.state in ("done", "failed"):
            continue
        c.state = "failed"
        c.error = err
        c.finished_at = clock.wall()
        for out in c.all_outputs():
            var = out.var
            if var.state != "pending":
                continue
            var.state = "failed"
            var.error = err
            var.notify()
            for consumer in var.consumers:
                downstream = CallFailed(
                    f"input {var.name or var.var_id!r} of call {consumer.name or consumer.call_id} failed: "
                    f"{err.message}",
                    code=err.code,
                    detail={"origin_call": c.call_id, **err.detail},  # keeps the root cause
                )
                stack.append((consumer, downstream))


def add_forks(call: Call, n: int) -> list[Variable]:
    """Give the call's last output ``n - 1`` forks (so ``n`` samples in all) and return
    their fresh variables.  Fork ``i``'s sampling is the output's with seed ``seed + i``
    (mod 2**64) when it has a seed, so a seeded request is reproducible and its samples
    differ."""
    last = next(o for o in reversed(list(call.outputs.values())))
    new_vars: list[Variable] = []
    for i in range(1, n):
        seed = last.sampling.seed
        sampling = last.sampling if seed is None else replace(last.sampling, seed=(seed + i) & _SEED_MASK)
        var = Variable(new_id("v"), call.session_id, name=f"{last.name}#{i}")
        var.producer = call
        last.forks.append(OutputSpec(var.name or last.name, var, sampling, last.transform))
        new_vars.append(var)
    return new_vars


def fail_variable(var: Variable, error: ParrotError) -> None:
    """Fail a producer-less pending variable (e.g. its session closed) and its consumers."""
    if var.state != "pending":
        return
    var.state = "failed"
    var.error = error
    var.notify()
    for consumer in var.consumers:
        fail_call(
            consumer, CallFailed(f"input {var.name or var.var_id!r} failed: {error.message}", code=error.code)
        )

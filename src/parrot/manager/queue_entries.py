"""What the scheduler sees of each queued call: the executor's :class:`Ticket` of a call
and the :class:`~parrot.manager.sched.scheduler.QueuedCall` a round builds from it.

:class:`QueueEntries` sizes a queued call (its KV tokens: prompt, new tokens and forks'
tokens, at most one context, less the start it shares with other calls, which is
counted once per engine), picks the prefix keys that place it (its affinity keys),
attaches its deduced objective and its rank in the queue, and renders its prompt into
engine steps once per model.  The executor (:mod:`parrot.manager.executor`) queues,
places, runs and retries the calls; this module only describes them.

Invariants:

- a ticket's estimate, shared prefix and affinity keys are computed once, by the first
  round that sees it (a queued call's inputs are final), and kept across re-runs;
- its QueuedCall is rebuilt only when its objective, tokens or rank changed, so a round
  over an unchanged queue reuses every entry;
- a call is rendered at most once per model (one model, one tokenizer: the same tokens);
- long prompt text is never tokenized here, on the event loop: rendering raises
  NeedsTokenizing with the text recorded in ``ticket.token_source``, and the executor
  tokenizes it off the loop before a later round (or the run) renders again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from parrot.manager.backends.pool import EngineHandle, EnginePool
from parrot.manager.dag.graph import Call
from parrot.manager.dag.objective_cache import ObjectiveCache
from parrot.manager.dag.render import Rendered, render
from parrot.manager.dag.shared_start import SharedStarts
from parrot.manager.dag.tokens import NeedsTokenizing, TokenSource
from parrot.manager.sched.engine_loads import EngineLoads, PlacedShare
from parrot.manager.sched.queue_order import QueueOrder
from parrot.manager.sched.scheduler import QueuedCall
from parrot.protocol import clock
from parrot.protocol.errors import ContextTooLong

__all__ = ["REQUEST_LEVEL_POLICIES", "QueueEntries", "Ticket"]

REQUEST_LEVEL_POLICIES = ("baseline-latency", "baseline-throughput")
"""The policies that model request-level servers: no prefix sharing beyond a system
prompt, and calls ranked by their own arrival rather than their application's."""


@dataclass(eq=False)
class Ticket:
    """Executor-side state of one ready or running call."""

    call: Call
    arrival: int  # when it was first queued, in the executor's order of queueing
    queued_at: float = field(default_factory=clock.monotonic)
    tokens: int | None = None  # estimated KV tokens of its own: prompt + max new tokens, less shared_prefix's
    # (key, tokens) of the start of its prompt that it shares with other calls (a system prompt, a
    # fan-out's common context: parrot.manager.dag.shared_start), counted once per engine
    shared_prefix: tuple[str, int] | None = None
    rendered: dict[str, Rendered] = field(default_factory=dict)  # by model
    attempts: int = 0
    lost: str | None = None  # why the last engine was lost
    retry_deadline: float | None = None
    engine: EngineHandle | None = None
    share: PlacedShare | None = None  # its share of the engine's load while placed
    prefix_keys: tuple[str, ...] = ()
    # the keys the scheduler places it by: those with at least min_prefix_tokens tokens before
    # them (set with its estimate; a shorter shared start saves less than it costs to pile its
    # sharers onto one engine)
    affinity_keys: tuple[str, ...] = ()
    # those keys with the share of the prompt before each (parrot.manager.dag.prefix.key_shares)
    key_shares: list[tuple[str, float]] = field(default_factory=list)
    started: bool = False  # its task began running (a task cancelled before that never runs at all)
    priority: int = 0  # its generations' priority, for an engine that orders by it (set when placed)
    queued: QueuedCall | None = None  # what the last round saw (reused while nothing changes)
    token_source: TokenSource | None = None  # its long prompt text, tokenized off the loop first
    tokenizing: asyncio.Task[None] | None = None  # while that runs, rounds pass the call over


class QueueEntries:
    """Builds the scheduler's view of queued calls from their tickets (see the module
    docstring).  It reads the executor's parts it is given and changes only tickets
    (and a call's ``objective`` and ``task_group``, which clients see)."""

    def __init__(
        self,
        pool: EnginePool,
        loads: EngineLoads,
        shared_starts: SharedStarts,
        objectives: ObjectiveCache,
        order: QueueOrder,
        *,
        min_prefix_tokens: int,
        inline_tokenize_bytes: int | None,
    ):
        self.pool = pool
        self.loads = loads
        self.shared_starts = shared_starts
        self.objectives = objectives
        self.order = order
        self.min_prefix_tokens = min_prefix_tokens
        self.inline_tokenize_bytes = inline_tokenize_bytes

    def entry(self, ticket: Ticket, *, fifo_by_app: bool, request_level: bool) -> QueuedCall:
        """What the scheduler sees of ``ticket``'s call this round (reused while nothing
        changed); raises NeedsTokenizing while its prompt holds long text not tokenized
        yet.  ``fifo_by_app``: rank it by its application's arrival, else its own;
        ``request_level``: size it as a request-level baseline would
        (:data:`REQUEST_LEVEL_POLICIES`)."""
        call = ticket.call
        tokens = self.estimate(ticket, request_level)
        objective = self.objectives.of(call)
        call.objective, call.task_group = objective.kind, objective.task_group
        rank = self.order.rank(call, ticket.arrival, fifo_by_app)
        shared, shared_tokens = ticket.shared_prefix, 0
        if shared is not None and not self.loads.prefix_running(shared[0]):
            shared_tokens = shared[1]  # no engine holds its shared prefix yet: placing it brings it
            tokens += shared_tokens
        queued = ticket.queued
        if (
            queued is None
            or queued.objective is not objective
            or queued.tokens != tokens
            or queued.topo_rank != rank
        ):
            new_tokens = sum(o.sampling.max_tokens for o in call.outputs.values())
            queued = ticket.queued = QueuedCall(
                call.call_id,
                call.model,
                objective,
                ticket.affinity_keys,
                tokens,
                rank,
                new_tokens,
                shared_tokens,
            )
        return queued

    def estimate(self, ticket: Ticket, request_level: bool) -> int:
        """The KV tokens ``ticket``'s call holds of its own (at least 1), computed once,
        with its shared prefix and affinity keys.  1 while no engine serves its model
        (the round's unservable check fails or holds it)."""
        if ticket.tokens is None:
            call = ticket.call
            new_tokens = sum(o.sampling.max_tokens for o in call.outputs.values())
            if call.rendered is not None:  # rendered at submit for the longest-context engine
                rendered, max_len = call.rendered.rendered, call.rendered.max_seq_len
            else:
                longest = self.pool.longest_context(call.model)
                if longest is None:
                    return 1  # no engine yet: unservable() says so
                rendered, max_len = self.rendered(ticket, longest), longest.max_seq_len
            constant = rendered.constant_prefix
            if request_level:
                # the request-level baselines model servers without prefix sharing: each
                # request holds its own copy of everything but a system prompt
                if constant is not None and constant[1] >= self.min_prefix_tokens:
                    ticket.shared_prefix = constant
            else:
                ticket.shared_prefix = self.shared_starts.prefix(
                    ticket.key_shares, rendered.first_fill_tokens, constant
                )
            ticket.affinity_keys = self.affinity_keys(ticket, rendered.first_fill_tokens, constant)
            shared = ticket.shared_prefix[1] if ticket.shared_prefix else 0
            # engines stop generating at their context: a call never holds more than that
            # forks (n samples) share the prompt and add their own tokens; the scheduler
            # measures a call against one context's length, so the estimate stops there and
            # the engine's own admission paces forks that would hold more
            forks = sum(f.sampling.max_tokens for o in call.outputs.values() for f in o.forks)
            total = min(rendered.prompt_tokens + new_tokens + forks, max_len)
            ticket.tokens = max(1, total - shared)
        return ticket.tokens

    def affinity_keys(
        self, ticket: Ticket, prompt_tokens: int, constant: tuple[str, int] | None
    ) -> tuple[str, ...]:
        """The prefix keys that place ``ticket``'s call: those with at least
        ``min_prefix_tokens`` tokens of the prompt before them (``prompt_tokens``: its
        tokens before its first output; ``constant``: (key, exact tokens) of its leading
        constant text).  Sharing a start shorter than that saves a few tokens of prompt
        work once per engine; placing every call that shares it (a one-line instruction
        at the head of each map of every map-reduce app) on the engine that holds it
        piles them all onto that engine while others idle.  Without shares (a prompt
        whose keys could not be measured), every key places it, as before."""
        if not ticket.key_shares:
            return ticket.prefix_keys
        exact = dict([constant]) if constant is not None else {}
        return tuple(
            key
            for key, share in ticket.key_shares
            if exact.get(key, round(prompt_tokens * share)) >= self.min_prefix_tokens
        )

    async def render_on(self, ticket: Ticket, handle: EngineHandle) -> Rendered:
        """:meth:`rendered`, tokenizing long text off the loop first if need be (a call
        placed on an engine of another model than the one its round rendered it for)."""
        while True:
            try:
                return self.rendered(ticket, handle)
            except NeedsTokenizing:
                assert ticket.token_source is not None
                await ticket.token_source.resolve()

    def rendered(self, ticket: Ticket, handle: EngineHandle) -> Rendered:
        """The call's engine steps for ``handle``'s model, rendered once per model; raises
        NeedsTokenizing when long text of its prompt must first be tokenized off the loop
        (recorded in ``ticket.token_source``), ContextTooLong when a prompt rendered for
        another engine of the model does not fit ``handle``'s context."""
        pre = ticket.call.rendered  # done at submit, when the inputs were already known
        if pre is not None and pre.model == handle.model and handle.model not in ticket.rendered:
            ticket.rendered[handle.model] = pre.rendered
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

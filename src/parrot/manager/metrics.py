"""The manager's Prometheus metrics (``GET /metrics``, :mod:`parrot.manager.api.metrics`).

Two kinds, in one :class:`~prometheus_client.CollectorRegistry` per
:class:`ManagerMetrics` (so several managers in one process never share a
series):

* events, counted where they happen: HTTP requests (by route template, method
  and status class, :class:`RequestCounter`), each call's wait in the
  manager's queue (observed when it is placed), its time to first token and
  time per output token (observed by :func:`~parrot.manager.call_driver.drive`);
* state, read at scrape time by :class:`StateCollector`: calls of open
  sessions by state and objective, the queue's length, sessions, engines and
  each engine's stats (KV blocks, load, and its own counters of filled,
  prefix-reused and generated tokens as of its last heartbeat).

Invariant: no label value carries anything a client sent (no prompt, value,
session, call, tenant or key): routes are labelled by their template,
engines by their id, calls by their state and deduced objective only.  Label
sets are therefore bounded by the routes, the engines and the call states.

The executor and the call driver import this module, so it imports nothing of the
manager's core: what it reads of a manager is the :class:`ObservedManager` protocol
(:class:`~parrot.manager.service.Manager` is one), not the class itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from parrot.manager.backends.pool import EngineHandle
    from parrot.manager.dag.graph import Session
    from parrot.manager.sched.engine_loads import EngineLoads

__all__ = [
    "CALL_STATES",
    "ManagerMetrics",
    "ObservedManager",
    "ObservedQueue",
    "StateCollector",
    "status_class",
]

CALL_STATES = ("waiting", "ready", "running", "done", "failed")
NO_OBJECTIVE = "none"
"""The objective label of a call not yet deduced (still waiting for its inputs)."""

QUEUE_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)


class ObservedQueue(Protocol):
    """What a scrape reads of the manager's executor: its queue's length and the loads
    of the calls it placed."""

    @property
    def queued(self) -> int: ...

    @property
    def loads(self) -> EngineLoads: ...


class ObservedManager(Protocol):
    """What a scrape reads of a manager (:class:`~parrot.manager.service.Manager` is
    one): its open sessions, its engines and its executor.  Read-only, on the event loop."""

    @property
    def sessions(self) -> Mapping[str, Session]: ...

    @property
    def pool(self) -> Iterable[EngineHandle]: ...

    @property
    def executor(self) -> ObservedQueue: ...


def status_class(status: int) -> str:
    """``"2xx"`` for 200-299 and so on: the status label (one series per class, not per code)."""
    return f"{status // 100}xx"


class ManagerMetrics:
    """The registry of one manager, its event metrics, and :meth:`render` for a scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "parrot_http_requests",
            "HTTP requests answered, by route template, method and status class.",
            ["endpoint", "method", "status"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "parrot_queue_wait_seconds",
            "Time a ready call waited in the manager's queue before it was placed on an engine.",
            ["engine"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "parrot_time_to_first_token_seconds",
            "Time from a call's placement on an engine to its first generated token "
            "(rendering, filling the prompt, waiting in the engine's batch).",
            ["engine"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "parrot_time_per_output_token_seconds",
            "Per generated output: (last token's time - first token's time) / (tokens - 1).",
            ["engine"],
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )

    def watch(self, manager: ObservedManager) -> None:
        """Read ``manager``'s state at every scrape (call once per manager)."""
        self.registry.register(StateCollector(manager))

    def request(self, endpoint: str, method: str, status: int) -> None:
        self.requests.labels(endpoint, method, status_class(status)).inc()

    def placed(self, engine_id: str, waited_s: float) -> None:
        self.queue_wait.labels(engine_id).observe(max(waited_s, 0.0))

    def first_token(self, engine_id: str, seconds: float) -> None:
        self.ttft.labels(engine_id).observe(max(seconds, 0.0))

    def output_done(self, engine_id: str, tokens: int, first_at: float, last_at: float) -> None:
        """One output finished generating ``tokens`` tokens, the first at ``first_at`` and
        the last at ``last_at`` (seconds, one clock); fewer than two tokens have no gap."""
        if tokens >= 2:
            self.tpot.labels(engine_id).observe(max(last_at - first_at, 0.0) / (tokens - 1))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric, as of now."""
        return generate_latest(self.registry)


_ENGINE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("kv_blocks_used", "parrot_engine_kv_blocks_used", "KV-cache blocks held by the engine's contexts."),
    ("kv_blocks_total", "parrot_engine_kv_blocks_total", "KV-cache blocks the engine has."),
    (
        "kv_blocks_cached",
        "parrot_engine_kv_blocks_cached",
        "Blocks no context holds that the prefix cache keeps (reclaimable).",
    ),
    ("token_load", "parrot_engine_token_load", "KV tokens of the engine's running work."),
    ("token_capacity", "parrot_engine_token_capacity", "The most KV tokens its running work may hold."),
    ("num_running", "parrot_engine_requests_running", "Requests the engine is running."),
    ("num_waiting", "parrot_engine_requests_waiting", "Requests waiting in the engine's own queue."),
)
_ENGINE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("filled_tokens", "parrot_engine_filled_tokens", "Prompt tokens the engine was asked to fill."),
    (
        "cached_tokens",
        "parrot_engine_prefix_reused_tokens",
        "Of the filled tokens, those whose KV came from the prefix cache instead of being computed.",
    ),
    ("generated_tokens", "parrot_engine_generated_tokens", "Tokens the engine generated."),
    ("preemptions", "parrot_engine_preemptions", "Requests the engine preempted to free KV blocks."),
)


class StateCollector(Collector):
    """Gauges (and the engines' own counters) read from a manager at scrape time.

    Runs on the event loop (the scrape's handler calls it there), so it reads a
    consistent state without locks; its cost is one pass over the calls of open
    sessions plus a constant per engine."""

    def __init__(self, manager: ObservedManager):
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        m = self.manager
        yield from self._calls()
        yield _gauge("parrot_sessions", "Open sessions.", len(m.sessions))
        yield _gauge("parrot_queue_length", "Ready calls waiting in the manager's queue.", m.executor.queued)
        engines = GaugeMetricFamily("parrot_engines", "Registered engines, by liveness.", labels=["alive"])
        handles = list(m.pool)
        alive = sum(h.alive for h in handles)
        engines.add_metric(["true"], alive)
        engines.add_metric(["false"], len(handles) - alive)
        yield engines
        info = GaugeMetricFamily(
            "parrot_engine_info", "Each registered engine (value 1).", labels=["engine", "name", "model"]
        )
        for h in handles:
            info.add_metric([h.engine_id, h.name or "", h.model], 1)
        yield info
        yield from _per_engine(handles, _ENGINE_GAUGES, GaugeMetricFamily)
        yield from _per_engine(handles, _ENGINE_COUNTERS, CounterMetricFamily)
        usage = m.executor.loads.usage
        placed = GaugeMetricFamily(
            "parrot_engine_placed_token_load",
            "The manager's estimate of the KV tokens of the calls it placed on the engine.",
            labels=["engine"],
        )
        for h in handles:
            use = usage.get(h.engine_id)
            placed.add_metric([h.engine_id], use.load if use is not None else 0)
        yield placed

    def _calls(self) -> Iterator[Metric]:
        counts: dict[tuple[str, str], int] = {}
        for session in self.manager.sessions.values():
            for call in session.calls.values():
                key = (call.state, call.objective or NO_OBJECTIVE)
                counts[key] = counts.get(key, 0) + 1
        family = GaugeMetricFamily(
            "parrot_calls",
            "Calls of open sessions, by state and deduced objective.",
            labels=["state", "objective"],
        )
        for state in CALL_STATES:  # every state present, so a dashboard sees zeros
            if not any(s == state for s, _ in counts):
                counts[(state, NO_OBJECTIVE)] = 0
        for (state, objective), n in sorted(counts.items()):
            family.add_metric([state, objective], n)
        yield family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _per_engine(
    handles: list[EngineHandle], specs: tuple[tuple[str, str, str], ...], kind: Callable[..., Metric]
) -> Iterator[Metric]:
    """One family per (stats field, metric name, help) of ``specs``, a sample per engine."""
    for key, name, doc in specs:
        family = kind(name, doc, labels=["engine"])
        for h in handles:
            family.add_metric([h.engine_id], getattr(h.stats, key))
        yield family

"""What the manager has placed on each engine, and the scheduler's view of the pool.

:class:`EngineLoads` keeps, per engine, the load of the calls placed there
(:class:`EngineUsage`: KV tokens they will hold, running calls per objective and
task group, shared prefixes counted once) and turns it, with what the pool says
of each engine (alive, token capacity, latency cap) and the prefixes recently
placed there, into :class:`~parrot.manager.sched.scheduler.EngineSnapshot` objects.

The scheduler's engine state is kept between rounds
(:class:`~parrot.manager.sched.scheduler.Scheduler`): :meth:`EngineLoads.sync` gives
a new snapshot only to engines whose usage, recent prefixes or pool state
changed, so a round sees exactly what :meth:`EngineLoads.snapshots` returns, as
if the pure ``schedule(queue, snapshots, config)`` were called.

Invariant: an engine's usage is the sum of the shares of the calls placed there
and not yet finished (every :meth:`account` ``+1`` is matched by one ``-1``);
a shared prefix adds its tokens once, while at least one such call is there: the
tokens the call that brought it counted (calls sharing a start may estimate its
tokens differently), taken away when the last such call leaves, so the load
returns to exactly zero.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

from parrot.manager.backends.pool import EngineHandle, EnginePool
from parrot.manager.dag.prefix import PrefixIndex
from parrot.manager.sched.scheduler import (
    DEFAULT_LATENCY_CAP_TOKENS,
    EngineSnapshot,
    Scheduler,
    SchedulerConfig,
)
from parrot.protocol.errors import NotFound

__all__ = ["EngineLoads", "EngineUsage", "PlacedShare"]

log = logging.getLogger(__name__)

# Stamps of placements (EngineSnapshot.last_assigned): increasing in placement order, process-wide.
_assignments = itertools.count(1)


@dataclass
class EngineUsage:
    """Manager-side load of one engine: what the calls placed there will hold."""

    load: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # objective -> running calls
    groups: dict[str, int] = field(default_factory=dict)  # task group -> running calls
    prefixes: dict[str, int] = field(default_factory=dict)  # shared prefix key -> running calls
    prefix_tokens: dict[str, int] = field(default_factory=dict)  # shared prefix key -> tokens it added
    group_set: frozenset[str] = frozenset()  # the keys of ``groups``, rebuilt when they change
    last_assigned: int = 0  # stamp of the last call placed there (0: none yet); ties go to the oldest

    @property
    def mode(self) -> str | None:
        if self.kinds.get("latency", 0) > 0:
            return "latency"
        return "throughput" if self.kinds.get("throughput", 0) > 0 else None


@dataclass(frozen=True)
class PlacedShare:
    """One placed call's share of its engine's load."""

    tokens: int  # KV tokens of its own (prompt + new tokens, less the shared prefix)
    shared_prefix: tuple[str, int] | None  # (key, tokens) counted once per engine
    objective: str  # "latency" | "throughput"
    task_group: str | None


def _count(counts: dict[str, int], key: str, sign: int) -> int:
    """Add ``sign`` to ``counts[key]``, dropping the key at zero; returns the new count."""
    n = counts.get(key, 0) + sign
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)
    return n


class EngineLoads:
    def __init__(self, pool: EnginePool, prefixes: PrefixIndex, default_capacity: int):
        self.pool = pool
        self.prefixes = prefixes
        self.default_capacity = default_capacity
        self.usage: dict[str, EngineUsage] = {}  # engine id -> load of the calls placed there
        # Kept between rounds: the scheduler, told of engines whose snapshot changed — their
        # usage or prefixes (stale), or what the pool says of them (seen: handle, alive,
        # capacity, latency cap, as of the last round).
        self.sched: Scheduler | None = None
        self._pool_seen: list[tuple[EngineHandle, bool, int, int]] = []
        self._pool_version = -1  # the pool's version when _pool_seen was read
        self._seen: dict[str, tuple[EngineHandle, bool, int, int]] = {}
        self._stale: set[str] = set()
        self._prefix_engines: dict[str, int] = {}  # shared prefix key -> engines running a call with it

    def prefix_running(self, key: str) -> bool:
        """Whether some engine runs a call that counts the shared prefix ``key``."""
        return key in self._prefix_engines

    def account(self, engine_id: str, share: PlacedShare, sign: int) -> None:
        """Add (+1) or remove (-1) a placed call's share of its engine's load."""
        use = self.usage.get(engine_id)
        if use is None:
            use = self.usage[engine_id] = EngineUsage()
        self._stale.add(engine_id)
        use.load += sign * share.tokens
        if sign > 0:
            use.last_assigned = next(_assignments)
        if share.shared_prefix is not None:
            key, n = share.shared_prefix
            count = _count(use.prefixes, key, sign)
            if sign > 0 and count == 1:  # the first call of an engine brings the prefix
                use.prefix_tokens[key] = n
                use.load += n
                _count(self._prefix_engines, key, sign)
            elif sign < 0 and count == 0:  # and the last takes what it added
                use.load -= use.prefix_tokens.pop(key, n)
                _count(self._prefix_engines, key, sign)
        use.kinds[share.objective] = use.kinds.get(share.objective, 0) + sign
        group = share.task_group
        if group:
            count = _count(use.groups, group, sign)
            if (count > 0) != (group in use.group_set):
                use.group_set = frozenset(use.groups)

    def engine_dropped(self, engine_id: str) -> None:
        use = self.usage.pop(engine_id, None)
        for key in use.prefixes if use is not None else ():
            _count(self._prefix_engines, key, -1)
        self._stale.add(engine_id)

    def sync(self, config: SchedulerConfig) -> Scheduler:
        """Bring the scheduler's engine snapshots up to date; rebuild only those that changed."""
        sched = self.sched
        if sched is None or sched.config is not config:  # (re)configured: start over
            sched = self.sched = Scheduler(config)
            self._pool_seen = []
            self._pool_version = -1
            self._seen.clear()
        stale = self._stale
        stale.update(self.prefixes.take_changed())
        # An engine joining or leaving, suspected or back, or reporting another capacity,
        # latency cap or prompt cost bumps the pool's version: while that stands, nothing
        # the pool says of its engines has changed
        if self.pool.version != self._pool_version:
            self._pool_version = self.pool.version
            self._read_pool(sched, stale)
        if stale:
            for eid in stale:
                try:
                    h = self.pool.get(eid)
                except NotFound:  # dropped
                    self._seen.pop(eid, None)
                    sched.remove_engine(eid)
                    continue
                sched.set_engine(self.snapshot(h))
            stale.clear()
        return sched

    def _read_pool(self, sched: Scheduler, stale: set[str]) -> None:
        """What the pool says of each engine: marks the engines whose entry changed stale and
        removes from ``sched`` those that left."""
        default = self.default_capacity
        pool_now = [
            (
                h,
                h.alive,
                h.stats.token_capacity or default,
                h.stats.latency_cap_tokens,
                h.stats.prefill_tokens_per_decode_step,
            )
            for h in self.pool
        ]
        if pool_now == self._pool_seen:
            return
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

    def snapshot(self, h: EngineHandle) -> EngineSnapshot:
        use = self.usage.get(h.engine_id) or EngineUsage()
        if use.load < 0:  # a bookkeeping bug: say so, and keep scheduling (a snapshot refuses it)
            log.error("engine %s: the manager's load for it fell to %d; counted as 0", h.engine_id, use.load)
            use.load = 0
        return EngineSnapshot(
            engine_id=h.engine_id,
            model=h.model,
            max_seq_len=h.max_seq_len,
            token_capacity=h.stats.token_capacity or self.default_capacity,
            token_load=use.load,
            mode=use.mode,  # type: ignore[arg-type]
            task_groups=use.group_set,
            prefixes=self.prefixes.keys_on(h.engine_id),
            alive=h.alive,
            latency_cap_tokens=h.stats.latency_cap_tokens or DEFAULT_LATENCY_CAP_TOKENS,
            last_assigned=use.last_assigned,
            latency_calls=use.kinds.get("latency", 0),
            prefill_tokens_per_step=h.stats.prefill_tokens_per_decode_step,
        )

    def snapshots(self) -> list[EngineSnapshot]:
        """What the scheduler knows of each engine in the pool, built afresh."""
        return [self.snapshot(h) for h in self.pool]

"""The scheduler's vocabulary: what it reads (engine snapshots, queued calls, its
configuration) and what it decides (placements).  Plain frozen data, checked on
construction; see :mod:`parrot.manager.sched.scheduler` for the round and
:mod:`parrot.manager.sched.policies` for what each policy decides."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from parrot.manager.dag.objectives import CallObjective

Mode = Literal["latency", "throughput"]
Policy = Literal["parrot", "no-affinity", "no-deduction", "baseline-latency", "baseline-throughput"]
POLICIES: tuple[Policy, ...] = (
    "parrot",
    "no-affinity",
    "no-deduction",
    "baseline-latency",
    "baseline-throughput",
)
Reason = Literal[
    "task-group",
    "task-group-spill",
    "prefix-spill",
    "prefix-queued",
    "prefix-engine",
    "find-engine",
    "find-engine-mixed",
    "fifo",
]
CapScope = Literal["mixed", "all"]
CAP_SCOPES: tuple[CapScope, ...] = ("mixed", "all")
MODES = ("latency", "throughput", None)

DEFAULT_LATENCY_CAP_TOKENS = 6144
"""An engine's latency cap when it reports none: the paper's figure (LLaMA-13B, A100)."""

DEFAULT_PREFILL_TOKENS_PER_STEP = 24.0
"""Prompt tokens that cost one unloaded decode step, for an engine that measured none
(SmolLM2 on a 2-core Xeon before prompt attention ran on AMX tiles; a GPU: a few hundred)."""

IN_ROUND = 1 << 62
"""Recency of the first placement of a round: above every snapshot's ``last_assigned``."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What the scheduler knows of one engine at the start of a round.

    ``mode`` is the kind of work it runs now: ``"latency"`` if any running
    call is latency-sensitive (its cap is then ``cap_L``), ``"throughput"`` if
    it runs only throughput work, None if idle.  ``token_load`` counts KV
    tokens of work running or already assigned there.  ``latency_cap_tokens``
    is the engine's own latency cap (measured by the engine; the paper's
    6,144 for one that reports none); ``prefill_tokens_per_step`` how many prompt
    tokens cost one of its unloaded decode steps (measured by the engine; 0:
    unknown, the scheduler's default applies).  ``last_assigned``: when the engine was
    last given a call, on the caller's monotone clock (0: never; must stay
    below 2**62); of two equally loaded engines the smaller value wins.
    """

    engine_id: str
    model: str
    max_seq_len: int
    token_capacity: int
    token_load: int = 0
    mode: Mode | None = None
    task_groups: frozenset[str] = frozenset()
    prefixes: frozenset[object] = frozenset()
    alive: bool = True
    latency_cap_tokens: int = DEFAULT_LATENCY_CAP_TOKENS
    last_assigned: int = 0
    latency_calls: int = 0
    prefill_tokens_per_step: float = 0.0

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError("engine_id must be non-empty")
        if self.max_seq_len <= 0 or self.token_capacity <= 0:
            raise ValueError(f"engine {self.engine_id}: max_seq_len and token_capacity must be positive")
        if self.token_load < 0:
            raise ValueError(f"engine {self.engine_id}: token_load must be >= 0")
        if self.mode not in MODES:
            raise ValueError(f"engine {self.engine_id}: mode must be one of {MODES}, got {self.mode!r}")
        if self.latency_cap_tokens <= 0:
            raise ValueError(f"engine {self.engine_id}: latency_cap_tokens must be positive")
        if not 0 <= self.last_assigned < IN_ROUND:
            raise ValueError(f"engine {self.engine_id}: last_assigned must lie in [0, 2**62)")
        if self.latency_calls < 0:
            raise ValueError(f"engine {self.engine_id}: latency_calls must be >= 0")
        if not (math.isfinite(self.prefill_tokens_per_step) and self.prefill_tokens_per_step >= 0):
            raise ValueError(f"engine {self.engine_id}: prefill_tokens_per_step must be finite and >= 0")


@dataclass(frozen=True, slots=True)
class QueuedCall:
    """A ready call waiting for an engine.

    ``model`` None: any engine.  ``prefix_hashes``: hashes of the prompt's
    prefixes at variable boundaries that prefix affinity places it by, outermost
    (shortest) first (the executor passes those with at least ``min_prefix_tokens``
    tokens before them).  ``tokens``:
    estimated KV tokens (prompt + max new tokens).  ``topo_rank``: an integer
    order in which producers come before consumers (then arrival).  ``new_tokens``:
    the part of ``tokens`` it generates (the rest is prompt).  ``shared_tokens``: the part of
    ``tokens`` that is a shared prefix no engine runs now (placing the call brings it; it
    is computed once per engine and then read from the engine's prefix cache, so it is
    load, but not this call's own prompt work).
    """

    call_id: str
    model: str | None
    objective: CallObjective
    prefix_hashes: tuple[object, ...] = ()
    tokens: int = 1
    topo_rank: int = 0
    new_tokens: int = 0
    shared_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.call_id:
            raise ValueError("call_id must be non-empty")
        if self.tokens <= 0:
            raise ValueError(f"call {self.call_id}: tokens must be positive, got {self.tokens}")
        if self.new_tokens < 0:
            raise ValueError(f"call {self.call_id}: new_tokens must be >= 0, got {self.new_tokens}")
        if not 0 <= self.shared_tokens <= self.tokens:
            raise ValueError(
                f"call {self.call_id}: shared_tokens must be in 0..tokens ({self.tokens}), "
                f"got {self.shared_tokens}"
            )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """``policy``: which policy object decides (:mod:`parrot.manager.sched.policies`,
    built once per scheduler).  ``latency_cap_tokens``: the operator's latency cap for
    every engine (None: each engine's own, ``EngineSnapshot.latency_cap_tokens``);
    ``throughput_cap``: the same for throughput work (None: each engine's token capacity).
    ``latency_cap_scope``: what the latency cap bounds under the non-baseline policies,
    ``"all"`` (every engine running latency work: the paper's rule, the default) or
    ``"mixed"`` (only latency and throughput work meeting on an engine).
    ``affinity_spill``: a task group or the sharers of a prefix may spread to a less loaded
    engine (steps 1 and 2 of docs/scheduling.md, "The algorithm").  ``pack_latency``: a
    latency-sensitive call goes to the most loaded engine running latency work that has
    room for it under the latency cap, and to an idle engine only when none has, so
    latency work fills as few engines as its cap allows and the others stay free for
    throughput work (step 3 there).  ``saturation_batching`` (under the scope ``"all"``
    only): while latency calls queue, an engine running latency work takes them up to the
    batch that finishes them soonest on average (:mod:`parrot.manager.sched.saturation`),
    which may exceed the latency cap; ``prefill_tokens_per_step``: how many prompt tokens
    cost one unloaded decode step on every engine, the figure that batch size rests on
    (None: each engine's own, ``EngineSnapshot.prefill_tokens_per_step``, else
    :data:`DEFAULT_PREFILL_TOKENS_PER_STEP`)."""

    policy: Policy = "parrot"
    latency_cap_tokens: int | None = None
    throughput_cap: int | None = None
    latency_cap_scope: CapScope = "all"
    affinity_spill: bool = False
    saturation_batching: bool = False
    pack_latency: bool = False
    prefill_tokens_per_step: float | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.latency_cap_scope not in CAP_SCOPES:
            raise ValueError(f"latency_cap_scope must be one of {CAP_SCOPES}, got {self.latency_cap_scope!r}")
        if self.latency_cap_tokens is not None and self.latency_cap_tokens <= 0:
            raise ValueError("latency_cap_tokens must be positive (or None)")
        if self.throughput_cap is not None and self.throughput_cap <= 0:
            raise ValueError("throughput_cap must be positive (or None)")
        if self.prefill_tokens_per_step is not None and not (
            math.isfinite(self.prefill_tokens_per_step) and self.prefill_tokens_per_step > 0
        ):
            raise ValueError("prefill_tokens_per_step must be positive (or None)")


@dataclass(frozen=True, slots=True)
class Placement:
    call_id: str
    engine_id: str
    reason: Reason

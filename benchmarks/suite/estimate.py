"""How long a workload takes on this kind of machine: a small fluid simulation of the engines.

The suite sizes its workloads (:mod:`benchmarks.suite.workloads`) and prints its
plan (``--dry-run``) with these estimates; nothing here is measured at run time.

Engine speeds (:data:`SPEEDS`) were measured on the 2-core machines this suite
targets, SmolLM2-135M, one engine with both threads, contexts of ~600 tokens:

===========  ===============  ==========================================================
dtype        prefill          decode step at batch 1 / 2 / 4 / 8 / 16
===========  ===============  ==========================================================
float32      ~600 tokens/s    33 / 36 / 42 / 48 / 62 ms
bfloat16     ~1,500 tokens/s  19-21 ms up to batch 8; 27 ms at 16 (assumed: fp32's 62/48)
===========  ===============  ==========================================================

Prefill is compute-bound (batching does not speed it up); batching decodes is
nearly free up to ~8.  An engine given ``t`` of the machine's ``c`` threads
prefills at ``t / c`` of the rate and steps ``c / t`` times slower (both
compute and memory bandwidth are shared).

Model (per engine, continuous batching): each step prefills up to
:data:`STEP_TOKENS` prompt tokens of the queued calls (first come first
served) and decodes one token for every call already decoding; it lasts
``prefill tokens / rate + decode_step(batch)``.  The step that finishes a
call's prefill yields its first token.  Calls go to the engine with the fewest
calls (ties: lowest index) or, with ``affinity``, to an engine that holds
their longest known prefix.  With ``sharing`` an engine skips the prompt
tokens of the longest prefix it has computed before (prefixes end at the
templates' placeholders, as Parrot's prefix hashes and, coarsely, vLLM's
automatic prefix caching); without it every prompt is prefilled whole.

Clients, with one emulated network delay of ``delay_s`` per round trip on the
critical path (:mod:`benchmarks.suite.clients`): ``"baseline"`` pays one
delay before every call's request, sent once its producers have answered;
``"parrot"`` pays one before the app's calls reach the manager (the session
opened with the whole app as one batch) and one after its last output (the
``get``).

Invariant: the estimate of a workload is the time from its start until its
last app ends; every call of every app ends (the simulation never drops work).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import re
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from benchmarks.suite import textgen
from benchmarks.suite.spec import AppSpec, CallSpec, Workload

__all__ = [
    "SPEEDS",
    "STEP_TOKENS",
    "AppEstimate",
    "Profile",
    "Speed",
    "estimate_apps",
    "estimate_workload",
    "mean_per_token",
    "profile_of",
]

STEP_TOKENS = 512  # Parrot's --max-step-tokens default; vLLM-CPU's chunked prefill is of the same order
_SEGMENT = re.compile(r"\{\{(input|output):([A-Za-z_][A-Za-z0-9_]*)\}\}")


@dataclass(frozen=True)
class Speed:
    """One engine with all of the machine's threads: prefill rate and decode step times."""

    prefill_tok_s: float
    steps_ms: tuple[tuple[int, float], ...]  # (batch, step ms), increasing batches

    def step_s(self, batch: int) -> float:
        """Decode step time at ``batch``: piecewise linear, extrapolated past the last point."""
        pts = self.steps_ms
        if batch <= pts[0][0]:
            return pts[0][1] / 1000
        for (b0, t0), (b1, t1) in itertools.pairwise(pts):
            if batch <= b1:
                return (t0 + (t1 - t0) * (batch - b0) / (b1 - b0)) / 1000
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        return (t1 + (t1 - t0) * (batch - b1) / (b1 - b0)) / 1000


SPEEDS: dict[str, Speed] = {
    "float32": Speed(600.0, ((1, 33.0), (2, 36.0), (4, 42.0), (8, 48.0), (16, 62.0))),
    "bfloat16": Speed(1500.0, ((1, 20.0), (2, 20.0), (4, 20.0), (8, 21.0), (16, 27.0))),
}


@dataclass(frozen=True)
class Profile:
    """How a system runs a workload, as far as the estimate cares."""

    client: Literal["parrot", "baseline"]
    sharing: bool  # prompt prefixes computed once per engine
    affinity: bool = False  # calls placed where their prefix is
    max_batch: int = 256  # FastChat runs one request at a time


def profile_of(system: str) -> Profile:
    """The :class:`Profile` of a system name of :data:`benchmarks.suite.systems.SYSTEMS`."""
    if system == "fastchat":
        return Profile("baseline", sharing=False, max_batch=1)
    if system in ("vllm", "parrot-baseline-apc", "parrot-baseline-throughput-apc"):
        return Profile("baseline", sharing=True)
    if system.startswith("parrot-baseline"):
        return Profile("baseline", sharing=False)
    return Profile("parrot", sharing=True, affinity=system != "parrot-no-affinity")


# --------------------------------------------------------------------------- calls


def _prefix_keys(
    app: AppSpec, call: CallSpec, produced: Mapping[str, int]
) -> tuple[list[tuple[str, int]], int]:
    """``([(key, tokens)] at each placeholder boundary, prompt tokens)`` of ``call``.

    A key names the text before a boundary: the template's constant pieces, the
    constants' text and, for dependencies, the producing call (of this app)."""
    keys: list[tuple[str, int]] = []
    digest = hashlib.sha1()
    tokens = 0
    pos = 0
    for match in _SEGMENT.finditer(call.template):
        piece = call.template[pos : match.start()]
        digest.update(piece.encode())
        tokens += textgen.estimate_tokens(piece) if piece.strip() else 0
        if tokens:
            keys.append((digest.hexdigest(), tokens))
        kind, name = match.group(1), match.group(2)
        if kind == "output":
            break
        if name in call.consts:
            digest.update(b"\0c" + call.consts[name].encode())
            tokens += textgen.estimate_tokens(call.consts[name])
        else:
            digest.update(f"\0d{app.app_id}/{call.deps[name]}".encode())
            tokens += produced[call.deps[name]]
        pos = match.end()
    return keys, max(1, tokens)


@dataclass(eq=False)
class _Call:
    app: int
    name: str
    prompt: int
    out: int
    keys: list[tuple[str, int]]
    consumers: list[_Call] = field(default_factory=list)
    waiting: int = 0  # producers not done yet
    left: int = 0  # prompt tokens still to prefill (set at placement)
    decode_left: int = 0
    done_s: float | None = None
    first_s: float | None = None


@dataclass
class AppEstimate:
    app_id: str
    kind: str
    arrival_s: float
    end_s: float
    output_tokens: int

    @property
    def latency_s(self) -> float:
        return self.end_s - self.arrival_s


@dataclass(eq=False)
class _Engine:
    index: int
    queue: deque[_Call] = field(default_factory=deque)
    decoding: list[_Call] = field(default_factory=list)
    cache: set[str] = field(default_factory=set)
    busy_until: float | None = None
    plan: tuple[list[tuple[_Call, int]], list[_Call]] | None = None

    def load(self) -> int:
        return len(self.queue) + len(self.decoding)


def estimate_apps(
    workload: Workload,
    profile: Profile,
    *,
    dtype: str = "float32",
    engines: int | None = None,
    threads: int = 2,
    delay_s: float = 0.25,
) -> list[AppEstimate]:
    """Simulated end of every app of ``workload`` (see the module docstring)."""
    n_engines = engines or workload.engines
    speed = SPEEDS[dtype]
    per_thread = max(1, threads // n_engines) / threads
    rate = speed.prefill_tok_s * per_thread
    slow = 1 / per_thread
    fleet = [_Engine(i) for i in range(n_engines)]
    ready: list[tuple[float, int, _Call]] = []
    seq = itertools.count()
    apps: list[tuple[AppSpec, list[_Call]]] = []
    for a, app in enumerate(workload.apps):
        produced: dict[str, int] = {}
        calls: dict[str, _Call] = {}
        for spec in app.calls:
            keys, prompt = _prefix_keys(app, spec, produced)
            produced[spec.name] = spec.max_tokens
            call = _Call(a, spec.name, prompt, spec.max_tokens, keys)
            for dep in dict.fromkeys(spec.deps.values()):
                calls[dep].consumers.append(call)
                call.waiting += 1
            calls[spec.name] = call
        apps.append((app, list(calls.values())))
        start = app.arrival_s + delay_s
        for call in calls.values():
            if call.waiting == 0:
                heapq.heappush(ready, (start, next(seq), call))

    def place(call: _Call) -> _Engine:
        if profile.affinity:
            for key, _ in reversed(call.keys):
                holders = [e for e in fleet if key in e.cache]
                if holders:
                    return min(holders, key=lambda e: (e.load(), e.index))
        return min(fleet, key=lambda e: (e.load(), e.index))

    def start_step(engine: _Engine, now: float) -> None:
        budget = STEP_TOKENS
        room = profile.max_batch - len(engine.decoding)  # calls it may still admit
        fills: list[tuple[_Call, int]] = []
        for call in engine.queue:
            if budget <= 0 or room <= 0:
                break
            if call.left < 0:  # first touch: what the engine has cached already
                skip = 0
                if profile.sharing:
                    skip = max((n for k, n in call.keys if k in engine.cache), default=0)
                call.left = max(1, call.prompt - skip)
            take = min(call.left, budget)
            fills.append((call, take))
            budget -= take
            room -= 1
        batch = list(engine.decoding)
        filled = sum(t for _, t in fills)
        duration = filled / rate + (speed.step_s(len(batch)) * slow if batch else 0.0)
        engine.plan = (fills, list(batch))
        engine.busy_until = now + max(duration, 1e-6)

    def finish_step(engine: _Engine, now: float) -> None:
        assert engine.plan is not None
        fills, batch = engine.plan
        engine.plan, engine.busy_until = None, None
        for call in batch:
            call.decode_left -= 1
            if call.decode_left <= 0:
                engine.decoding.remove(call)
                complete(call, now)
        for call, take in fills:
            call.left -= take
            if call.left <= 0:
                engine.queue.remove(call)
                engine.cache.update(k for k, _ in call.keys)
                call.first_s = now
                call.decode_left = call.out - 1
                if call.decode_left <= 0:
                    complete(call, now)
                else:
                    engine.decoding.append(call)

    def complete(call: _Call, now: float) -> None:
        call.done_s = now
        for consumer in call.consumers:
            consumer.waiting -= 1
            if consumer.waiting == 0:
                when = now + (delay_s if profile.client == "baseline" else 0.0)
                heapq.heappush(ready, (when, next(seq), consumer))

    now = 0.0
    while True:
        busy = [e for e in fleet if e.busy_until is not None]
        next_step = min((e.busy_until for e in busy), default=None)  # type: ignore[type-var]
        next_ready = ready[0][0] if ready else None
        if next_step is None and next_ready is None:
            break
        if next_ready is not None and (next_step is None or next_ready <= next_step):
            now, _, call = heapq.heappop(ready)
            call.left = -1
            engine = place(call)
            engine.queue.append(call)
            if engine.busy_until is None:
                start_step(engine, now)
            continue
        now = next_step  # type: ignore[assignment]
        for engine in busy:
            if engine.busy_until == now:
                finish_step(engine, now)
                if engine.queue or engine.decoding:
                    start_step(engine, now)
    out = []
    for app, calls in apps:
        ends = [c.done_s for c in calls if c.name in app.outputs]
        end = max(e for e in ends if e is not None)
        if profile.client == "parrot":
            end += delay_s
        tokens = sum(c.out for c in calls if c.name in app.outputs)
        out.append(AppEstimate(app.app_id, app.kind, app.arrival_s, end, tokens))
    return out


def estimate_workload(workload: Workload, profile: Profile, **kwargs: object) -> float:
    """Seconds from the workload's start until its last app ends (see :func:`estimate_apps`)."""
    apps = estimate_apps(workload, profile, **kwargs)  # type: ignore[arg-type]
    return max((a.end_s for a in apps), default=0.0)


def mean_per_token(apps: Sequence[AppEstimate]) -> float:
    """Mean normalised latency (s per output token) of estimated apps."""
    values = [a.latency_s / a.output_tokens for a in apps if a.output_tokens]
    return sum(values) / len(values) if values else 0.0

"""How an engine's decode step time grows with its token load, and the latency cap that follows.

The manager keeps latency-sensitive work on an engine only while the engine's
token load is under its *latency cap* (``cap_L`` in
:mod:`parrot.manager.sched.scheduler`).  The paper used one figure, 6,144 tokens for
LLaMA-13B on an A100, which kept per-output-token latency within about
20-25 % of its unloaded value.  What load does that depends on the model and
the machine, so each engine measures its own cap (this module is the
measurement's maths, torch-free; the start-up probe that gives the first
timings is :meth:`parrot.engine.runner.EngineRunner.probe_latency`, its plan
:mod:`parrot.engine.latency_probe`):

- *Model.*  A decode step makes one output token for every running sequence,
  so its duration is the per-output-token latency of the running requests.
  It grows with the token load (the KV tokens the step's attention reads,
  and the sequences that come with them): ``step(load) ~= a + b * load``.
- *Measurement.*  :class:`StepLatency` keeps the durations of pure decode
  steps (one new token per sequence, no prompt chunk) by load, in
  quarter-octave buckets (the last :data:`WINDOW` steps of each).  The fit
  (:func:`fit_step_times`) takes each bucket's median load and lower-quartile
  time (the minimum of up to four steps: other processes on the cores only
  ever add time, so the low end is the engine's own), the Theil-Sen slope
  over the buckets (the median of pairwise slopes, clamped at 0: step time
  never falls as load grows) and the intercept as the median of
  ``time - b * load``.  It needs buckets with at least
  :data:`MIN_BUCKET_SAMPLES` steps each spanning an octave of load, and a
  step time that grows measurably across them (:data:`MIN_GROWTH`).  Scaling every step's time alike
  (a uniformly busier machine) scales ``a`` and ``b`` alike and leaves the
  cap unchanged.
- *Refits.*  Real decode steps keep refining the fit (it is redone every
  :data:`REFIT_EVERY` of them).  The probe's steps are kept apart from
  real ones, never pooled: a refit fits the real steps alone when their
  loads span an octave (the probe's steps are then dropped: aged out),
  else scales the probe's line to the real steps' times
  (:meth:`StepLatency._fit`).  A refit that cannot fit keeps the previous
  fit, logs why and is counted (``latency_refits_rejected`` in the
  engine's stats).
- *Prompt tokens.*  Steps that compute at least :data:`PREFILL_MIN_TOKENS`
  prompt tokens give what one prompt token costs: the step's time less the
  fitted time of its decode rows (none: the unloaded step), over its prompt
  tokens; the median of the last :data:`WINDOW` such steps.  With the fit's
  unloaded step it says how many prompt tokens cost one decode step
  (``prefill_tokens_per_decode_step``, two significant digits), the figure the
  manager's saturation batching sizes its batches by
  (:mod:`parrot.manager.sched.saturation`).
- *Cap.*  The load at which the fitted step time reaches the target:
  ``target = factor * a`` (default :data:`LATENCY_FACTOR` = 1.25, the
  paper's "within 20-25 %") or an absolute ``target_ms``;
  ``cap = (target - a) / b``, clamped to ``[min(MIN_LATENCY_CAP_TOKENS,
  capacity), capacity]`` where capacity is the engine's token capacity (the
  floor keeps room for one typical call: below it latency work could not
  batch at all).  No growth measured (``b == 0``): the capacity.  An
  operator's fixed cap replaces the fitted one (the fit is still reported).

Threading: :meth:`StepLatency.record`, :meth:`StepLatency.refit` and the probe
run on the engine's worker thread; other threads may call
:meth:`StepLatency.cap` (it reads :attr:`StepLatency.fit`, a frozen object
replaced whole).  Torch-free: the simulator and the manager (whose
OpenAI-compatible backends fit their decode steps alike) import it.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

LATENCY_FACTOR = 1.25
"""Default target: a decode step may take this many times its unloaded time (the paper's 6,144
tokens kept LLaMA-13B's per-output-token latency within about 20-25 % of unloaded)."""

MIN_LATENCY_CAP_TOKENS = 1024
"""The measured cap is never below this (or the token capacity, if smaller): one typical call of
the evaluation's workloads (a prompt of a few hundred tokens and its output) must fit."""

MIN_GROWTH = 0.05
"""A fit must show the step time growing by at least this fraction across the loads it saw, which
must span an octave at least: otherwise the timings cannot place the cap (it would lie far beyond
them) and nothing is fitted.  Flat timings also mean something else dominated every step (a
busy process sharing the cores makes every step slow whatever its load)."""

WINDOW = 32
"""Decode steps kept per load bucket (the most recent)."""

MIN_BUCKET_SAMPLES = 3
"""A load bucket enters the fit once it holds this many steps."""

REFIT_EVERY = 64
"""Real decode steps between two refits."""

PREFILL_MIN_TOKENS = 256
"""A step computes at least this many prompt tokens to tell what one costs (a few tokens would
measure the step's fixed costs)."""

REJECTION_LOG_EVERY_S = 60.0
"""A rejected refit logs a warning at most this often (a debug line otherwise)."""


@dataclass(frozen=True, slots=True)
class StepFit:
    """``step_time(load) ~= base_s + per_token_s * load``.

    Invariants: ``base_s > 0``, ``per_token_s >= 0``, ``buckets >= 2``.
    """

    base_s: float
    per_token_s: float
    buckets: int  # load buckets the fit used
    steps: int  # decode steps in those buckets

    def step_s(self, load: float) -> float:
        return self.base_s + self.per_token_s * load


def _bucket(load: int) -> int:
    """Quarter-octave load bucket (load 0 has a bucket of its own)."""
    return -1 if load <= 0 else int(4 * math.log2(load))


def _lower_quartile(values: list[float]) -> float:
    """The lower quartile (nearest rank below): the minimum of up to four values."""
    return sorted(values)[(len(values) - 1) // 4]


def fit_step_times(samples: Iterable[tuple[int, float]], min_samples: int = 1) -> StepFit | None:
    """Fit ``a + b * load`` to ``(load, seconds)`` decode-step samples, robustly.

    Samples are grouped by quarter-octave load bucket; a bucket with fewer
    than ``min_samples`` samples is ignored; each remaining bucket gives one
    point (median load, lower-quartile time).  The slope is the Theil-Sen estimate
    over those points (median of the slopes of all pairs), clamped at 0 (a
    step never gets faster with more load); the intercept is the median of
    ``time - slope * load``, at least 1 microsecond.  Returns None when the
    points do not span an octave of load (largest >= 2 x smallest) or the
    fitted time grows by less than ``MIN_GROWTH`` across them (such timings
    cannot place the cap), or when there are no points at all
    (:func:`fit_or_why` says which).  Raises ValueError on a negative load or a
    time that is not a positive finite number.
    """
    return fit_or_why(samples, min_samples)[0]


def fit_or_why(samples: Iterable[tuple[int, float]], min_samples: int = 1) -> tuple[StepFit | None, str]:
    """:func:`fit_step_times`, with why there is no fit ("" when there is one)."""
    return _fit_points(*_points(samples, min_samples))


_Point = tuple[int, float, int]  # a load bucket's median load, lower-quartile time, steps


def _points(samples: Iterable[tuple[int, float]], min_samples: int) -> tuple[dict[int, _Point], int]:
    """The fit's points by load bucket (buckets of at least ``min_samples`` samples), and
    how many samples there were in all."""
    groups: dict[int, list[tuple[int, float]]] = {}
    for load, seconds in samples:
        if load < 0:
            raise ValueError(f"load must be >= 0, got {load}")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"step time must be a positive finite number of seconds, got {seconds!r}")
        groups.setdefault(_bucket(load), []).append((load, seconds))
    points = {
        b: (statistics.median(load for load, _ in g), _lower_quartile([s for _, s in g]), len(g))
        for b, g in groups.items()
        if len(g) >= min_samples
    }
    return points, sum(len(g) for g in groups.values())


def _fit_points(by_bucket: dict[int, _Point], samples: int) -> tuple[StepFit | None, str]:
    points = [(x, t) for x, t, _ in by_bucket.values()]
    if not points:
        few = f"{samples} decode steps, too few in any load bucket" if samples else "no decode steps"
        return None, few
    lo, hi = min(x for x, _ in points), max(x for x, _ in points)
    if hi < 2 * max(lo, 1):
        return None, f"loads {lo:g}-{hi:g} span less than an octave"
    slopes = [
        (t2 - t1) / (x2 - x1) for i, (x1, t1) in enumerate(points) for x2, t2 in points[i + 1 :] if x2 != x1
    ]
    median = statistics.median(slopes) if slopes else 0.0
    slope = max(0.0, median)
    base = max(1e-6, statistics.median(t - slope * x for x, t in points))
    if slope * (hi - lo) < MIN_GROWTH * (base + slope * lo):
        grown = slope * (hi - lo) / (base + slope * lo)
        return None, (
            f"the step time grows {grown:.1%} (slope {median * 1e6:.4g} ms per 1,000 tokens) across loads "
            f"{lo:g}-{hi:g}, under the {MIN_GROWTH:.0%} a fit needs"
        )
    steps = sum(n for _, _, n in by_bucket.values())
    return StepFit(base, slope, len(points), steps), ""


def cap_from_fit(
    fit: StepFit,
    capacity: int,
    *,
    factor: float = LATENCY_FACTOR,
    target_s: float | None = None,
    floor: int = MIN_LATENCY_CAP_TOKENS,
) -> int:
    """The load at which ``fit`` reaches the target step time, within ``[min(floor, capacity), capacity]``.

    The target is ``target_s`` if given, else ``factor * fit.base_s``.
    Raises ValueError on a capacity below 1, a factor not above 1, or a
    target that is not positive.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if not factor > 1:
        raise ValueError(f"latency factor must be > 1, got {factor}")
    if target_s is not None and not target_s > 0:
        raise ValueError(f"latency target must be > 0, got {target_s}")
    target = factor * fit.base_s if target_s is None else target_s
    lo = min(floor, capacity)
    if fit.per_token_s <= 0:
        return capacity
    raw = (target - fit.base_s) / fit.per_token_s  # the largest load whose step keeps to the target
    return max(lo, min(capacity, math.floor(raw + 1e-6))) if raw > 0 else lo  # (+1e-6: rounding)


class StepLatency:
    """An engine's decode-step timings, their fit, and its latency cap (see the module docstring).

    ``factor``: the target is ``factor`` times the fitted unloaded step time;
    ``target_ms``: an absolute target instead; ``fixed_cap``: report this cap
    whatever is measured (the fit is still kept and reported).
    """

    def __init__(
        self,
        *,
        factor: float = LATENCY_FACTOR,
        target_ms: float | None = None,
        fixed_cap: int | None = None,
        floor: int = MIN_LATENCY_CAP_TOKENS,
    ) -> None:
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 1):
            raise ValueError(f"latency factor must be a finite number > 1, got {factor!r}")
        if target_ms is not None and not (math.isfinite(target_ms) and target_ms > 0):
            raise ValueError(f"latency target must be a positive number of milliseconds, got {target_ms!r}")
        if fixed_cap is not None and (
            isinstance(fixed_cap, bool) or not isinstance(fixed_cap, int) or fixed_cap < 1
        ):
            raise ValueError(f"latency cap must be a positive integer, got {fixed_cap!r}")
        if floor < 1:
            raise ValueError(f"floor must be >= 1, got {floor}")
        self.factor = float(factor)
        self.target_s = None if target_ms is None else target_ms / 1000
        self.fixed_cap = fixed_cap
        self.floor = floor
        self.fit: StepFit | None = None
        self.probe_s: float | None = None  # how long the start-up probe took
        self.last: tuple[int, float] | None = None  # the last step recorded
        self.refits_rejected = 0  # periodic refits that could not fit (the previous fit kept)
        self.rejection: str = ""  # why the last of them could not
        self._rejection_logged_at: float | None = None
        self._buckets: dict[int, deque[tuple[int, float]]] = {}  # real decode steps
        self._probe_buckets: dict[int, deque[tuple[int, float]]] = {}  # the start-up probe's
        self._prompt_token_s: deque[float] = deque(maxlen=WINDOW)  # per step with prompt tokens
        self._since_refit = 0

    def record(self, load: int, seconds: float, *, probe: bool = False) -> None:
        """One pure decode step of ``seconds`` at token ``load`` (worker thread); ``probe``:
        a step of the start-up probe (kept apart from real steps, never triggers a refit)."""
        if not (seconds > 0 and math.isfinite(seconds)) or load < 0:
            return
        buckets = self._probe_buckets if probe else self._buckets
        bucket = buckets.get(_bucket(load))
        if bucket is None:
            bucket = buckets[_bucket(load)] = deque(maxlen=WINDOW)
        bucket.append((load, seconds))
        self.last = (load, seconds)
        if probe:
            return
        self._since_refit += 1
        if self._since_refit >= REFIT_EVERY:
            self._since_refit = 0
            fit, why = self._fit(MIN_BUCKET_SAMPLES)
            if fit is None:
                self._rejected(why)
            else:
                self.fit = fit

    def record_prefill(self, prompt_tokens: int, decode_load: int, decodes: int, seconds: float) -> None:
        """A step that computed ``prompt_tokens`` prompt tokens and ``decodes`` decode rows
        reading ``decode_load`` KV tokens, in ``seconds`` (worker thread).  Steps of fewer
        than :data:`PREFILL_MIN_TOKENS` prompt tokens, and any before a fit, are ignored."""
        fit = self.fit
        if fit is None or prompt_tokens < PREFILL_MIN_TOKENS or not (seconds > 0 and math.isfinite(seconds)):
            return
        rest = seconds - (fit.step_s(decode_load) if decodes else fit.base_s)
        if rest > 0:
            self._prompt_token_s.append(rest / prompt_tokens)

    def prefill_tokens_per_decode_step(self) -> float:
        """How many prompt tokens cost one unloaded decode step (two significant digits);
        0 while unknown."""
        fit = self.fit
        if fit is None or not self._prompt_token_s:
            return 0.0
        ratio = fit.base_s / statistics.median(self._prompt_token_s)
        return float(f"{ratio:.2g}")

    def refit(self, min_samples: int = MIN_BUCKET_SAMPLES) -> StepFit | None:
        """Fit the kept steps again (real steps' buckets of at least ``min_samples`` steps;
        see :meth:`_fit`); keeps the previous fit when there is too little to fit."""
        self._since_refit = 0
        fit, _ = self._fit(min_samples)
        if fit is not None:
            self.fit = fit
        return self.fit

    def _fit(self, min_samples: int) -> tuple[StepFit | None, str]:
        """The fit of the kept steps, with why there is none ("" when there is one).

        Real steps (their buckets of at least ``min_samples`` steps) are fitted alone; when
        that fits, the probe's steps are dropped (aged out: they were timed on another
        occasion, and are no longer needed).  When the real steps' loads span less than
        an octave they cannot give a slope, and they are never pooled with the probe's
        (steps timed under other conditions, a busier machine say, would bend a pooled
        line: the median slope falls to 0 or the base doubles): the probe's own line is
        scaled by the median ratio of the real buckets' times to it (the module
        docstring: a uniformly busier machine scales base and slope alike), which keeps
        the probe's cap under a relative target.  Without real steps: the probe's fit."""
        real, n_real = _points((s for b in self._buckets.values() for s in b), min_samples)
        fit, why = _fit_points(real, n_real)
        if fit is not None:
            self._probe_buckets.clear()
            return fit, ""
        if not self._probe_buckets:
            return None, why
        probe, why_probe = _fit_points(*_points((s for b in self._probe_buckets.values() for s in b), 1))
        if not real:
            return probe, why_probe
        lo, hi = min(x for x, _, _ in real.values()), max(x for x, _, _ in real.values())
        if probe is None or hi >= 2 * max(lo, 1):  # real steps over an octave are believed over the probe
            return None, why
        scale = statistics.median(t / probe.step_s(x) for x, t, _ in real.values())
        steps = probe.steps + sum(n for _, _, n in real.values())
        return StepFit(probe.base_s * scale, probe.per_token_s * scale, probe.buckets + len(real), steps), ""

    def _rejected(self, why: str) -> None:
        self.refits_rejected += 1
        self.rejection = why
        now = time.monotonic()
        last = self._rejection_logged_at
        if last is None or now - last >= REJECTION_LOG_EVERY_S:
            self._rejection_logged_at = now
            level = logging.WARNING
        else:
            level = logging.DEBUG
        fit = self.fit
        kept = (
            "unknown"
            if fit is None
            else f"{fit.base_s * 1e3:.4g} ms + {fit.per_token_s * 1e6:.4g} ms per 1,000 tokens"
        )
        log.log(
            level, "latency refit rejected (%d so far): %s; the fit stays %s", self.refits_rejected, why, kept
        )

    def cap(self, capacity: int) -> int:
        """The latency cap for an engine of token ``capacity``: the fixed cap, else the
        fitted one; 0 while nothing is fitted.  Never above ``capacity``."""
        if self.fixed_cap is not None:
            return min(self.fixed_cap, capacity)
        fit = self.fit
        if fit is None:
            return 0
        return cap_from_fit(fit, capacity, factor=self.factor, target_s=self.target_s, floor=self.floor)

    def target_s_for(self, fit: StepFit) -> float:
        return fit.base_s * self.factor if self.target_s is None else self.target_s

    def report(self, capacity: int) -> dict[str, float | int | str]:
        """The fields of :class:`~parrot.protocol.schemas.EngineStats` this describes."""
        fit = self.fit
        return {
            "latency_cap_tokens": self.cap(capacity),
            "latency_cap_source": "fixed" if self.fixed_cap is not None else ("measured" if fit else "none"),
            "decode_ms_base": 0.0 if fit is None else round(fit.base_s * 1e3, 6),
            "decode_ms_per_1k_tokens": 0.0 if fit is None else round(fit.per_token_s * 1e6, 6),
            "decode_ms_target": 0.0 if fit is None else round(self.target_s_for(fit) * 1e3, 6),
            "decode_steps_fitted": 0 if fit is None else fit.steps,
            "prefill_tokens_per_decode_step": self.prefill_tokens_per_decode_step(),
            "latency_refits_rejected": self.refits_rejected,
        }

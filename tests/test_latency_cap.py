"""Each engine sizes its own latency cap from its decode step time against load
(issue 13, defect 2): the fit, the cap's bounds, the start-up probe on the tiny
model, real decode steps refining it, the stats that report it, the cap
reaching the manager, and the scheduler honouring it."""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import time
from collections.abc import Iterator, Sequence

import httpx
import pytest
import torch

from parrot.cli import _parser
from parrot.engine import latency_probe as lp
from parrot.engine.core import latency_fit as lf
from parrot.engine.core.latency_fit import StepFit, StepLatency, cap_from_fit, fit_or_why, fit_step_times
from parrot.engine.loader import LoadedModel
from parrot.engine.local import LocalEngine
from parrot.engine.runner import EngineRunner
from parrot.manager.sched.scheduler import DEFAULT_LATENCY_CAP_TOKENS
from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import EngineStats, PlaceholderBinding, SubmitCall
from parrot.protocol.tokenizer import TextTokenizer
from tests.conftest import start_server
from tests.fake_engine import GatedEngine


# ------------------------------------------------------------------ the fit
def line(
    a: float, b: float, loads: Sequence[int], per_load: int, rng: random.Random
) -> list[tuple[int, float]]:
    """Samples of ``a + b * load`` with small noise, one slow outlier in four (contention)."""
    out = []
    for load in loads:
        for k in range(per_load):
            t = (a + b * load) * rng.uniform(0.98, 1.02)
            out.append((load, t * 3 if k % 4 == 3 else t))
    return out


def test_fit_recovers_the_line_despite_slow_outliers():
    rng = random.Random(3)
    samples = line(0.030, 5e-6, [300, 700, 1500, 3000, 6000, 12_000], 8, rng)
    fit = fit_step_times(samples)
    assert fit is not None and fit.buckets == 6 and fit.steps == len(samples)
    assert fit.base_s == pytest.approx(0.030, rel=0.05)
    assert fit.per_token_s == pytest.approx(5e-6, rel=0.05)
    assert fit.step_s(1000) == pytest.approx(0.035, rel=0.05)


def test_fit_needs_growth_over_an_octave_of_load():
    assert fit_step_times([]) is None and StepLatency().refit() is None  # nothing measured yet
    assert fit_step_times([(500, 0.04)] * 5) is None  # one load: no slope
    assert fit_step_times([(500, 0.04)] * 5 + [(4000, 0.05)] * 2, min_samples=3) is None
    assert fit_step_times([(500, 0.040), (4000, 0.050)]) is not None
    assert fit_step_times([(3000, 0.040), (4000, 0.050)]) is None  # under an octave: it cannot place a cap
    # falling (clamped to flat) or flat within MIN_GROWTH: no fit, the cap stays unknown
    assert fit_step_times([(500, 0.040), (500, 0.041), (4000, 0.030), (4000, 0.031)]) is None
    assert fit_step_times([(500, 0.0400), (4000, 0.0415)]) is None  # +3.75 %
    assert fit_step_times([(500, 0.0400), (4000, 0.0425)]) is not None  # +6.25 %
    steep = fit_step_times([(1000, 0.001), (2000, 0.011)])  # the line would cross 0 before load 0
    assert steep is not None and steep.base_s == pytest.approx(1e-6)
    with pytest.raises(ValueError, match="load"):
        fit_step_times([(-1, 0.01), (100, 0.02)])
    with pytest.raises(ValueError, match="step time"):
        fit_step_times([(10, 0.0), (100, 0.02)])


def test_cap_is_where_the_step_time_reaches_its_target_within_floor_and_capacity():
    fit = StepFit(0.030, 5e-6, 3, 9)
    # 1.25 x 30 ms = 37.5 ms is reached at 7.5 ms / 5 us = 1,500 tokens
    assert cap_from_fit(fit, 46_592) == 1500
    assert cap_from_fit(fit, 46_592, factor=1.5) == 3000
    assert cap_from_fit(fit, 46_592, target_s=0.040) == 2000
    assert cap_from_fit(fit, 1200) == 1200  # never above the capacity
    steep = StepFit(0.030, 1e-4, 3, 9)  # 75 tokens: the floor
    assert cap_from_fit(steep, 46_592) == lf.MIN_LATENCY_CAP_TOKENS
    assert cap_from_fit(steep, 500) == 500  # the floor never exceeds the capacity
    assert cap_from_fit(fit, 46_592, target_s=0.020) == lf.MIN_LATENCY_CAP_TOKENS  # below a: floor
    assert cap_from_fit(StepFit(0.030, 0.0, 2, 6), 46_592) == 46_592  # no growth: the capacity
    with pytest.raises(ValueError, match="factor"):
        cap_from_fit(fit, 1000, factor=1.0)
    with pytest.raises(ValueError, match="capacity"):
        cap_from_fit(fit, 0)


def test_step_latency_refits_from_recorded_steps_and_reports():
    tracker = StepLatency()
    assert tracker.cap(50_000) == 0 and tracker.report(50_000)["latency_cap_source"] == "none"
    rng = random.Random(5)
    for load, t in line(0.030, 5e-6, [600, 2400], lf.REFIT_EVERY // 2, rng):
        tracker.record(load, t)
    assert tracker.fit is not None  # refitted after REFIT_EVERY steps
    assert tracker.cap(50_000) == pytest.approx(1500, rel=0.1)
    report = tracker.report(50_000)
    assert report["latency_cap_source"] == "measured" and report["decode_steps_fitted"] == lf.REFIT_EVERY
    assert report["decode_ms_base"] == pytest.approx(30, rel=0.1)
    assert report["decode_ms_per_1k_tokens"] == pytest.approx(5, rel=0.1)
    assert report["decode_ms_target"] == pytest.approx(37.5, rel=0.1)
    EngineStats(**report)  # the stats schema takes every field
    tracker.record(100, float("nan"))  # ignored
    tracker.record(-1, 0.01)
    assert sum(len(b) for b in tracker._buckets.values()) == lf.REFIT_EVERY
    fixed = StepLatency(fixed_cap=3000)
    assert fixed.cap(50_000) == 3000 and fixed.cap(2000) == 2000
    assert fixed.report(50_000)["latency_cap_source"] == "fixed"
    for bad in ({"factor": 1.0}, {"target_ms": 0.0}, {"fixed_cap": 0}, {"fixed_cap": True}):
        with pytest.raises(ValueError):
            StepLatency(**bad)  # type: ignore[arg-type]


def test_prompt_steps_tell_how_many_prompt_tokens_cost_one_decode_step():
    tracker = StepLatency()
    tracker.record_prefill(1000, 0, 0, 0.5)  # before a fit: nothing to compare with
    assert tracker.prefill_tokens_per_decode_step() == 0.0
    rng = random.Random(3)
    for load, t in line(0.020, 5e-6, [600, 2400], lf.REFIT_EVERY // 2, rng):
        tracker.record(load, t)
    assert tracker.fit is not None and tracker.report(50_000)["prefill_tokens_per_decode_step"] == 0.0
    base = tracker.fit.base_s
    # 2 ms a prompt token on top of the step's decode part: base / 2 ms tokens cost one step
    tracker.record_prefill(1000, 0, 0, base + 2.0)
    tracker.record_prefill(512, 1200, 4, tracker.fit.step_s(1200) + 512 * 2e-3)
    tracker.record_prefill(600, 0, 0, base + 600 * 1e-3)  # a faster step: the median of three
    tracker.record_prefill(lf.PREFILL_MIN_TOKENS - 1, 0, 0, 9.0)  # too few prompt tokens: ignored
    tracker.record_prefill(1000, 0, 0, base / 2)  # faster than its decode part: ignored
    tracker.record_prefill(1000, 0, 0, float("inf"))
    want = float(f"{base / 2e-3:.2g}")
    assert tracker.prefill_tokens_per_decode_step() == want == pytest.approx(10, rel=0.1)
    EngineStats(**tracker.report(50_000))


def _probed(a: float, b: float) -> tuple[StepLatency, StepFit]:
    """A tracker holding start-up probe steps of ``a + b * load`` at the probe's loads, fitted."""
    tracker = StepLatency()
    for load, t in line(a, b, [512, 2048, 4096], 3, random.Random(1)):
        tracker.record(load, t, probe=True)
    fit = tracker.refit(min_samples=1)
    assert fit is not None and fit.steps == 9 and tracker._buckets == {}
    return tracker, fit


def test_probe_steps_are_kept_apart_and_aged_out_by_real_steps_spanning_an_octave():
    tracker, probe_fit = _probed(0.030, 5e-6)
    # real steps under an octave of load, as the probe saw the machine: its line, refined
    for load, t in line(0.030, 5e-6, [200, 260], lf.REFIT_EVERY // 2, random.Random(7)):
        tracker.record(load, t)
    refined = tracker.fit
    assert refined is not probe_fit and refined.buckets == 5 and refined.steps == 9 + lf.REFIT_EVERY
    assert refined.base_s == pytest.approx(0.030, rel=0.03)
    assert refined.per_token_s == pytest.approx(5e-6, rel=0.03)
    assert tracker.refits_rejected == 0 and len(tracker._probe_buckets) == 3
    # real steps over an octave: fitted alone, the probe's dropped
    for load, t in line(0.030, 5e-6, [400, 1200], lf.REFIT_EVERY // 2, random.Random(8)):
        tracker.record(load, t)
    assert tracker._probe_buckets == {} and tracker.fit.buckets == 4
    assert tracker.fit.base_s == pytest.approx(0.030, rel=0.03)
    assert tracker.fit.steps == sum(len(b) for b in tracker._buckets.values())


def test_real_steps_slower_than_the_probe_scale_its_line_instead_of_bending_it():
    """Issue 41: real steps timed at 0.65 ms around load 230 (a GIL wait in the span) beside
    probe steps of 0.36 ms + 0.16 ms per 1,000 tokens.  Pooled, their median slope fell to
    about 0 (no fit) or the base doubled (an inflated cap); scaled, the probe's cap stands."""
    tracker, probe_fit = _probed(0.36e-3, 0.16e-6)
    probe_cap = tracker.cap(50_000)
    for load, t in line(0.65e-3, 0.0, [200, 230, 260], lf.REFIT_EVERY // 2, random.Random(2)):
        tracker.record(load, t)
    fit = tracker.fit
    assert fit is not probe_fit and tracker.refits_rejected == 0
    scale = fit.base_s / probe_fit.base_s
    assert fit.per_token_s / probe_fit.per_token_s == pytest.approx(scale) and scale > 1.4
    assert tracker.cap(50_000) == pytest.approx(probe_cap, abs=1)


def test_a_rejected_refit_keeps_the_fit_logs_why_and_is_counted(caplog):
    """Real steps over an octave of load that do not grow with it (every step dominated by
    something else): no fit; the refit is rejected, not silently."""
    tracker, probe_fit = _probed(0.36e-3, 0.16e-6)
    with caplog.at_level("DEBUG", logger="parrot.engine.core.latency_fit"):
        rows = line(0.65e-3, 0.0, [200, 300, 450], lf.REFIT_EVERY, random.Random(2))
        for i in range(lf.REFIT_EVERY):  # the three loads in turn
            for load, t in rows[i :: lf.REFIT_EVERY]:
                tracker.record(load, t)
    assert tracker.fit is probe_fit
    assert tracker.refits_rejected == 3 and tracker.report(50_000)["latency_refits_rejected"] == 3
    assert "under the 5% a fit needs" in tracker.rejection and "200" in tracker.rejection
    records = [r for r in caplog.records if "latency refit rejected" in r.getMessage()]
    assert [r.levelname for r in records] == ["WARNING", "DEBUG", "DEBUG"]  # at most one warning a minute
    assert tracker.rejection in records[-1].getMessage()
    assert EngineStats(**tracker.report(50_000)).latency_refits_rejected == 3
    # without a probe, real steps under an octave cannot fit either
    alone = StepLatency()
    for load, t in line(0.65e-3, 1e-6, [200, 260], lf.REFIT_EVERY // 2, random.Random(3)):
        alone.record(load, t)
    assert alone.fit is None and alone.refits_rejected == 1 and "less than an octave" in alone.rejection
    alone.refit()  # on demand (a backend's first fit): not a periodic refit, never counted
    assert alone.refits_rejected == 1 and fit_or_why([]) == (None, "no decode steps")


@pytest.mark.timing
def test_cpu_steps_are_timed_on_the_engine_threads_own_clock():
    """On the CPU a step's time is the thread's CPU time: waiting (for the GIL, a core, here a
    sleep) is not counted, computing is; CUDA reads the wall clock."""
    started = lp.step_start("cpu")
    time.sleep(0.05)
    assert lp.step_seconds(started, "cpu") < 0.02
    started = lp.step_start("cpu")
    until = time.perf_counter() + 0.2  # computing for 0.2 s of wall time: counted, at least in
    while time.perf_counter() < until:  # part even with other processes on every core
        pass
    assert lp.step_seconds(started, "cpu") > 0.02


# ------------------------------------------------------------------ the probe on the tiny model
@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch on one thread: two OpenMP threads on a 2-core machine that another process keeps
    busy stall at every barrier (every tiny-model step then takes ~150 ms, whatever its load),
    which is what the probe would measure."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.timing
def test_probe_on_the_tiny_model_gives_a_positive_cap_quickly_without_counting_its_steps(
    tiny_model: LoadedModel, one_thread
):
    engine = LocalEngine(tiny_model, max_step_tokens=256)  # the probe runs before it returns
    try:
        stats = asyncio.run(engine.stats())
        runner = engine.runner
        assert runner.latency.fit is not None
        assert stats.latency_cap_source == "measured"
        assert min(lf.MIN_LATENCY_CAP_TOKENS, stats.token_capacity) <= stats.latency_cap_tokens
        assert stats.latency_cap_tokens <= stats.token_capacity
        assert engine.latency_cap_tokens == stats.latency_cap_tokens
        assert stats.decode_ms_base > 0 and stats.decode_ms_per_1k_tokens >= 0
        assert stats.decode_ms_target == pytest.approx(1.25 * stats.decode_ms_base, rel=0.01)
        # 3 loads x 3 steps or more (a noisy machine), fewer if one made it hit its time budget
        assert 2 <= stats.decode_steps_fitted <= len(lp.PROBE_SEQS) * lp.PROBE_MAX_STEPS
        probe_s = runner.latency.probe_s
        assert probe_s is not None and probe_s < lp.PROBE_BUDGET_S + 2, probe_s  # ms on an idle machine
        # its fabricated prompts tell what a prompt token costs
        assert stats.prefill_tokens_per_decode_step > 0
        # no fill counted, nothing left behind, no step counted as the engine's
        assert stats.fills == stats.filled_tokens == stats.generates == 0
        assert stats.num_contexts == 0 and stats.kv_blocks_used == 0 and runner.counters["steps"] == 0
    finally:
        engine.close()


@pytest.mark.timing
def test_probe_stops_at_its_time_budget_and_leaves_nothing_behind(tiny_model: LoadedModel, monkeypatch):
    monkeypatch.setattr(lp, "PROBE_BUDGET_S", 0.0)  # as if every step took seconds
    engine = LocalEngine(tiny_model)
    try:
        stats = asyncio.run(engine.stats())
        assert (stats.latency_cap_tokens, stats.latency_cap_source) == (0, "none")  # unknown for now
        assert stats.num_contexts == 0 and stats.kv_blocks_used == 0 and engine.runner.counters["steps"] == 0
        assert engine.runner.latency.probe_s is not None and engine.runner.latency.probe_s < 2.0
    finally:
        engine.close()


def test_engine_with_a_fixed_cap_skips_the_probe(tiny_model: LoadedModel):
    engine = LocalEngine(tiny_model, latency_cap=3000)
    try:
        stats = asyncio.run(engine.stats())
        assert (stats.latency_cap_tokens, stats.latency_cap_source) == (3000, "fixed")
        assert engine.runner.latency.probe_s is None and stats.decode_steps_fitted == 0
    finally:
        engine.close()


def _generate_beside(engine: LocalEngine, busy: bool) -> tuple[list[int], list[int]]:
    """Fill 197 prompt tokens and generate ``REFIT_EVERY + 8`` more on ``engine``, with (``busy``)
    a coroutine keeping the event loop busy meanwhile (about half the time: Python work holding
    the GIL in runs of about half a millisecond, as a manager's loop beside an in-process engine
    does, between short waits); returns the loads of the real decode steps recorded into the fit,
    and the busy coroutine's rounds.  (A loop that never waits, only yields with ``sleep(0)``,
    starves the engine thread of the GIL altogether on a loaded machine: CPython hands the GIL
    back and forth without the waiting thread ever getting it for long.)"""
    tracker = engine.runner.latency
    loads: list[int] = []
    record = tracker.record

    def spy(load: int, seconds: float, *, probe: bool = False) -> None:
        if not probe:
            loads.append(load)
        record(load, seconds, probe=probe)

    tracker.record = spy  # type: ignore[method-assign]
    spins = [0]

    async def spin(stop: asyncio.Event) -> None:
        while not stop.is_set():
            sum(range(50_000))  # ~0.5 ms of Python holding the GIL
            spins[0] += 1
            await asyncio.sleep(1e-4)  # the selector waits (a millisecond: its resolution)

    async def run() -> None:
        stop = asyncio.Event()
        spinner = asyncio.create_task(spin(stop)) if busy else None
        await engine.fill(list(range(3, 200)), 1)
        sp = SamplingParams(max_tokens=lf.REFIT_EVERY + 8, temperature=0.0, ignore_eos=True)
        async for _ in engine.generate(sp, 1):
            pass
        await engine.free_context(1)
        stop.set()
        if spinner is not None:
            await spinner

    try:
        asyncio.run(run())
    finally:
        tracker.record = record  # type: ignore[method-assign]
    return loads, spins


@pytest.mark.timing
@pytest.mark.parametrize("busy", [False, True], ids=["idle-loop", "busy-loop"])
def test_real_decode_steps_are_timed_and_refine_the_fit(tiny_model: LoadedModel, one_thread, busy: bool):
    """Real decode steps refit the probe's line, also with the event loop busy beside the
    engine (its GIL takes and token deliveries are not the engine's time): the refit is
    accepted, not counted as rejected, and built from the real steps."""
    engine = LocalEngine(tiny_model)
    try:
        probed = asyncio.run(engine.stats())
        probe_fit = engine.runner.latency.fit
        assert probed.decode_steps_fitted > 0 and probe_fit is not None
        loads, spins = _generate_beside(engine, busy)
        # every decode step (the first token comes from the prefill's logits), not the prefill
        assert loads == list(range(198, 198 + lf.REFIT_EVERY + 7))
        assert spins[0] > (8 if busy else -1)  # the loop really was busy
        stats = asyncio.run(engine.stats())
        # refitted after REFIT_EVERY of them: the real loads with the probe's (under an octave alone)
        assert stats.latency_refits_rejected == 0, engine.runner.latency.rejection
        assert stats.latency_cap_source == "measured"
        per_bucket = collections.Counter(lf._bucket(load) for load in loads[: lf.REFIT_EVERY])
        real = sum(min(n, lf.WINDOW) for n in per_bucket.values())  # each bucket keeps its last WINDOW
        assert stats.decode_steps_fitted == probed.decode_steps_fitted + real
        assert engine.runner.latency.fit is not probe_fit
    finally:
        engine.close()


def test_without_a_probe_the_cap_is_unknown(tiny_model: LoadedModel):
    engine = LocalEngine(tiny_model, latency_probe=False)
    try:
        stats = asyncio.run(engine.stats())
        assert (stats.latency_cap_tokens, stats.latency_cap_source) == (0, "none")
        assert engine.runner.latency.probe_s is None
    finally:
        engine.close()


class _FlatStepClock:
    """A step clock that reads the same time for every step, whatever its load: as if
    something else dominated every step (a busy machine).  Injected in place of
    :class:`~parrot.engine.latency_probe.StepClock`, so the timings are exactly flat (a
    busy-wait added to the real step would leave the real step's own growth with load in
    them, which on some machines passes ``MIN_GROWTH``)."""

    def __init__(self, device: str) -> None:
        self.device = device

    def seconds(self) -> float:
        return 0.15


@pytest.mark.timing
def test_probe_leaves_the_cap_unknown_when_steps_do_not_grow_with_load(
    tiny_model: LoadedModel, one_thread, monkeypatch
):
    runner = EngineRunner(tiny_model, kv_cache_tokens=16_384)
    monkeypatch.setattr(lp, "StepClock", _FlatStepClock)
    runner.probe_latency()
    assert runner.latency.fit is None and runner.latency.cap(runner.token_capacity) == 0
    assert runner.latency.probe_s is not None  # it ran, and timed its steps with the flat clock
    assert runner.contexts.all_ids() == [] and runner.pool.num_used == 0
    monkeypatch.undo()
    torch.set_num_threads(1)  # (undone too)
    # the same engine undisturbed
    runner = EngineRunner(tiny_model, kv_cache_tokens=16_384)
    runner.probe_latency()
    assert runner.latency.fit is not None
    assert runner.latency.cap(runner.token_capacity) >= lf.MIN_LATENCY_CAP_TOKENS


def test_engines_endpoint_shows_the_cap(tiny_model: LoadedModel):
    engine = LocalEngine(tiny_model, latency_cap=2500)  # fixed: not at the mercy of a busy machine
    manager = Manager(ManagerConfig())
    manager.pool.register(engine, name="fixed")
    server = start_server(manager)
    try:
        [info] = httpx.get(f"{server.url}/v1/engines", timeout=10).json()
        stats = info["stats"]
        assert (stats["latency_cap_tokens"], stats["latency_cap_source"]) == (2500, "fixed")
        fit = ("decode_ms_base", "decode_ms_per_1k_tokens", "decode_ms_target", "decode_steps_fitted")
        for field in (*fit, "prefill_tokens_per_decode_step"):
            assert field in stats
        [snap] = manager.executor.snapshots()
        assert snap.latency_cap_tokens == 2500
    finally:
        server.stop()
        engine.close()


def test_cli_latency_options():
    parser = _parser()
    serve = parser.parse_args(["serve"])
    assert serve.latency_cap is None and serve.latency_factor == lf.LATENCY_FACTOR
    assert serve.latency_target_ms is None
    engine = parser.parse_args(["engine", "--manager", "http://m", "--latency-cap", "2000"])
    assert engine.latency_cap == 2000
    engine = parser.parse_args(["engine", "--manager", "http://m", "--latency-target-ms", "45"])
    assert engine.latency_cap is None and engine.latency_target_ms == 45.0
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    help_text = " ".join(sub.choices["serve"].format_help().split())
    assert "--latency-cap" in help_text and "each engine's own cap" in help_text
    assert "--latency-target-ms" in help_text and "--latency-factor" in help_text


# ------------------------------------------------------------------ the manager
class HeldEngine(GatedEngine):
    """A :class:`GatedEngine` whose gate starts closed, so generations hold their KV until
    released; reports a latency cap in its stats."""

    def __init__(self, tokenizer: TextTokenizer, latency_cap_tokens: int | None):
        super().__init__(tokenizer)
        self.gate.clear()
        self.latency_cap_tokens = latency_cap_tokens or 0

    @property
    def running(self) -> int:
        return len(self.generated)

    async def stats(self) -> EngineStats:
        return EngineStats(token_capacity=32768, latency_cap_tokens=self.latency_cap_tokens)


async def until_running(engines: Sequence[HeldEngine], n: int) -> None:
    """Wait (up to a second) until ``n`` generations have begun over ``engines``."""
    for _ in range(200):
        if sum(e.running for e in engines) == n:
            return
        await asyncio.sleep(0.005)


async def release_and_drain(manager: Manager, engines: Sequence[HeldEngine]) -> None:
    for e in engines:
        e.gate.set()
    await manager.executor.drain()


def latency_call(manager: Manager, session, i: int):
    # ~40 prompt tokens + 160 new: about 200 tokens each; a LATENCY output
    binding = PlaceholderBinding(name="y", sampling={"max_tokens": 160}, criteria="LATENCY")
    body = SubmitCall(
        template=f"Question {i}: say something short please. {{{{output:y}}}}", placeholders=[binding]
    )
    return manager.submit_call(session, body)


def test_the_scheduler_keeps_each_engine_under_its_own_reported_cap():
    """Engine a measured a cap of 300 tokens, b one of 5,000: with ~200-token latency calls
    under the paper's rule (the cap bounds all work of an engine running latency work), a
    takes one and b the rest (under one manager-wide cap of 6,144, a would take every other)."""

    async def main() -> None:
        manager = Manager(ManagerConfig(latency_cap_scope="all", saturation_batching=False))
        tokenizer = TextTokenizer.byte_level_tiny()
        a = HeldEngine(tokenizer, 300)
        b = HeldEngine(tokenizer, 5000)
        ha, hb = manager.pool.register(a), manager.pool.register(b)
        await manager.poll_engine_stats()  # what the manager's app does on the heartbeat interval
        session = manager.create_session()[0]
        calls = [latency_call(manager, session, i) for i in range(4)]
        await until_running([a, b], 4)
        assert [c.engine_id for c in calls].count(ha.engine_id) == 1, [c.engine_id for c in calls]
        assert (a.running, b.running) == (1, 3)
        snaps = {s.engine_id: s for s in manager.executor.snapshots()}
        assert snaps[ha.engine_id].latency_cap_tokens == 300
        assert snaps[hb.engine_id].latency_cap_tokens == 5000
        await release_and_drain(manager, [a, b])

    asyncio.run(main())


def test_a_call_under_an_idle_system_prompt_joins_a_running_call_past_the_cap():
    """Two GPTs-like calls on one engine whose cap (1,500 tokens) their two ~1,100-token
    system prompts overflow.  The second call's system prompt runs nowhere, so the
    scheduler counts it in the call's tokens; saturation batching counts it as load but
    not as the call's own prompt work, and lets the call join instead of waiting for the
    first to end."""

    def gpt_call(manager: Manager, session, system: str):
        binding = PlaceholderBinding(name="y", sampling={"max_tokens": 32}, criteria="LATENCY")
        return manager.submit_call(
            session, SubmitCall(template=system + " Q: why? {{output:y}}", placeholders=[binding])
        )

    async def main() -> None:
        manager = Manager(ManagerConfig(latency_cap_scope="all"))  # saturation batching on, as by default
        engine = HeldEngine(TextTokenizer.byte_level_tiny(), 1500)
        manager.pool.register(engine)
        await manager.poll_engine_stats()
        session = manager.create_session()[0]
        first = gpt_call(manager, session, "You are a careful lighthouse keeper. " * 30)
        await until_running([engine], 1)
        second = gpt_call(manager, session, "You are a patient ship's cook. " * 36)
        await until_running([engine], 2)
        assert engine.running == 2 and first.engine_id == second.engine_id
        await release_and_drain(manager, [engine])

    asyncio.run(main())


@pytest.mark.parametrize(
    ("policy", "same_code", "running"),
    [("parrot", True, 4), ("parrot", False, 1), ("baseline-latency", True, 1)],
)
def test_calls_sharing_a_start_through_a_value_count_it_once_against_the_cap(
    policy: str, same_code: bool, running: int
):
    """Four reviewers of one piece of code (a fan-out's common context: the same ~1,000
    characters in an input value, then a line of their own), under a latency cap of 1,500
    tokens (byte tokenizer: a token a character).  Counted once, the shared start and the
    four reviewers' own ~50 tokens fit at once; counted per call (~1,070 each) only one
    would run at a time, as it still does when the code differs between calls, and under
    the request-level baseline (engines without prefix sharing)."""
    code = "def keep_the_light(lamp):\n    return lamp.trim() and lamp.lit()\n" * 15  # 990 characters

    def review(manager: Manager, session, i: int):
        value = code if same_code else f"# variant {i}\n" + code
        bindings = [
            PlaceholderBinding(name="code", value=value),
            PlaceholderBinding(name="y", sampling={"max_tokens": 16}, criteria="LATENCY"),
        ]
        template = f"Review this code.\n\n{{{{input:code}}}}\n\nReviewer {i}: a review.\n{{{{output:y}}}}"
        return manager.submit_call(session, SubmitCall(template=template, placeholders=bindings))

    async def main() -> None:
        manager = Manager(ManagerConfig(policy=policy, latency_cap_scope="all", saturation_batching=False))
        engine = HeldEngine(TextTokenizer.byte_level_tiny(), 1500)
        manager.pool.register(engine)
        await manager.poll_engine_stats()
        session = manager.create_session()[0]
        calls = [review(manager, session, i) for i in range(4)]
        await until_running([engine], running)
        await asyncio.sleep(0.05)  # no more start later
        assert engine.running == running
        engine.gate.set()
        for _ in range(200):  # the rest run once the first end: every call completes
            if all(c.state == "done" for c in calls):
                break
            await asyncio.sleep(0.005)
        assert [c.state for c in calls] == ["done"] * 4 and engine.running == 4
        await manager.executor.drain()

    asyncio.run(main())


def test_the_operator_cap_overrides_every_engine_and_heartbeats_carry_remote_caps():
    async def main() -> None:
        # latency calls spread by load (not packed), so both engines' caps show
        config = ManagerConfig(latency_cap_tokens=6000, saturation_batching=False, pack_latency=False)
        manager = Manager(config)
        tokenizer = TextTokenizer.byte_level_tiny()
        a, b = HeldEngine(tokenizer, 300), HeldEngine(tokenizer, 5000)
        ha, _ = manager.pool.register(a), manager.pool.register(b)
        remote = manager.pool.register(HeldEngine(tokenizer, None), url="http://fake")
        snaps = {s.engine_id: s for s in manager.executor.snapshots()}
        assert snaps[remote.engine_id].latency_cap_tokens == DEFAULT_LATENCY_CAP_TOKENS
        manager.pool.heartbeat(remote.engine_id, EngineStats(token_capacity=20_000, latency_cap_tokens=777))
        snaps = {s.engine_id: s for s in manager.executor.snapshots()}
        assert snaps[remote.engine_id].latency_cap_tokens == 777
        manager.pool.suspect(remote.engine_id)  # no calls for it: they go to a and b
        session = manager.create_session()[0]
        calls = [latency_call(manager, session, i) for i in range(4)]
        await until_running([a, b], 4)
        # 6,000 for both: the calls spread by load; a's own 300 would have let it take only one
        assert [c.engine_id for c in calls].count(ha.engine_id) == 2, [c.engine_id for c in calls]
        assert (a.running, b.running) == (2, 2)
        await release_and_drain(manager, [a, b])

    asyncio.run(main())


def test_each_engines_prompt_cost_reaches_its_snapshot_unless_the_operator_fixes_one():
    async def main() -> None:
        manager = Manager(ManagerConfig())
        tokenizer = TextTokenizer.byte_level_tiny()
        remote = manager.pool.register(HeldEngine(tokenizer, None), url="http://fake")
        [snap] = manager.executor.snapshots()
        assert snap.prefill_tokens_per_step == 0.0  # unknown: the scheduler's default applies
        manager.pool.heartbeat(
            remote.engine_id, EngineStats(token_capacity=20_000, prefill_tokens_per_decode_step=45.0)
        )
        [snap] = manager.executor.snapshots()
        assert snap.prefill_tokens_per_step == 45.0
        assert manager.executor.scheduler.prefill_tokens_per_step is None
        await manager.executor.drain()
        fixed = Manager(ManagerConfig(prefill_tokens_per_step=200.0))
        assert fixed.executor.scheduler.prefill_tokens_per_step == 200.0
        await fixed.executor.drain()

    asyncio.run(main())


def test_an_engine_reporting_no_cap_gets_the_papers():
    async def main() -> None:
        manager = Manager(ManagerConfig())
        h = manager.pool.register(HeldEngine(TextTokenizer.byte_level_tiny(), None))
        [snap] = manager.executor.snapshots()
        assert snap.engine_id == h.engine_id and snap.latency_cap_tokens == DEFAULT_LATENCY_CAP_TOKENS == 6144
        await manager.executor.drain()

    asyncio.run(main())

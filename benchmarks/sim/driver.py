"""The evaluation suite's workloads on Parrot's real manager over simulated engines.

Each workload (:mod:`benchmarks.suite.workloads`) runs on a fresh manager whose
engines are :class:`~parrot.sim.engine.SimEngine` (one per the workload's
``engines``), on a :class:`~parrot.sim.clock.VirtualTimeLoop`, driven the two ways
the suite's clients drive a real server (:mod:`benchmarks.suite.clients`), with
the same emulated network delays:

* ``parrot``: at its arrival an app pays one delay, then submits all its calls as
  semantic functions in one go (dependencies as variables, its criteria on its
  outputs), then waits for its outputs; its final outputs (those no call of the app
  reads) come back with the submission's answer for nothing, any other output pays
  one delay once ready (a ``get``);
* the request-level baselines: one completion per call, rendered client-side
  (:func:`benchmarks.suite.clients.render_prompt`), sent when its producers'
  text is back, each paying one delay first.

Systems are configured as the suite starts them (:mod:`benchmarks.suite.systems`):
``parrot`` (policy ``parrot``, prefix cache on), ``parrot-baseline-latency`` and
``parrot-baseline-throughput`` (request-level policies, prefix cache off); and two
the suite cannot run on CPU engines: ``parrot-no-shared-attention`` (Parrot whose
engines read a shared prefix once per sequence) and ``request-level-apc`` (the
latency-centric request-level baseline on engines with automatic prefix caching and
per-sequence attention, like vLLM's).  A
simulated engine samples a fixed token, so outputs are as long as ``max_tokens``
(the suite asks for ``ignore_eos``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from benchmarks.suite.clients import Delay, render_prompt
from benchmarks.suite.spec import AppRecord, AppSpec, CallRecord, RunRecord, Workload

from parrot.manager.openai.response import Completion
from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import PlaceholderBinding, SubmitCall
from parrot.protocol.tokenizer import TextTokenizer
from parrot.sim import clock as sim_clock
from parrot.sim.cost import CostProfile, StepCost
from parrot.sim.engine import SimEngine

__all__ = ["SYSTEMS", "SimSystem", "simulate", "simulate_on"]

MODEL = "sim"


@dataclass(frozen=True)
class SimSystem:
    """``share_prefix``: the engines' attention reads a block that several sequences share
    once for all of them (Parrot's shared-prefix kernel) or once per sequence (vLLM's
    paged attention)."""

    policy: str
    prefix_cache: bool
    request_level: bool
    share_prefix: bool = True
    program_scheduling: bool = False
    early_prefill: bool = True


SYSTEMS = {
    "parrot": SimSystem("parrot", prefix_cache=True, request_level=False),
    "parrot-program-scheduling": SimSystem(
        "parrot", prefix_cache=True, request_level=False, program_scheduling=True
    ),
    "parrot-no-early-prefill": SimSystem(
        "parrot", prefix_cache=True, request_level=False, early_prefill=False
    ),
    "parrot-no-affinity": SimSystem("no-affinity", prefix_cache=True, request_level=False),
    "parrot-no-deduction": SimSystem("no-deduction", prefix_cache=True, request_level=False),
    "parrot-no-shared-attention": SimSystem(
        "parrot", prefix_cache=True, request_level=False, share_prefix=False
    ),
    "parrot-baseline-latency": SimSystem("baseline-latency", prefix_cache=False, request_level=True),
    "parrot-baseline-throughput": SimSystem("baseline-throughput", prefix_cache=False, request_level=True),
    # the suite's like-for-like baseline: request-level, every request admitted, prefix cache on
    "parrot-baseline-throughput-apc": SimSystem("baseline-throughput", prefix_cache=True, request_level=True),
    # vLLM-like: request-level, latency cap, automatic prefix caching, per-sequence attention
    "request-level-apc": SimSystem(
        "baseline-latency", prefix_cache=True, request_level=True, share_prefix=False
    ),
}


def _sampling(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


async def _parrot_app(manager: Manager, app: AppSpec, delay: Delay) -> AppRecord:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, app.arrival_s - loop.time()))
    start = loop.time()
    record = AppRecord(app.app_id, app.kind, app.arrival_s, start, start)
    await delay()  # the submission's trip
    session, _ = manager.create_session()
    calls = {}
    for spec in app.calls:  # all at once: nothing runs before the last is linked
        placeholders = [
            PlaceholderBinding(name=k, direction="input", value=v) for k, v in spec.consts.items()
        ]
        placeholders += [
            PlaceholderBinding(name=k, direction="input", var_id=calls[dep].outputs[dep].var.var_id)
            for k, dep in spec.deps.items()
        ]
        criteria = (
            ("LATENCY" if app.criteria == "latency" else "THROUGHPUT") if spec.name in app.outputs else None
        )
        placeholders.append(
            PlaceholderBinding(
                name=spec.name, direction="output", sampling=_sampling(spec.max_tokens), criteria=criteria
            )
        )
        calls[spec.name] = manager.submit_call(
            session, SubmitCall(template=spec.template, placeholders=placeholders)
        )

    read_inside = {dep for spec in app.calls for dep in spec.deps.values()}

    async def fetch(name: str) -> float:
        var = calls[name].outputs[name].var
        while var.state == "pending":
            await manager.wait_variable(var, 60.0)
        if var.state != "ready":
            raise RuntimeError(f"{app.app_id}/{name}: {var.error}")
        if name in read_inside:  # not in the submission's answer: a get of its own
            await delay()
        return loop.time()

    try:
        ends = await asyncio.gather(*(fetch(name) for name in app.outputs))
        record.end_s = max(ends)
    except RuntimeError as exc:
        record.end_s, record.error = loop.time(), str(exc)
    record.calls = [
        CallRecord(
            name,
            (c.dispatched_at or 0.0) - _wall_offset(),
            (c.finished_at or 0.0) - _wall_offset(),
            c.prompt_tokens,
            c.generated_tokens,
            engine=c.engine_id,
            first_token_s=None if c.first_token_at is None else c.first_token_at - _wall_offset(),
        )
        for name, c in calls.items()
    ]
    record.delays, record.delay_s = delay.count, delay.total_s
    manager.close_session(session)
    return record


async def _baseline_app(manager: Manager, app: AppSpec, delay: Delay) -> AppRecord:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, app.arrival_s - loop.time()))
    start = loop.time()
    record = AppRecord(app.app_id, app.kind, app.arrival_s, start, start)
    texts: dict[str, str] = {}
    tasks: dict[str, asyncio.Task[None]] = {}
    records: dict[str, CallRecord] = {}

    async def run_call(spec: Any) -> None:
        await asyncio.gather(*(tasks[dep] for dep in spec.deps.values()))
        prompt = render_prompt(spec, texts)
        await delay()
        sent = loop.time()
        sampling = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
        comp = await Completion.open(manager, prompt, sampling, MODEL, "anonymous", chat=False)
        try:
            await comp.wait_value()
            await comp.wait_call()
            if comp.var.state != "ready":
                raise RuntimeError(f"{app.app_id}/{spec.name}: {comp.error()}")
            texts[spec.name] = comp.var.value or ""
            first = comp.call.first_token_at
            records[spec.name] = CallRecord(
                spec.name, sent, loop.time(), comp.call.prompt_tokens, comp.call.generated_tokens,
                ready_s=sent, first_token_s=None if first is None else first - _wall_offset(),
            )  # fmt: skip
        finally:
            comp.close()

    for spec in app.calls:
        tasks[spec.name] = asyncio.get_running_loop().create_task(run_call(spec))
    try:
        await asyncio.gather(*tasks.values())
        record.end_s = loop.time()  # the last answer's stream ended: the app has its outputs
    except RuntimeError as exc:
        record.error = str(exc)
        record.end_s = loop.time()
    record.calls = list(records.values())
    record.delays, record.delay_s = delay.count, delay.total_s
    return record


def _wall_offset() -> float:
    """``clock.wall() - loop.time()``: maps the manager's timestamps to the virtual clock."""
    from parrot.protocol import clock

    return clock.wall() - clock.monotonic()


async def _run(workload: Workload, system: SimSystem, cost: StepCost, tokenizer: TextTokenizer, seed: int,
               delay_ms: tuple[float, float], latency_cap: int | None,
               kv_cache_tokens: int | None, pack_latency: bool) -> list[AppRecord]:  # fmt: skip
    config = ManagerConfig(
        policy=system.policy,
        latency_cap_tokens=latency_cap,
        inline_tokenize_bytes=None,
        pack_latency=pack_latency,
        program_scheduling=system.program_scheduling,
        early_prefill=system.early_prefill,
    )
    manager = Manager(config)
    engines = [
        SimEngine(
            tokenizer,
            cost,
            model_name=MODEL,
            prefix_cache=system.prefix_cache,
            share_prefix=system.share_prefix,
            answer_seed=i,
            kv_cache_tokens=kv_cache_tokens,
        )
        for i in range(workload.engines)
    ]
    # engines named by their place in the run (the pool's ids count on across runs)
    names = {manager.pool.register(engine).engine_id: f"engine {i}" for i, engine in enumerate(engines)}
    await manager.poll_engine_stats()
    run_app = _baseline_app if system.request_level else _parrot_app
    try:
        apps = await asyncio.gather(
            *(
                run_app(manager, app, Delay(*delay_ms, seed=f"{seed}/{workload.name}/{app.app_id}"))
                for app in workload.apps
            )
        )
        for record in apps:
            for call in record.calls:
                call.engine = names.get(call.engine or "", call.engine)
        return list(apps)
    finally:
        await manager.executor.drain()
        for engine in engines:
            await engine.close()


def simulate(
    workload: Workload,
    system: str,
    cost: StepCost,
    tokenizer: TextTokenizer,
    *,
    seed: int = 0,
    repeat: int = 0,
    delay_ms: tuple[float, float] = (200.0, 300.0),
    latency_cap: int | None = None,
    kv_cache_tokens: int | None = None,
    pack_latency: bool = True,
    isolated: bool = False,
) -> RunRecord:
    """One workload on one system, in virtual time (deterministic for the arguments).
    ``kv_cache_tokens``: each engine's KV pool (None: the simulated engine's default); its
    token capacity is the pool, as the real engine's default.  ``pack_latency``: the
    manager's option of that name (``parrot serve --[no-]pack-latency``).  ``isolated``:
    each app runs alone, on a fresh manager and engines, its record shifted to its own
    arrival (the suite's ``--isolated``): its latency with nothing else on the system."""
    spec = SYSTEMS[system]

    def run(w: Workload) -> list[AppRecord]:
        return sim_clock.run(
            _run(w, spec, cost, tokenizer, seed, delay_ms, latency_cap, kv_cache_tokens, pack_latency)
        )

    if isolated:
        apps = []
        for app in sorted(workload.apps, key=lambda a: a.arrival_s):
            (alone,) = run(dataclasses.replace(workload, apps=(dataclasses.replace(app, arrival_s=0.0),)))
            apps.append(_shifted(alone, app.arrival_s))
    else:
        apps = run(workload)
    wall = max((a.end_s for a in apps), default=0.0)
    return RunRecord(system, workload.name, workload.figure, dict(workload.params), repeat, wall, apps)


def _shifted(record: AppRecord, offset_s: float) -> AppRecord:
    """``record`` (of an app run from time 0) with every time moved on by ``offset_s``."""

    def move(t: float | None) -> float | None:
        return None if t is None else t + offset_s

    calls = [
        dataclasses.replace(
            c,
            start_s=c.start_s + offset_s,
            end_s=c.end_s + offset_s,
            ready_s=move(c.ready_s),
            first_token_s=move(c.first_token_s),
        )
        for c in record.calls
    ]
    return dataclasses.replace(
        record,
        arrival_s=record.arrival_s + offset_s,
        start_s=record.start_s + offset_s,
        end_s=record.end_s + offset_s,
        calls=calls,
    )


def simulate_on(
    workload: Workload,
    system: str,
    profile: CostProfile,
    tokenizer: TextTokenizer,
    *,
    seed: int = 0,
    repeat: int = 0,
    latency_cap: int | None = None,
    pack_latency: bool = True,
    kv_cache_tokens: int | None = None,
    isolated: bool = False,
) -> RunRecord:
    """:func:`simulate` on engines of ``profile`` (its step cost and KV pool, or a pool of
    ``kv_cache_tokens``); the run's ``extra`` names the profile and the wall time the
    simulation took."""
    started = time.perf_counter()
    run = simulate(
        workload,
        system,
        profile.cost,
        tokenizer,
        seed=seed,
        repeat=repeat,
        latency_cap=latency_cap,
        kv_cache_tokens=profile.kv_cache_tokens if kv_cache_tokens is None else kv_cache_tokens,
        pack_latency=pack_latency,
        isolated=isolated,
    )
    if isolated:
        run.extra["isolated"] = True
    run.extra.update(cost=profile.name, sim_wall_s=time.perf_counter() - started)
    return run

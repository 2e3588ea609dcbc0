"""The simulator: virtual time, the simulated engine against the real engine's planning,
and the real manager on simulated engines, deterministic for a seed."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from parrot.engine.core.jobs import Job
from parrot.engine.core.step_planner import ENGINE_COUNTERS
from parrot.engine.loader import LoadedModel
from parrot.engine.runner import EngineRunner
from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol import clock
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import PlaceholderBinding, SubmitCall
from parrot.protocol.tokenizer import TextTokenizer
from parrot.sim import clock as sim_clock
from parrot.sim.cost import StepCost
from parrot.sim.engine import SimEngine

COST = StepCost(base=0.010, per_prefill_token=0.0005, per_decode_seq=0.0003, per_kv_token=0.000001)


# ------------------------------------------------------------------ the clock


def test_virtual_time_jumps_to_the_next_timer_and_runs_threads_inline() -> None:
    async def main() -> tuple[float, float, list[str]]:
        loop = asyncio.get_running_loop()
        order: list[str] = []
        started = loop.time()

        async def sleeper(name: str, s: float) -> None:
            await asyncio.sleep(s)
            order.append(name)

        await asyncio.gather(sleeper("long", 3600.0), sleeper("short", 60.0))
        offloaded = await asyncio.to_thread(lambda: "done in no virtual time")
        order.append(offloaded)
        return loop.time() - started, clock.monotonic() - loop.time(), order

    real = time.monotonic()
    elapsed, skew, order = sim_clock.run(main(), start=1000.0)
    assert time.monotonic() - real < 5.0  # an hour of virtual time in moments
    assert elapsed == pytest.approx(3600.0) and skew == 0.0
    assert order == ["short", "long", "done in no virtual time"]


# ------------------------------------------------- the engine and the planner


def _requests(seed: int) -> list[Job]:
    """Prompts sharing a prefix, forks of them and generates, sized to overflow a small KV pool."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(40)]
    jobs: list[Job] = []
    for i in range(6):
        tokens = shared + [rng.randrange(3, 250) for _ in range(rng.randrange(5, 30))]
        jobs.append(Job(100 + i, None, tokens))
        jobs.append(
            Job(100 + i, None, sampling=SamplingParams(max_tokens=rng.randrange(30, 60), ignore_eos=True))
        )
    for i in range(4):  # forks of the first contexts, generating at once
        jobs.append(Job(200 + i, 100 + i, [rng.randrange(3, 250) for _ in range(7)]))
        jobs.append(Job(200 + i, None, sampling=SamplingParams(max_tokens=12, ignore_eos=True)))
    return jobs


OPTIONS = {"max_step_tokens": 64, "kv_cache_tokens": 256, "token_capacity": 4096}


def _runner_plans(tiny_model: LoadedModel, jobs: list[Job], token: int) -> tuple[list, dict]:
    runner = EngineRunner(tiny_model, **OPTIONS)
    plans: list[tuple] = []
    reserve = runner.planner.reserve

    def recorded(plan):
        got = reserve(plan)
        if got:
            plans.append(tuple((s.ctx.context_id, s.start, s.n) for _, s in got))
        return got

    runner.planner.reserve = recorded  # type: ignore[method-assign]
    runner._sample = lambda js, logits: [runner._advance(j, token, set()) for j in js]  # type: ignore[method-assign]
    for job in jobs:
        runner._enqueue(job)
    while runner.has_work():
        runner._step()
    return plans, dict(runner.counters)


def _sim_plans(jobs: list[Job]) -> tuple[list, dict, float]:
    async def main() -> tuple[list, dict, float]:
        sim = SimEngine(TextTokenizer.byte_level_tiny(), COST, record_steps=True, max_seq_len=2048, **OPTIONS)
        for job in jobs:
            sim.enqueue(job)
        while sim.planner.running or sim.planner.waiting:
            async with sim._stepping:
                await sim._step()
        assert sim.steps is not None
        return [r[2] for r in sim.steps], dict(sim.counters), asyncio.get_running_loop().time()

    return sim_clock.run(main())


@pytest.mark.parametrize("vocabulary", ["smollm2", "tiny"])
def test_a_simulated_answer_costs_a_later_prompt_as_many_tokens_as_it_has(vocabulary: str) -> None:
    """A real answer of n tokens, pasted into the next call's prompt, adds about n
    tokens to it; the simulated answer must too, or every chain and multi-agent
    history is simulated shorter than it runs (a run of bare "x" merges four to a
    token in SmolLM2's vocabulary)."""
    if vocabulary == "smollm2":
        from gguf import GGUFReader

        from parrot.engine.loader import smollm2_gguf_path

        tokenizer = TextTokenizer.from_gguf_metadata(GGUFReader(str(smollm2_gguf_path())))
    else:
        tokenizer = TextTokenizer.byte_level_tiny()

    async def answer() -> str:
        sim = SimEngine(tokenizer, COST, max_seq_len=2048, **OPTIONS)
        await sim.fill(tokenizer.encode("Write the plan."), 1)
        text = "".join([c.text async for c in sim.generate(SamplingParams(max_tokens=64), 1)])
        await sim.close()
        return text

    text = sim_clock.run(answer())
    prompt = "Plan: {}\nNow write the code."
    extra = len(tokenizer.encode(prompt.format(text))) - len(tokenizer.encode(prompt.format("")))
    assert 62 <= extra <= 66


def test_simulated_answers_of_different_calls_differ_so_prompts_quoting_them_do_not_share() -> None:
    """Two reduces quoting their own maps' answers must not find each other's prompt in the
    prefix cache: real answers differ, and answers all alike made every reduce of fig. 19
    a hit on the last one (720 of its 723 tokens), a third of the run's prompt work."""

    async def answers() -> tuple[list[str], int]:
        tokenizer = TextTokenizer.byte_level_tiny()
        sim = SimEngine(tokenizer, COST, max_seq_len=2048, **OPTIONS)
        texts = []
        for context_id in (1, 2, 3):
            await sim.fill(tokenizer.encode("Summarise."), context_id)
            chunks = [c.text async for c in sim.generate(SamplingParams(max_tokens=24), context_id)]
            texts.append("".join(chunks))
        prompt = tokenizer.encode("Combine: " + "; ".join(texts[:2]))
        other = tokenizer.encode("Combine: " + "; ".join(texts[1:]))
        await sim.fill(prompt, 10)
        reused = await sim.fill(other, 11)
        await sim.close()
        return texts, reused

    texts, reused = sim_clock.run(answers())
    assert len(set(texts)) == 3 and all(len(t) == 24 for t in texts)
    assert reused < len("Combine: ") + 12  # at most the words both start with
    assert sim_clock.run(answers())[0] == texts  # deterministic


def test_the_simulated_engine_admits_preempts_and_forks_as_the_real_one(tiny_model: LoadedModel) -> None:
    token = TextTokenizer.byte_level_tiny().encode("x")[0]
    real_plans, real_counters = _runner_plans(tiny_model, _requests(1), token)
    sim_plans, sim_counters, elapsed = _sim_plans(_requests(1))
    assert real_counters["preemptions"] > 0 and real_counters["cached_tokens"] > 0  # the test covers them
    assert sim_plans == real_plans
    for key in ENGINE_COUNTERS:
        assert sim_counters[key] == real_counters[key], key
    assert elapsed > COST.base * len(sim_plans)  # each step took its modelled time


# ------------------------------------------------ the manager in virtual time


def _submit(manager: Manager, session, template: str, **bindings) -> object:
    placeholders = [
        PlaceholderBinding(name=n, **b) if isinstance(b, dict) else PlaceholderBinding(name=n, value=b)
        for n, b in bindings.items()
    ]
    return manager.submit_call(session, SubmitCall(template=template, placeholders=placeholders))


def _run_apps(seed: int) -> list[tuple]:
    async def main() -> list[tuple]:
        manager = Manager(ManagerConfig(inline_tokenize_bytes=None))
        engines = [SimEngine(TextTokenizer.byte_level_tiny(), COST, model_name="tiny") for _ in range(2)]
        for e in engines:
            manager.pool.register(e)
        await manager.poll_engine_stats()
        rng = random.Random(seed)
        calls = []
        for app in range(4):  # chains and map-reduces arriving over a few virtual seconds
            await asyncio.sleep(rng.uniform(0.0, 2.0))
            session = manager.create_session()[0]
            doc = "Some document text. " * rng.randrange(5, 20)
            maps = [
                _submit(
                    manager,
                    session,
                    "Summarise {{input:d}} part " + str(i) + ": {{output:s}}",
                    d=doc,
                    s={"sampling": {"max_tokens": rng.randrange(10, 40), "ignore_eos": True}},
                )
                for i in range(1 + app)
            ]
            parts = " ".join(f"{{{{input:p{i}}}}}" for i in range(len(maps)))
            final = _submit(
                manager, session, f"Combine {parts}: {{{{output:out}}}}",
                **{f"p{i}": {"var_id": m.outputs["s"].var.var_id} for i, m in enumerate(maps)},
                out={"sampling": {"max_tokens": 20, "ignore_eos": True}, "criteria": "LATENCY"},
            )  # fmt: skip
            calls += [*maps, final]
        for call in calls:
            for out in call.outputs.values():
                await manager.wait_variable(out.var, 60.0)
                while out.var.state == "pending":
                    await manager.wait_variable(out.var, 60.0)
        await manager.executor.drain()
        for e in engines:
            await e.close()
        return [
            (
                c.state,
                c.engine_id,
                c.objective,
                c.submitted_at,
                c.dispatched_at,
                c.first_token_at,
                c.finished_at,
            )
            for c in calls
        ]

    return sim_clock.run(main())


def test_a_run_is_deterministic_for_a_seed_and_fast() -> None:
    real = time.monotonic()
    first = _run_apps(7)
    second = _run_apps(7)
    assert time.monotonic() - real < 60.0
    assert all(state == "done" for state, *_ in first)
    assert len({engine for _, engine, *_ in first}) == 2  # both engines served
    assert [row[2:] for row in first] == [row[2:] for row in second]  # objectives and every timestamp
    assert _run_apps(8) != first  # another seed, another run


# -------------------------------------------------- the suite in simulation


def test_the_suite_runs_in_simulation_and_parrot_saves_the_round_trips() -> None:
    from benchmarks.sim.driver import simulate
    from benchmarks.suite.workloads import generate

    tiny = TextTokenizer.byte_level_tiny()
    workload = generate("fig11", 0.2, 0)[0]  # one chain summary
    parrot = simulate(workload, "parrot", COST, tiny)
    baseline = simulate(workload, "parrot-baseline-latency", COST, tiny)
    assert all(a.error is None for a in parrot.apps + baseline.apps)
    (app,) = workload.apps
    assert parrot.apps[0].delays == 1 and baseline.apps[0].delays == len(app.calls)
    assert parrot.apps[0].latency_s < baseline.apps[0].latency_s
    assert len(parrot.apps[0].calls) == len(baseline.apps[0].calls) == len(app.calls)
    assert simulate(workload, "parrot", COST, tiny) == parrot  # deterministic


def test_repeats_draw_the_suites_seeds_and_compare_mean_for_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--repeats 2`` runs repeat r on the workloads of seed + r, as the suite does, and
    ``--compare`` sets the mean over the simulated repeats beside the real mean."""
    import json

    from benchmarks.sim import __main__ as sim_cli
    from benchmarks.suite.workloads import generate

    out = tmp_path / "runs.json"
    argv = ["--figures", "fig11", "--scale", "0.2", "--tokenizer", "tiny", "--systems", "parrot"]
    assert sim_cli.main([*argv, "--repeats", "2", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())
    first = generate("fig11", 0.2, 0)
    assert len(runs) == 2 * len(first)
    assert generate("fig11", 0.2, 1)[0].apps != first[0].apps  # the two repeats are different draws
    name = first[0].name
    means = [
        sum(a["end_s"] - a["arrival_s"] for a in r["apps"]) / len(r["apps"])
        for r in runs
        if r["workload"] == name
    ]
    assert len(means) == 2 and means[0] != means[1]
    real = tmp_path / "raw.json"
    real.write_text(json.dumps([{**r, "system": "parrot"} for r in runs if r["workload"] == name][:1]))
    capsys.readouterr()
    assert sim_cli.main([*argv, "--repeats", "2", "--compare", str(real)]) == 0
    row = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith(name) and "parrot " in line
    )
    measured, simulated = (float(v) for v in row.split()[2:4])
    assert measured == pytest.approx(means[0], abs=0.006)
    assert simulated == pytest.approx(sum(means) / 2, abs=0.006)


def test_repeats_below_one_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.sim import __main__ as sim_cli

    with pytest.raises(SystemExit) as exit_:
        sim_cli.main(["--figures", "fig11", "--repeats", "0"])
    assert exit_.value.code == 2 and "must be at least 1, got 0" in capsys.readouterr().err


def test_latency_packing_is_the_managers_option_in_simulation() -> None:
    """``pack_latency`` reaches the simulated manager: a run of GPTs apps on two engines
    places its calls differently with and without it, and asking for it gives the
    default's run (the server's default: on)."""
    from benchmarks.sim.driver import simulate
    from benchmarks.suite.workloads import generate

    tiny = TextTokenizer.byte_level_tiny()
    workload = next(w for w in generate("fig17", 0.2, 0) if w.name == "fig17/rate=4.0")
    packed = simulate(workload, "parrot", COST, tiny)
    spread = simulate(workload, "parrot", COST, tiny, pack_latency=False)
    assert all(a.error is None for a in packed.apps + spread.apps)

    def placements(run) -> list:
        return [(a.app_id, c.name, c.engine) for a in run.apps for c in a.calls]

    assert placements(packed) != placements(spread)
    assert simulate(workload, "parrot", COST, tiny, pack_latency=True) == packed


def test_the_kv_pool_option_replaces_the_profiles_and_a_smaller_pool_costs_time() -> None:
    """``kv_cache_tokens`` reaches the simulated engines: agents whose prefixes do not fit
    a small pool take longer than with the profile's pool (which holds them all)."""
    import dataclasses

    from benchmarks.sim.driver import simulate_on
    from benchmarks.suite.workloads import agents_app, finish_workload

    from parrot.sim.cost import CostProfile

    tiny = TextTokenizer.byte_level_tiny()  # a token per byte
    apps = [
        dataclasses.replace(
            agents_app(f"t/a{i}", f"System {i}. " + "rules " * 50, "a task", 2, rounds=1), arrival_s=i
        )
        for i in range(4)
    ]
    workload = finish_workload("agents_load", "t", {"sweep": "rate", "x": 1.0}, apps)
    profile = CostProfile("test", COST, kv_cache_tokens=1 << 17)
    roomy = simulate_on(workload, "parrot-baseline-throughput-apc", profile, tiny)
    tight = simulate_on(workload, "parrot-baseline-throughput-apc", profile, tiny, kv_cache_tokens=1024)
    assert all(a.error is None for a in roomy.apps + tight.apps)
    assert max(a.end_s for a in tight.apps) > max(a.end_s for a in roomy.apps)


def test_a_kv_pool_below_one_token_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.sim import __main__ as sim_cli

    with pytest.raises(SystemExit) as exit_:
        sim_cli.main(["--figures", "agents_load", "--kv-cache-tokens", "0"])
    assert exit_.value.code == 2 and "must be at least 1, got 0" in capsys.readouterr().err


def test_an_isolated_run_gives_each_app_its_latency_alone_at_its_own_arrival() -> None:
    """``isolated``: each app runs alone, so its latency is what a workload of that app by
    itself gives, no more than under the load (where apps that overlap slow each other),
    and its record keeps its arrival."""
    import dataclasses

    from benchmarks.sim.driver import simulate
    from benchmarks.suite.workloads import generate

    tiny = TextTokenizer.byte_level_tiny()
    workload = generate("app_load", 0.3, 0, app_load_rates=[2.0])[0]
    assert len(workload.apps) >= 4
    loaded = simulate(workload, "parrot", COST, tiny)
    alone = simulate(workload, "parrot", COST, tiny, isolated=True)
    by_id = {a.app_id: a for a in loaded.apps}
    assert sorted(a.app_id for a in alone.apps) == sorted(by_id)
    for app in alone.apps:
        spec = next(s for s in workload.apps if s.app_id == app.app_id)
        assert app.error is None and app.arrival_s == spec.arrival_s
        assert all(app.arrival_s <= c.start_s <= c.end_s <= app.end_s + 1e-6 for c in app.calls)
        by_itself = simulate(dataclasses.replace(workload, apps=(spec,)), "parrot", COST, tiny).apps[0]
        assert app.latency_s == pytest.approx(by_itself.latency_s)
        assert app.latency_s <= by_id[app.app_id].latency_s + 1e-9
    mean = sum(a.latency_s for a in alone.apps) / len(alone.apps)
    assert mean < sum(a.latency_s for a in loaded.apps) / len(loaded.apps)  # the load costs something

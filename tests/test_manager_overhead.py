"""The manager-overhead benchmark's mixed run (issue 16, beyond the paper's scale): every
kind of application runs to completion on the instant engines and the figures it reports
are measured, not left at zero."""

from __future__ import annotations

import asyncio

from benchmarks.manager_overhead import KINDS, run_once


def test_the_mixed_run_completes_every_kind_and_measures_cpu_and_memory() -> None:
    result = asyncio.run(run_once(n_engines=4, n_sessions=8, n_calls=203, mix=True))
    assert result["calls"] == 203  # 13 turns of the four kinds (9 + 4 + 1 + 1 calls) and 8 maps
    assert len(KINDS) == 4 and result["rounds"] > 0
    assert 0 < result["cpu_us_per_call"] < 1e6 and result["calls_per_s"] > 0
    assert result["p50_ms"] <= result["p99_ms"]


def test_the_virtual_run_computes_every_call_on_simulated_engines() -> None:
    """``--virtual``: the same calls on simulated engines in virtual time; a map-reduce app
    (a reduce after its eight maps) takes longer than a single chat call, and the run's
    virtual makespan covers every app."""
    from parrot.sim import clock as sim_clock
    from parrot.sim.cost import load_profile

    profile = load_profile("llama7b-a6000")
    result = sim_clock.run(run_once(n_engines=4, n_sessions=8, n_calls=203, mix=True, profile=profile))
    assert result["calls"] == 203
    kinds = {k: result[f"{k}_s"] for k in KINDS}
    assert 0 < kinds["chat"] < kinds["map_reduce"] <= result["virtual_s"]
    assert kinds["chat"] < kinds["chain"]  # four calls one after another
    again = sim_clock.run(run_once(n_engines=4, n_sessions=8, n_calls=203, mix=True, profile=profile))
    assert {k: again[f"{k}_s"] for k in KINDS} == kinds  # deterministic

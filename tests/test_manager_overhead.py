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

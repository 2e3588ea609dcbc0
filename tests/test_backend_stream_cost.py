"""The arithmetic and process accounting of ``benchmarks/backend_stream_cost.py`` (its
servers are exercised by the suite's own tests; the benchmark itself is run by hand)."""

from __future__ import annotations

import argparse
import os
import time

import pytest
from benchmarks import backend_stream_cost as bench


def test_group_cpu_counts_the_processes_of_a_group_and_grows_with_work() -> None:
    group = [os.getpgrp()]
    before = bench.group_cpu_s(group)
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    after = bench.group_cpu_s(group)
    assert before > 0 and after - before >= 0.2
    assert bench.group_cpu_s([-1]) == 0.0  # no such group


def test_the_summary_pairs_rounds_and_counts_cpu_per_token() -> None:
    args = argparse.Namespace(concurrency=2, tokens=50, rounds=2)
    rounds = {
        "direct": [
            {"wall_s": 10.0, "manager_cpu_s": 0.0, "vllm_cpu_s": 19.0},
            {"wall_s": 12.0, "manager_cpu_s": 0.0, "vllm_cpu_s": 23.0},
        ],
        "parrot": [
            {"wall_s": 11.0, "manager_cpu_s": 0.05, "vllm_cpu_s": 20.0},
            {"wall_s": 12.0, "manager_cpu_s": 0.1, "vllm_cpu_s": 23.0},
        ],
    }
    text = bench.summary(rounds, args)
    assert "direct  wall  11.00 s (10.00-12.00)" in text
    assert "through Parrot / direct: 1.050x (1.000-1.100 over pairs)" in text
    assert "manager CPU per generated token: 0.750 ms (0.500-1.000)" in text  # 100 tokens a round


def test_prompts_are_new_in_every_round() -> None:
    assert len(set(bench.prompts("a", 4)) | set(bench.prompts("b", 4))) == 8


@pytest.mark.parametrize("flag", ["--rounds", "--tokens", "--concurrency"])
def test_counts_below_one_exit_2(flag: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.main([flag, "0"])
    assert exit_.value.code == 2

"""benchmarks/step_log_summary.py: the costs it fits to a step log and the chain model it prints."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from parrot.engine.core.step_work import StepWork
from parrot.engine.step_log import StepLog

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
summary = importlib.import_module("step_log_summary")

A, C, P = 0.020, 0.002, 0.0005  # an engine whose steps cost exactly a + c * b + p * prompt tokens


def _log(path: Path) -> Path:
    log = StepLog(path)
    for b in (1, 2, 5, 9, 14):
        for _ in range(3):
            log.record(StepWork(0, b, 100 * b, 0), A + C * b)
    log.record(StepWork(0, 5, 500, 0), 1.0)  # one slow outlier: medians ignore it
    for tokens, b in ((200, 3), (800, 0), (2048, 6)):
        log.record(StepWork(tokens, b, tokens, tokens * tokens), A + C * b + P * tokens)
    log.close()
    return path


def test_the_costs_of_an_exact_engine_are_recovered(tmp_path: Path, capsys) -> None:
    rows = summary.read_step_log(_log(tmp_path / "s.jsonl"))
    costs = summary.fit_costs(rows)
    assert costs.a == pytest.approx(A) and costs.c == pytest.approx(C) and costs.p == pytest.approx(P)
    assert summary.decode_medians(rows)[4] == (4, pytest.approx(A + C * 5))  # batch 5 and the outlier
    # 25 chains of 4 calls (250 prompt tokens, 25 out) nine at a time: 4 x (9 x 250 x p + 25 x
    # (a + 9c)) per chain, and the mean chain waits (25 / 9 + 1) / 2 batches
    expected = 4 * (9 * 250 * P + 25 * (A + 9 * C)) * (25 / 9 + 1) / 2
    assert summary.chain_mean_latency(costs, 9, 25, 4, 250, 25) == pytest.approx(expected)
    summary.main([str(tmp_path / "s.jsonl"), "--batches", "9"])
    out = capsys.readouterr().out
    assert "a = 20.0 ms, c = 2.00 ms per sequence, p = 0.500 ms per prompt token" in out
    assert f"25 chains, 9 at a time: mean latency {expected:.1f} s" in out


def test_the_best_batch_and_its_gain_over_all_at_once(tmp_path: Path, capsys) -> None:
    """The best batch is the k with the lowest modelled mean; with prompt tokens twice as
    fast the script prints that k, its mean, the all-at-once mean and their ratio."""
    costs = summary.StepCosts(A, C, P, 0.5)
    shape = (25, 4, 250, 25)
    means = {k: summary.chain_mean_latency(costs, k, *shape) for k in range(1, 26)}
    k, best = summary.best_batch(costs, *shape)
    assert best == min(means.values()) and means[k] == best and 1 < k < 25
    summary.main([str(_log(tmp_path / "s.jsonl")), "--batches", "9", "--prefill-speedups", "2"])
    faster = summary.StepCosts(A, C, P / 2, 0.5)
    k2, best2 = summary.best_batch(faster, *shape)
    together = summary.chain_mean_latency(faster, 25, *shape)
    out = capsys.readouterr().out
    line = f"prompt tokens 2x as fast: best {k2} at a time, mean {best2:.1f} s; "
    assert line + f"all 25 at once {together:.1f} s" in out and f"ratio {together / best2:.2f}x" in out


def test_a_log_without_the_steps_it_needs_is_refused(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "d.jsonl")
    log.record(StepWork(0, 3, 30, 0), 0.03)
    log.close()
    with pytest.raises(ValueError, match="two batch sizes"):
        summary.fit_costs(summary.read_step_log(tmp_path / "d.jsonl"))
    rows = [(StepWork(0, b, 10, 0), 0.02 + 0.001 * b) for b in (1, 4)]
    with pytest.raises(ValueError, match="no step with prompt tokens"):
        summary.fit_costs(rows)

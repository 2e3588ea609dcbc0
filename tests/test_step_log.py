"""The engine's step log (parrot.engine.step_log) and the calibration fitted to it."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from benchmarks.sim import calibrate

from parrot.engine.core.step_work import StepWork
from parrot.engine.local import LocalEngine
from parrot.engine.step_log import StepLog, read_step_log
from parrot.protocol.engine_api import SamplingParams
from parrot.sim.cost import load_profile


async def _serve(engine: LocalEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async def one(i: int, p: list[int]) -> list[int]:
        await engine.fill(p, 500 + i)
        out: list[int] = []
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for chunk in engine.generate(params, 500 + i):
            out.extend(chunk.token_ids)
        await engine.free_context(500 + i)
        return out

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def test_a_served_engine_logs_each_step_with_the_work_it_planned(tiny_model, tmp_path: Path) -> None:
    path = tmp_path / "logs" / "steps.jsonl"
    engine = LocalEngine(tiny_model, step_log=str(path), max_step_tokens=64, latency_probe=False)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(40 + 10 * i)] for i in range(3)]
    try:
        asyncio.run(_serve(engine, prompts, 6))
        steps = engine.runner.counters["steps"]
    finally:
        engine.close()
    rows = read_step_log(path)
    assert len(rows) == steps and all(seconds > 0 for _, seconds in rows)
    # every prompt token was computed once, every generated token but the first of each
    # generate (sampled from the fill's logits) in a decode slice
    assert sum(w.prefill_tokens for w, _ in rows) == sum(map(len, prompts))
    assert sum(w.decode_seqs for w, _ in rows) == 3 * (6 - 1)
    assert max(w.prefill_tokens for w, _ in rows) <= 64
    first = rows[0][0]
    assert first.kv_tokens_read >= first.prefill_tokens and first.prefill_pairs > 0
    # each line says when its step ended: in order, within the run
    ends = [json.loads(line)["at"] for line in path.read_text().splitlines()]
    assert ends == sorted(ends) and time.time() - 60 < ends[0] <= ends[-1] <= time.time()


def test_a_step_log_that_cannot_be_written_stops_and_bad_lines_are_named(tmp_path: Path, caplog) -> None:
    full = StepLog("/dev/full")  # every write fails with ENOSPC, as on a full disk
    full.record(StepWork(1, 0, 1, 1), 0.01)
    assert full.steps == 0 and "no more steps are logged" in caplog.text
    full.record(StepWork(1, 0, 1, 1), 0.01)  # off now: no error, nothing written
    log = StepLog(tmp_path / "s.jsonl")
    log.record(StepWork(10, 2, 30, 55), 0.01)
    log.close()
    assert read_step_log(tmp_path / "s.jsonl") == [(StepWork(10, 2, 30, 55), 0.01)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prefill_tokens": 1, "decode_seqs": 0, "kv_tokens_read": 1, "seconds": 1}) + "\n{\n"
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a step-log line"):
        read_step_log(bad)


def test_calibration_fits_the_cost_model_to_step_logs(tmp_path: Path, capsys) -> None:
    """A log whose steps follow a known cost: the fit recovers it and the file loads."""
    truth = {
        "base": 0.01,
        "per_prefill_token": 2e-4,
        "per_decode_seq": 5e-4,
        "per_kv_token": 1e-6,
        "per_prefill_pair": 1e-8,
    }
    log = StepLog(tmp_path / "served.jsonl")
    for i in range(60):
        prompt = (i % 5) * 100
        work = StepWork(prompt, i % 7, 50 * i + 10, prompt * (i % 3) * 300 + prompt * (prompt + 1) // 2)
        seconds = (
            truth["base"]
            + work.prefill_tokens * truth["per_prefill_token"]
            + work.decode_seqs * truth["per_decode_seq"]
            + work.kv_tokens_read * truth["per_kv_token"]
            + work.prefill_pairs * truth["per_prefill_pair"]
        )
        log.record(work, seconds)
    log.close()
    out = tmp_path / "cost.json"
    argv = ["--from-step-log", str(tmp_path / "served.jsonl"), "--model", "tiny", "--out", str(out)]
    assert calibrate.main(argv) == 0
    printed = capsys.readouterr().out
    assert "decode only" in printed and "prompt only" in printed and "mixed" in printed
    profile = load_profile(str(out))
    for term, value in truth.items():
        assert getattr(profile.cost, term) == pytest.approx(value, rel=1e-3)
    assert profile.meta["logs"] == {str(tmp_path / "served.jsonl"): 60}
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match="no steps"):
        calibrate.main(["--from-step-log", str(empty)])


def test_the_fit_in_seconds_matches_the_total_time_of_noisy_steps() -> None:
    """With the intercept (base) in the fit, least squares in seconds leaves residuals
    that sum to zero: the model's total is the measured total, which the relative fit
    does not promise."""
    import random

    from parrot.sim.fit import fit_step_cost

    rng = random.Random(5)
    samples = []
    for _ in range(400):
        work = StepWork(rng.choice([0, 0, 0, 512, 2048]), rng.randrange(1, 40), rng.randrange(100, 20000), 0)
        seconds = (0.02 + 6e-4 * work.prefill_tokens + 1e-3 * work.decode_seqs) * rng.uniform(0.6, 1.6)
        samples.append((work, seconds))
    measured = sum(s for _, s in samples)
    terms = ("base", "per_prefill_token", "per_decode_seq", "per_kv_token")
    in_seconds = fit_step_cost(samples, terms, relative=False)
    relative = fit_step_cost(samples, terms)
    modelled = sum(in_seconds.cost.step_seconds(w) for w, _ in samples)
    assert modelled == pytest.approx(measured, rel=1e-9)
    assert abs(sum(relative.cost.step_seconds(w) for w, _ in samples) / measured - 1) > 0.01

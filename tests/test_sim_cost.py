"""The simulator's step cost: the work a step does, the least-squares fit, the GPU
profiles against the paper's reported latencies, cost files, and the calibration
script run end to end on the tiny model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from benchmarks.sim import __main__ as sim_main
from benchmarks.sim import calibrate

from parrot.engine.core.block_pool import BlockPool
from parrot.engine.core.contexts import ContextTable
from parrot.engine.core.step_planner import SeqSlice
from parrot.protocol.tokenizer import TextTokenizer
from parrot.sim.cost import PROFILES, CostProfile, StepCost, StepWork, load_profile, step_work
from parrot.sim.engine import SimEngine
from parrot.sim.fit import TERMS, fit_step_cost
from parrot.sim.gpu_cost import LLAMA7B_A6000, LLAMA13B_A100

TRUE = StepCost(
    base=0.012,
    per_prefill_token=6e-4,
    per_decode_seq=3e-4,
    per_kv_token=1.2e-6,
    per_prefill_pair=2e-8,
    per_prompt_step=0.02,
)


def _synthetic(cost: StepCost, noise: float, n: int = 120) -> list[tuple[StepWork, float]]:
    rng = random.Random(1)
    samples = []
    for _ in range(n):
        p, start = rng.choice([0, 0, 32, 512, 2048]), rng.choice([0, 1024])
        d, kv = rng.choice([0, 1, 4, 16, 64]), rng.choice([16, 256, 4096])
        pairs = p * start + p * (p + 1) // 2 if p > 1 else 0
        work = StepWork(p, d, d * kv + (start + p if p else 0), pairs)
        samples.append((work, cost.step_seconds(work) * (1 + rng.uniform(-noise, noise))))
    return samples


# ------------------------------------------------------------------ the fit


def test_fit_recovers_known_parameters_exactly_without_noise() -> None:
    fit = fit_step_cost(_synthetic(TRUE, 0.0))
    for term in TERMS:
        assert getattr(fit.cost, term) == pytest.approx(getattr(TRUE, term), rel=1e-6), term
    assert fit.max_abs_rel_error < 1e-9


def test_fit_recovers_parameters_within_noise_and_reports_the_errors() -> None:
    fit = fit_step_cost(_synthetic(TRUE, 0.03))
    for term in TERMS:  # the prompt-attention term is a few % of a prefill step: looser
        rel = 0.5 if term in ("per_prefill_pair", "per_prompt_step") else 0.1
        assert getattr(fit.cost, term) == pytest.approx(getattr(TRUE, term), rel=rel), term
    assert 0.005 < fit.rms_rel_error < 0.03
    assert fit.max_abs_rel_error < 0.07


def test_the_first_order_form_leaves_residuals_the_prompt_attention_term_removes() -> None:
    samples = _synthetic(TRUE, 0.0)
    first = fit_step_cost(samples, ("base", "per_prefill_token", "per_decode_seq", "per_kv_token"))
    full = fit_step_cost(samples)
    assert first.rms_rel_error > 0.01 > 1e-9 > full.rms_rel_error


def test_fit_keeps_parameters_nonnegative_when_a_term_is_absent() -> None:
    # no KV term in the truth: the noise would push it negative; it is dropped to 0 instead
    truth = StepCost(base=0.01, per_prefill_token=5e-4, per_decode_seq=2e-4, per_kv_token=0.0)
    fit = fit_step_cost(
        _synthetic(truth, 0.05), ("base", "per_prefill_token", "per_decode_seq", "per_kv_token")
    )
    assert all(getattr(fit.cost, t) >= 0 for t in TERMS)
    assert fit.cost.per_prefill_pair == 0.0
    assert fit.cost.base == pytest.approx(0.01, rel=0.1)


def test_fit_rejects_what_it_cannot_fit() -> None:
    samples = _synthetic(TRUE, 0.0)
    with pytest.raises(ValueError, match="unknown terms"):
        fit_step_cost(samples, ("base", "per_flop"))
    with pytest.raises(ValueError, match=f"cannot fit {len(TERMS)} terms"):
        fit_step_cost(samples[:3])
    decode_only = [(w, s) for w, s in samples if not w.prefill_tokens]
    with pytest.raises(ValueError, match="no sample exercises"):
        fit_step_cost(decode_only)
    with pytest.raises(ValueError, match="must be > 0"):
        fit_step_cost([(w, 0.0) for w, _ in samples])


# ------------------------------------------------------------ the step's work


def test_step_work_counts_prompt_pairs_and_a_shared_prefix_once_or_per_sequence() -> None:
    pool = BlockPool(64, 16)
    table = ContextTable(4096, pool=pool, prefix_cache=False)
    parent = table.open(1, None)
    table.append(parent, list(range(64)))
    table.reserve(parent, 64)
    parent.computed_len = 64
    children = []
    for cid in (2, 3, 4):
        child = table.open(cid, 1)
        table.append(child, [5] * 11)
        table.reserve(child, 10)
        child.computed_len += 10  # 74 computed, 1 pending: a decode
        children.append(SeqSlice(child, child.computed_len, 1))
    prompt = table.open(9, None)
    table.append(prompt, [7] * 40)
    table.reserve(prompt, 8)
    prompt.computed_len = 8  # a chunk of 32 at position 8
    slices = [*children, SeqSlice(prompt, 8, 32)]
    once = step_work(slices, 16, share_prefix=True)
    per_seq = step_work(slices, 16, share_prefix=False)
    assert once == StepWork(prefill_tokens=32, decode_seqs=3, kv_tokens_read=64 + 3 * 11 + 40,
                            prefill_pairs=32 * 8 + 32 * 33 // 2)  # fmt: skip
    assert per_seq.kv_tokens_read == 3 * 75 + 40
    assert (per_seq.prefill_tokens, per_seq.decode_seqs, per_seq.prefill_pairs) == (32, 3, 32 * 8 + 528)


# ------------------------------------------------------------ GPU profiles


def _ms(profile: CostProfile, seqs: int, tokens: int) -> float:
    return profile.cost.seconds(0, seqs, tokens) * 1e3


def test_llama13b_on_a100_gives_the_per_token_latencies_the_papers_artifact_reports() -> None:
    # about 23-26 ms per output token at <= 2k tokens in flight, 33-37 ms at 12k
    for seqs in (1, 2, 4):
        for tokens in (256, 1024, 2048):
            assert 23.0 <= _ms(LLAMA13B_A100, seqs, tokens) <= 26.0, (seqs, tokens)
    for seqs in (6, 8, 12):  # 12k tokens as 1-2k-token requests
        assert 33.0 <= _ms(LLAMA13B_A100, seqs, 12_000) <= 37.0, seqs
    # the paper's latency cap for this engine, 6,144 tokens, kept latency within 20-25%
    # of unloaded: the model's 25% point is near it
    assert 5_000 <= LLAMA13B_A100.cost.latency_cap(1.25, LLAMA13B_A100.kv_cache_tokens or 0) <= 7_000


def test_the_simulated_cap_is_the_one_the_engines_probe_fits_floor_included() -> None:
    """A steep KV cost would put the cap below one typical call; the real engine's probe
    never reports less than MIN_LATENCY_CAP_TOKENS (or its capacity), and neither may the
    simulated engine, or the simulated latency-centric baseline queues calls the real
    one runs (fig. 19's one-thread profile implies 877 tokens; its engines reported
    1,024 and more)."""
    from parrot.engine.core.latency_fit import MIN_LATENCY_CAP_TOKENS, StepFit, cap_from_fit

    steep = StepCost(base=0.011, per_prefill_token=5e-4, per_decode_seq=0.002, per_kv_token=4e-6)
    assert 0.25 * (steep.base + steep.per_decode_seq) / steep.per_kv_token < MIN_LATENCY_CAP_TOKENS
    assert steep.latency_cap(1.25, 100_000) == MIN_LATENCY_CAP_TOKENS
    assert steep.latency_cap(1.25, 500) == 500  # the floor never exceeds the capacity
    gentle = StepCost(base=0.011, per_prefill_token=5e-4, per_decode_seq=0.002, per_kv_token=4e-7)
    fit = StepFit(0.013, 4e-7, buckets=2, steps=0)
    assert gentle.latency_cap(1.25, 100_000) == cap_from_fit(fit, 100_000) == 8125
    assert StepCost(0.011, 5e-4, 0.002, 0.0).latency_cap(1.25, 4096) == 4096  # no KV cost: the capacity


def test_gpu_profiles_kv_pool_is_memory_after_weights_and_prefill_is_compute_bound() -> None:
    # A100 80 GB x 0.9 - 26 GB of fp16 weights, 819,200 bytes per KV token
    assert LLAMA13B_A100.kv_cache_tokens == int((80e9 * 0.9 - 26e9) // (2 * 40 * 5120 * 2))
    assert LLAMA7B_A6000.kv_cache_tokens == int((48e9 * 0.9 - 13.4e9) // (2 * 32 * 4096 * 2))
    # a 2k prompt: ~2 * 13e9 * 2048 FLOPs at half of 312 TFLOPS, plus its attention
    prefill = LLAMA13B_A100.cost.seconds(2048, 0, 2048, 2048 * 2049 // 2)
    assert 0.33 < prefill < 0.40
    # the A6000 has 38% of the A100's bandwidth: 7B there decodes slower than 13B on the A100
    assert _ms(LLAMA13B_A100, 1, 1024) < _ms(LLAMA7B_A6000, 1, 1024) < 35.0


def test_a_simulated_engine_reports_its_prompt_cost_as_a_real_engine_does() -> None:
    # (base + one sequence) / per prompt token = 12.3 ms / 0.6 ms = 20.5, in two digits
    assert TRUE.prefill_tokens_per_decode_step() == 21.0
    assert StepCost(0.01, 0.0, 0.0, 0.0).prefill_tokens_per_decode_step() == 0.0
    # a GPU computes hundreds of prompt tokens in a decode step's time
    assert LLAMA13B_A100.cost.prefill_tokens_per_decode_step() > 100


# ------------------------------------------------------------ cost files


def test_cost_file_round_trips_and_sizes_the_simulated_engines_kv(tmp_path: Path) -> None:
    profile = CostProfile("x", TRUE, kv_cache_tokens=40_000, meta={"machine": {"cpu": "c"}})
    path = tmp_path / "cost.json"
    path.write_text(profile.to_json())
    loaded = load_profile(str(path))
    assert loaded == profile
    engine = SimEngine(TextTokenizer.byte_level_tiny(), loaded.cost, kv_cache_tokens=loaded.kv_cache_tokens)
    assert engine.pool.num_blocks == 40_000 // 16 and engine.token_capacity == 40_000 // 16 * 16
    assert set(PROFILES) == {"smollm2-bf16-xeon2", "llama7b-a6000", "llama13b-a100", "llama7b-a100"}
    assert all(load_profile(name).name == name for name in PROFILES)
    # the same model streams its weights faster from the A100's memory than the A6000's
    a100, a6000 = load_profile("llama7b-a100"), load_profile("llama7b-a6000")
    assert a100.cost.base < a6000.cost.base and a100.kv_cache_tokens > a6000.kv_cache_tokens


_REST = '"per_prefill_token": 0, "per_decode_seq": 0, "per_kv_token": 0'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not JSON"),
        ('{"format": "other"}', "not a step-cost file"),
        ('{"format": "parrot-step-cost/1", "cost": {"base": 1, "speed": 2}}', "'cost' must be an object"),
        (
            f'{{"format": "parrot-step-cost/1", "cost": {{"base": -1, {_REST}}}}}',
            "StepCost.base must be a finite number >= 0",
        ),
        (
            f'{{"format": "parrot-step-cost/1", "cost": {{"base": 1, {_REST}}}, "kv_cache_tokens": 0}}',
            "kv_cache_tokens",
        ),
    ],
)
def test_bad_cost_files_are_refused_with_the_fault_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        load_profile(str(path))
    assert str(path) in str(err.value)


def test_sim_command_refuses_an_unknown_cost_and_runs_with_a_file(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        sim_main.main(["--cost", "no-such-cost", "--tokenizer", "tiny"])
    assert exit_.value.code == 2
    assert "unknown cost 'no-such-cost'" in capsys.readouterr().err
    path = tmp_path / "cost.json"
    path.write_text(CostProfile("mine", TRUE, kv_cache_tokens=1 << 15).to_json())
    out = tmp_path / "runs.json"
    args = ["--figures", "fig11", "--scale", "0.05", "--tokenizer", "tiny", "--systems", "parrot"]
    assert sim_main.main([*args, "--cost", str(path), "--out", str(out)]) == 0
    runs = json.loads(out.read_text())
    assert runs and all(r["extra"]["cost"] == "mine" for r in runs)
    assert all(a["error"] is None for r in runs for a in r["apps"])


# ------------------------------------------------------------ calibration


def test_calibration_measures_the_work_it_designed_on_the_real_engine() -> None:
    points = calibrate.grid(quick=True, max_kv=1 << 20, max_seq=2048)
    runner = calibrate.make_runner("tiny", "float32", points)
    for p in points:
        work, seconds = calibrate.time_point(runner, p)
        assert seconds > 0
        assert work.prefill_tokens == p.prefill and work.decode_seqs == p.decodes, p
        shared = p.shared if p.share_kernel else p.decodes * p.shared
        expected_kv = (
            (p.prefill_start + p.prefill if p.prefill else 0) + shared + p.decodes * (p.kv_per_seq + 1)
        )
        assert work.kv_tokens_read == expected_kv, p
        assert work.prefill_pairs == p.prefill * p.prefill_start + p.prefill * (p.prefill + 1) // 2
    assert len(runner.contexts) == 0 and runner.pool.num_used == 0 and not runner.planner.running
    too_big = calibrate.Point(decodes=64, kv_per_seq=runner.pool.num_blocks * 16 // 4)
    assert too_big.kv_tokens() > runner.pool.num_blocks * 16
    with pytest.raises(RuntimeError, match="KV pool is too small"):
        calibrate.time_point(runner, too_big)
    assert len(runner.contexts) == 0 and runner.pool.num_used == 0 and not runner.planner.running
    work, _ = calibrate.time_point(runner, points[0])  # the runner still works
    assert work.prefill_tokens == points[0].prefill
    assert len(calibrate.grid(quick=False, max_kv=1 << 16, max_seq=8192)) > 60
    assert all(p.kv_tokens() <= 5000 for p in calibrate.grid(quick=False, max_kv=5000, max_seq=8192))


def test_calibration_command_writes_a_cost_file_the_simulator_loads(tmp_path: Path, capsys) -> None:
    out = tmp_path / "tiny.json"
    argv = ["--model", "tiny", "--dtype", "float32", "--quick", "--repeats", "1", "--out", str(out)]
    assert calibrate.main(argv) == 0
    printed = capsys.readouterr().out
    assert "first-order:" in printed and "full:" in printed and "rms error" in printed
    profile = load_profile(str(out))
    meta = profile.meta or {}
    assert meta["model"] == "tiny" and meta["machine"]["cpu_count"] >= 1
    assert isinstance(meta["commit"], str) and len(meta["commit"]) == 40
    assert len(meta["points"]) == len(calibrate.grid(True, 65536, 2048))
    # timings on a shared machine are noisy: only what holds whatever they are
    assert all(getattr(profile.cost, t) >= 0 for t in TERMS)
    errors = [p["rel_error"] for p in meta["points"]]
    rms = (sum(e * e for e in errors) / len(errors)) ** 0.5
    assert meta["rms_rel_error"] == pytest.approx(rms)
    for p in meta["points"]:
        model = profile.cost.step_seconds(StepWork(**p["work"]))
        assert (model - p["seconds"]) / p["seconds"] == pytest.approx(p["rel_error"])
    with pytest.raises(SystemExit):
        calibrate.main(["--model", "tiny", "--repeats", "0"])
    assert "must be >= 1" in capsys.readouterr().err


def test_compare_prints_each_workloads_error_against_a_real_run(tmp_path: Path, capsys) -> None:
    """A run compared with itself has no error; with every real latency 25% longer, each
    simulated mean is 20% short of it."""
    args = ["--figures", "fig14", "--scale", "0.05", "--tokenizer", "tiny", "--systems", "parrot"]
    out = tmp_path / "runs.json"
    assert sim_main.main([*args, "--out", str(out)]) == 0
    capsys.readouterr()
    assert sim_main.main([*args, "--compare", str(out)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    per_workload = [r for r in rows if r and r[0].startswith("fig14/") and r[1:2] == ["parrot"]]
    assert per_workload and all(r[-1] in ("+0%", "-0%") for r in per_workload)
    runs = json.loads(out.read_text())
    for run in runs:
        for app in run["apps"]:
            app["end_s"] = app["arrival_s"] + 1.25 * (app["end_s"] - app["arrival_s"])
    longer = tmp_path / "longer.json"
    longer.write_text(json.dumps(runs))
    assert sim_main.main([*args, "--compare", str(longer)]) == 0
    printed = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in printed]
    per_workload = [r for r in rows if r and r[0].startswith("fig14/") and r[1:2] == ["parrot"]]
    assert per_workload and all(r[-1] == "-20%" for r in per_workload)
    (summary,) = [line.split() for line in printed if line.startswith("fig14 ")]
    assert summary[-2:] == ["20%", "20%"]

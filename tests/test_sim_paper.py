"""The simulator at the paper's sizes (issue 16): the paper-size workloads keep the
paper's axes and engines, a paper run writes its report and the paper's results
beside the simulated ratios, and the CLI refuses what does not apply."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from benchmarks.sim import __main__ as sim_cli
from benchmarks.sim.paper import PAPER_FIGURES, PaperFigure, paper_workloads
from benchmarks.sim.paper_run import claim_lines, run_paper
from benchmarks.suite import textgen
from benchmarks.suite.workloads import generate

from parrot.protocol.tokenizer import TextTokenizer
from parrot.sim.cost import load_profile


def test_paper_workloads_keep_the_papers_axes_engines_and_lengths() -> None:
    for figure, spec in PAPER_FIGURES.items():
        workloads = paper_workloads(figure)
        assert workloads == paper_workloads(figure)  # deterministic for a seed
        assert workloads != paper_workloads(figure, seed=1)
        assert len({w.name for w in workloads}) == len(workloads)
        assert all("size=paper" in w.name and w.figure == figure for w in workloads)
        assert {w.engines for w in workloads} == ({4} if figure in ("fig17", "fig19") else {1})
        assert load_profile(spec.profile).name == spec.profile
    fig14 = paper_workloads("fig14")
    assert {w.params["chunk_tokens"] for w in fig14} == {512, 1024, 1536, 2048}
    assert {w.params["output_tokens"] for w in fig14} == {25, 50, 75, 100}
    assert {len(w.apps[0].calls) for w in fig14 if w.params["chunk_tokens"] == 1024} == {21}  # 20 maps
    assert [w.params["x"] for w in paper_workloads("fig18")] == [4, 8, 12, 16]
    (bing, *_) = paper_workloads("fig15_16")
    system = bing.apps[0].calls[0].template.split("\n\nUser:")[0]
    assert 5700 <= textgen.estimate_tokens(system) <= 6300  # the paper's ~6,000-token prompt
    mixed = paper_workloads("fig19")
    assert [sum(a.kind == "map_reduce" for a in w.apps) for w in mixed] == [12, 24, 36, 48]
    chats = [[a.calls[0].max_tokens for a in w.apps if a.kind == "chat"] for w in mixed]
    assert all(c == chats[0] for c in chats)  # the same chats at every point
    assert 100 <= len(chats[0]) <= 140  # 1 req/s for 120 s
    assert 250 <= statistics.fmean(chats[0]) <= 420  # ShareGPT's own outputs (mean 338), not the CPU's
    with pytest.raises(ValueError, match="no paper-size workloads for 'fig12a'"):
        paper_workloads("fig12a")


@pytest.fixture
def small_fig14(monkeypatch: pytest.MonkeyPatch) -> None:
    """fig14 at the suite's size (a fraction of it) on the paper's A100 profile: fast with
    the byte tokenizer, and the run's code paths are the paper run's."""
    small = PaperFigure(
        "fig14", "llama13b-a100", 4096, lambda seed: generate("fig14", 0.2, seed)[:2], ("2.37x",)
    )
    monkeypatch.setitem(PAPER_FIGURES, "fig14", small)


def test_a_paper_run_writes_its_report_and_the_papers_result_beside_the_simulated(
    tmp_path: Path, small_fig14: None
) -> None:
    raw = run_paper(
        ["fig14"],
        ["parrot", "parrot-baseline-latency"],
        tmp_path,
        TextTokenizer.byte_level_tiny(),
        plots=False,
    )
    assert len(raw) == 4 and all(a["error"] is None for run in raw for a in run["apps"])
    assert json.loads((tmp_path / "raw.json").read_text()) == raw
    header = json.loads((tmp_path / "header.json").read_text())
    assert header["profiles"] == {"fig14": "llama13b-a100"} and header["latency_caps"] == {"fig14": 4096}
    assert "Figure 14" in (tmp_path / "report.md").read_text()
    # the simulated ratio is the geometric mean over points of the baseline's latency over Parrot's
    latency = {(r["workload"], r["system"]): r["apps"][0]["end_s"] - r["apps"][0]["arrival_s"] for r in raw}
    points = sorted({w for w, _ in latency})
    expected = statistics.geometric_mean(
        latency[(p, "parrot-baseline-latency")] / latency[(p, "parrot")] for p in points
    )
    row = next(line for line in (tmp_path / "paper.md").read_text().splitlines() if "| fig14 |" in line)
    assert row == f"| fig14 | map-reduce, vs latency-centric | 2.37x | {expected:.2f}x |"


def _fig17_run(system: str, rate: float, per_token_s: float) -> dict:
    app = {
        "app_id": f"fig17/rate={rate}/a0",
        "kind": "shared_prompt",
        "arrival_s": 0.0,
        "start_s": 0.0,
        "end_s": per_token_s * 100,
        "calls": [{"name": "answer", "start_s": 0.0, "end_s": per_token_s * 100, "output_tokens": 100}],
        "error": None,
    }
    params = {"sweep": "rate", "x": rate}
    return {"system": system, "workload": f"fig17/rate={rate}", "figure": "fig17", "params": params,
            "repeat": 0, "apps": [app]}  # fmt: skip


def test_fig17_claims_compare_the_highest_sustainable_rates() -> None:
    """Parrot stays under the bound (0.1 s per token) at every rate, the baseline only at
    the first two, Parrot without affinity at none: the ratio is a lower bound when
    Parrot sustained the sweep's top rate, and a system that sustained nothing is named."""
    raw = [_fig17_run("parrot", r, 0.05) for r in (1.0, 2.0, 4.0)]
    raw += [_fig17_run("parrot-baseline-latency", r, v) for r, v in ((1.0, 0.05), (2.0, 0.09), (4.0, 0.5))]
    raw += [_fig17_run("parrot-no-affinity", r, 0.2) for r in (1.0, 2.0, 4.0)]
    rows = {line.split(" | ")[1]: line.split(" | ")[3].rstrip(" |") for line in claim_lines(raw)[2:]}
    assert rows["sustainable rate, vs no sharing"] == "at least 2.00x (4 against 2 req/s)"
    assert rows["sustainable rate without affinity, vs no sharing"] == "0.00x (0 against 2 req/s)"
    assert rows["sustainable rate, vs per-sequence attention"] == "n/a"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--paper"], "--paper needs --out FOLDER"),
        (
            ["--paper", "--out", "x", "--cost", "llama7b-a6000"],
            "--cost, --compare, --scale, --latency-cap, --[no-]pack-latency, --isolated and --repeats",
        ),
        (["--paper", "--out", "x", "--repeats", "3"], "--repeats do not apply"),
        (["--paper", "--out", "x", "--isolated"], "--isolated and --repeats do not apply"),
        (["--paper", "--out", "x", "--figures", "fig12a"], "no paper-size workloads for fig12a"),
    ],
)
def test_the_cli_refuses_options_that_do_not_apply_to_a_paper_run(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exit_:
        sim_cli.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not Path("x").exists()


def test_fig17_stops_raising_a_systems_rate_after_the_first_it_does_not_sustain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.sim import paper_run

    rates = lambda seed: generate("fig17", 0.05, seed)[:3]  # noqa: E731 - three rates, few requests
    monkeypatch.setitem(PAPER_FIGURES, "fig17", PaperFigure("fig17", "llama7b-a6000", 6144, rates, ("12x",)))
    tiny = TextTokenizer.byte_level_tiny()
    runs = run_paper(["fig17"], ["parrot"], tmp_path / "all", tiny, plots=False)
    assert len(runs) == 3  # a GPU serves these few requests well within the bound
    monkeypatch.setattr(paper_run, "FIG17_BOUND_S", 1e-9)  # nothing is sustainable
    runs = run_paper(["fig17"], ["parrot"], tmp_path / "none", tiny, plots=False)
    assert [r["params"]["x"] for r in runs] == [rates(0)[0].params["x"]]

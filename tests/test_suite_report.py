"""The evaluation suite's report builder on small hand-written results (no model, no network)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(_ROOT))

from benchmarks.suite.report import build_report, main, max_rate_under  # noqa: E402
from benchmarks.suite.spec import AppRecord, CallRecord, RunRecord  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIG11_A = "fig11/sweep=output,out=25,chunk=512"
FIG11_B = "fig11/sweep=output,out=50,chunk=512"
FIG11_C = "fig11/sweep=output,out=100,chunk=512"


def _app(
    app_id: str,
    latency: float,
    *,
    kind: str = "chain",
    arrival: float = 0.0,
    error: str | None = None,
    out_tokens: int | None = None,
) -> AppRecord:
    calls = [CallRecord("last", arrival, arrival + latency, None, out_tokens)]
    return AppRecord(app_id, kind, arrival, arrival, arrival + latency, calls, error)


def _run(system: str, workload: str, params: dict, repeat: int, apps: list[AppRecord]) -> dict:
    figure = workload.split("/", 1)[0]
    return dataclasses.asdict(RunRecord(system, workload, figure, params, repeat, 10.0, apps))


def _fig11_runs() -> list[dict]:
    """parrot/vllm x two repeats; latencies chosen so the expected numbers are easy by hand."""
    pa = {"sweep": "output", "x": 25}
    pb = {"sweep": "output", "x": 50}
    pc = {"sweep": "output", "x": 100}
    chat = _app(f"{FIG11_A}/chat0", 100.0, kind="chat")  # not a metric app: must not count
    return [
        # A: parrot 2, 4 (mean 3); vllm 3, 8 (mean 5.5) -> 5.5/3 = 1.83x, pairs 1.5 and 2.0
        _run("parrot", FIG11_A, pa, 0, [_app(f"{FIG11_A}/chain0", 2.0), chat]),
        _run("parrot", FIG11_A, pa, 1, [_app(f"{FIG11_A}/chain0", 4.0, arrival=1.0)]),
        _run("vllm", FIG11_A, pa, 0, [_app(f"{FIG11_A}/chain0", 3.0)]),
        _run("vllm", FIG11_A, pa, 1, [_app(f"{FIG11_A}/chain0", 8.0)]),
        # B: parrot 1, 3 (mean 2); vllm 2.5 and an error -> 2.5/2 = 1.25x, one pair 2.5
        _run("parrot", FIG11_B, pb, 0, [_app(f"{FIG11_B}/chain0", 1.0)]),
        _run("parrot", FIG11_B, pb, 1, [_app(f"{FIG11_B}/chain0", 3.0)]),
        _run("vllm", FIG11_B, pb, 0, [_app(f"{FIG11_B}/chain0", 2.5)]),
        _run(
            "vllm", FIG11_B, pb, 1, [_app(f"{FIG11_B}/chain0", 9.0, error="TimeoutError: app took too long")]
        ),
        # C: vllm failed every time
        _run("parrot", FIG11_C, pc, 0, [_app(f"{FIG11_C}/chain0", 5.0)]),
        _run("parrot", FIG11_C, pc, 1, [_app(f"{FIG11_C}/chain0", 5.0)]),
        _run("vllm", FIG11_C, pc, 0, [_app(f"{FIG11_C}/chain0", 1.0, error="boom")]),
        _run("vllm", FIG11_C, pc, 1, [_app(f"{FIG11_C}/chain0", 1.0, error="boom")]),
    ]


def _fig15_runs() -> list[dict]:
    """Per-token latency from reported output tokens, else from params["output_tokens"]."""
    name = "fig15_16/batch=2,out=32"
    params = {"sweep": "batch", "x": 2, "output_tokens": 32}
    parrot = [_app(f"{name}/req0", 2.0, kind="shared_prompt", out_tokens=40), _app(f"{name}/req1", 3.2)]
    vllm = [_app(f"{name}/req0", 4.0, kind="shared_prompt", out_tokens=40), _app(f"{name}/req1", 6.4)]
    return [_run("parrot", name, params, 0, parrot), _run("vllm", name, params, 0, vllm)]


def _fig17_runs() -> list[dict]:
    """Normalised latency per rate: parrot 0.1 and 0.3, vllm 0.4 and 0.9 (per-app tokens from params)."""
    runs = []
    for rate, per_token in ((1.0, {"parrot": 0.1, "vllm": 0.4}), (2.0, {"parrot": 0.3, "vllm": 0.9})):
        name = f"fig17/rate={rate}"
        app_id = f"{name}/data0000"
        params = {"sweep": "rate", "x": rate, "app_output_tokens": {app_id: 10}}
        for system, value in per_token.items():
            app = _app(app_id, value * 10, kind="shared_prompt")
            runs.append(_run(system, name, params, 0, [app]))
    return runs


def _fig12b_runs() -> list[dict]:
    name = "fig12b/apps=2"
    params = {"sweep": "apps", "x": 2}
    lat = {"parrot": (1.0, 2.0), "vllm": (3.0, 2.0)}
    return [
        _run(s, name, params, r, [_app(f"{name}/chain{i:03d}", v) for i, v in enumerate(lat[s])])
        for s in lat
        for r in (0, 1)
    ]


def _fig19_runs() -> list[dict]:
    name = "fig19/chat_rate=1.0"
    params = {"sweep": "mixed", "x": 1.0, "app_output_tokens": {f"{name}/chat0000": 20}}
    runs = []
    for system, (chat, mr) in {"parrot": (1.0, 30.0), "vllm": (4.0, 60.0)}.items():
        apps = [_app(f"{name}/mr000", mr, kind="map_reduce"), _app(f"{name}/chat0000", chat, kind="chat")]
        runs.append(_run(system, name, params, 0, apps))
    return runs


@pytest.fixture
def raw() -> list[dict]:
    return _fig11_runs() + _fig15_runs() + _fig17_runs() + _fig12b_runs() + _fig19_runs()


HEADER = {"machine": "2-core CPU", "versions": {"parrot": "0.1"}}


def _rows(markdown: str, workload: str) -> dict[str, list[str]]:
    """``{system: cells of its row}`` for a workload's rows in the first table that has them."""
    rows: dict[str, list[str]] = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if line.startswith("| ") and cells[0] == workload and cells[2] not in rows:
            rows[cells[2]] = cells
    return rows


def test_fig11_rows_means_spreads_and_ratios(raw: list[dict], tmp_path: Path) -> None:
    md = build_report(raw, HEADER, tmp_path, plots=False)
    a = _rows(md, FIG11_A)
    # errors count every app of the runs (the chat app included), the mean only the metric's apps
    assert a["parrot"] == [FIG11_A, "25", "parrot", "2", "0/3", "3", "2–4", "", ""]
    assert a["vllm"] == [FIG11_A, "25", "vllm", "2", "0/2", "5.5", "3–8", "1.83×", "1.50–2.00"]
    b = _rows(md, FIG11_B)
    assert b["parrot"] == [FIG11_B, "50", "parrot", "2", "0/2", "2", "1–3", "", ""]
    assert b["vllm"] == [FIG11_B, "50", "vllm", "2", "1/2", "2.5", "2.5–2.5", "1.25×", "2.50–2.50"]
    c = _rows(md, FIG11_C)
    assert c["vllm"] == [FIG11_C, "100", "vllm", "2", "2/2", "error", "—", "—", "—"]
    # failed apps are listed, first line of the message only
    assert f"- vllm / {FIG11_B} / repeat 1 / {FIG11_B}/chain0: TimeoutError: app took too long" in md
    assert md.count(f"- vllm / {FIG11_C} / repeat") == 2
    assert (tmp_path / "report.md").read_text(encoding="utf-8") == md
    assert "- **machine**: 2-core CPU" in md and '- **versions**: {"parrot": "0.1"}' in md


def test_points_follow_the_x_axis(raw: list[dict], tmp_path: Path) -> None:
    md = build_report(list(reversed(raw)), HEADER, tmp_path, plots=False)
    assert md.index(FIG11_A + " |") < md.index(FIG11_B + " |") < md.index(FIG11_C + " |")
    fig11 = md.split("## Figure 11", 1)[1].split("**mean end-to-end latency", 1)[1]
    assert fig11.index("| parrot |") < fig11.index("| vllm |")


def test_fig15_16_per_token_latency(raw: list[dict], tmp_path: Path) -> None:
    md = build_report(raw, HEADER, tmp_path, plots=False)
    tables = md.split("**mean normalised latency (s per output token)**")
    # latency: parrot (2 + 3.2) / 2 = 2.6, vllm 5.2 -> 2.00x
    latency = _rows(tables[0], "fig15_16/batch=2,out=32")
    assert latency["vllm"][5:] == ["5.2", "5.2–5.2", "2.00×", "2.00–2.00"]
    # per token: parrot (2/40 + 3.2/32) / 2 = 0.075, vllm (4/40 + 6.4/32) / 2 = 0.15 -> 2.00x
    per_token = _rows(tables[1], "fig15_16/batch=2,out=32")
    assert per_token["parrot"][5:] == ["0.075", "0.075–0.075", "", ""]
    assert per_token["vllm"][5:] == ["0.15", "0.15–0.15", "2.00×", "2.00–2.00"]


def test_fig17_highest_sustainable_rate(raw: list[dict], tmp_path: Path) -> None:
    md = build_report(raw, HEADER, tmp_path, plots=False)
    # the sweep's top is 2/s: Parrot sustained it (its rate is only a lower bound), vLLM did not
    assert "| parrot | 1 | 2 | 2–2 |  | 1 |" in md
    assert "| vllm | 1 | 1 | 1–1 | 2.00× | 0 |" in md
    strict = build_report(raw, HEADER, tmp_path, plots=False, fig17_bound_s=0.2)  # parrot 0.3 > 0.2 at 2/s
    assert "| parrot | 1 | 1 | 1–1 |  | 0 |" in strict
    assert "| vllm | 1 | 0 | 0–0 | — | 0 |" in strict


def test_max_rate_under_needs_every_lower_rate() -> None:
    assert max_rate_under({1.0: 0.1, 2.0: 0.6, 4.0: 0.2}, 0.5) == 1.0
    assert max_rate_under({1.0: None, 2.0: 0.1}, 0.5) == 0.0
    assert max_rate_under({}, 0.5) == 0.0


def test_fig12b_per_app_and_fig19(raw: list[dict], tmp_path: Path) -> None:
    md = build_report(raw, HEADER, tmp_path, plots=False)
    assert "| chain000 | 1 | 3 | 3.00× |" in md
    assert "| chain001 | 2 | 2 | 1.00× |" in md
    rows = _rows(md, "fig19/chat_rate=1.0")  # first table: chat per token, 1/20 vs 4/20
    assert rows["vllm"][5:] == ["0.2", "0.2–0.2", "4.00×", "4.00–4.00"]
    jct = _rows(md.split("**map-reduce: mean completion time (s)**")[1], "fig19/chat_rate=1.0")
    assert jct["vllm"][5:] == ["60", "60–60", "2.00×", "2.00–2.00"]


def test_plots_are_written(raw: list[dict], tmp_path: Path) -> None:
    md = build_report(raw, HEADER, tmp_path)
    for figure in ("fig11", "fig12b", "fig15_16", "fig17", "fig19"):
        png = tmp_path / f"{figure}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC, figure
        assert f"![{figure}]({figure}.png)" in md


def test_cli_rebuilds_the_report(raw: list[dict], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "raw.json").write_text(json.dumps(raw), encoding="utf-8")
    (tmp_path / "header.json").write_text(json.dumps(HEADER), encoding="utf-8")
    assert main([str(tmp_path), "--no-plots"]) == 0
    assert str(tmp_path / "report.md") in capsys.readouterr().out
    text = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert _rows(text, FIG11_A)["vllm"][5:] == ["5.5", "3–8", "1.83×", "1.50–2.00"]
    assert not list(tmp_path.glob("*.png"))


def test_cli_without_raw_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        main([str(tmp_path)])
    assert info.value.code == 2
    assert "raw.json not found" in capsys.readouterr().err


def _without(raw: list[dict], path: tuple) -> list[dict]:
    broken = copy.deepcopy(raw)
    target = broken
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return broken


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda raw: [], "non-empty list"),
        (lambda raw: {"runs": raw}, "non-empty list"),
        (lambda raw: _without(raw, (0, "apps")), r"raw\[0\]: missing field 'apps'"),
        (
            lambda raw: _without(raw, (2, "apps", 0, "end_s")),
            r"raw\[2\] \(vllm, .*\) apps\[0\]: missing field 'end_s'",
        ),
        (lambda raw: [*raw, raw[0]], "duplicate run"),
        (lambda raw: [{**raw[0], "repeat": "0"}], "field 'repeat' has the wrong type"),
        (lambda raw: [*raw, 3], r"raw\[\d+\]: expected an object"),
    ],
)
def test_bad_raw_is_refused(raw: list[dict], tmp_path: Path, mutate, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_report(mutate(raw), HEADER, tmp_path, plots=False)
    assert not (tmp_path / "report.md").exists()


def test_bad_header_or_bound(raw: list[dict], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="header must be a dict"):
        build_report(raw, [], tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fig17_bound_s must be > 0"):
        build_report(raw, HEADER, tmp_path, fig17_bound_s=0.0)


def test_summary_is_the_geometric_mean_of_each_figures_ratios(raw: list[dict], tmp_path: Path) -> None:
    md = build_report(raw, {}, tmp_path, plots=False)
    summary = md.split("## Summary", 1)[1].split("\n## ", 1)[0]
    # fig11 against vllm: points A (1.83x) and B (1.25x); C has no vllm value (every app failed);
    # per repeat only r0 has both points: geomean(1.5, 2.5)
    expected = (
        f"vllm: {math.sqrt((5.5 / 3) * 1.25):.2f}× ({math.sqrt(1.5 * 2.5):.2f}–{math.sqrt(1.5 * 2.5):.2f})"
    )
    row = next(line for line in summary.splitlines() if line.startswith("| fig11 |"))
    assert expected in row and "vllm geo ≥ 1.3×: met" in row
    # fig15_16 has one point: its geometric mean is its ratio; fig17 compares the highest rates (2 vs 1)
    assert "| fig15_16 | mean end-to-end latency of the apps (s) | vllm: 2.00× (2.00–2.00) |" in summary
    assert "| fig17 | highest sustainable request rate | vllm: 2.00× (2.00–2.00) |" in summary


def _with_systems(raw: list[dict], factors: dict[str, float]) -> list[dict]:
    """``raw`` plus copies of parrot's runs as other systems, every latency times a factor."""
    out = list(raw)
    for system, factor in factors.items():
        for run in raw:
            if run["system"] != "parrot":
                continue
            twin = copy.deepcopy(run)
            twin["system"] = system
            for app in twin["apps"]:
                app["end_s"] = app["arrival_s"] + factor * (app["end_s"] - app["arrival_s"])
            out.append(twin)
    return out


def test_targets_against_the_latency_baseline_and_ablation_tables(raw: list[dict], tmp_path: Path) -> None:
    runs = _with_systems(
        raw, {"parrot-baseline-latency": 1.3, "parrot-no-affinity": 1.1, "parrot-baseline-throughput": 3.0}
    )
    md = build_report(runs, {}, tmp_path, plots=False)
    summary = md.split("## Summary", 1)[1].split("\n## ", 1)[0]
    fig11 = next(line for line in summary.splitlines() if line.startswith("| fig11 |"))
    # every point 1.3x: the geometric mean target (1.2x) is met, the best-point one (1.38x) missed
    assert "parrot-baseline-latency geo ≥ 1.2×: met (1.30×)" in fig11
    assert "parrot-baseline-latency best ≥ 1.38×: missed (1.30×)" in fig11
    assert "parrot-no-affinity: 1.10×" in fig11 and "parrot-baseline-throughput: 3.00×" in fig11
    section = md.split("## Figure 11", 1)[1].split("\n## ", 1)[0]
    against, ablations = section.split("**Parrot against its ablations**", 1)
    assert (
        "| parrot-baseline-latency | mean end-to-end latency of the non-chat apps (s) | best point | 1.30× |"
        in against
    )
    assert "≥ 1.38× (paper 1.38x) | missed |" in against
    assert "parrot-no-affinity" not in against
    ablations = ablations.split("**mean end-to-end", 1)[0]
    latency = "mean end-to-end latency of the non-chat apps (s)"
    assert f"| parrot-no-affinity | {latency} | geo. mean over points | 1.10× |" in ablations
    assert "parrot-baseline" not in ablations


def test_a_point_on_two_sweeps_is_plotted_on_both(tmp_path: Path) -> None:
    from benchmarks.suite.report import Point, _sweeps, group_runs

    shared = {"sweep": "output", "x": 25, "also": {"chunk": 320}}
    runs = [
        _run("parrot", "fig11/out=25,chunk=320", shared, 0, [_app("fig11/out=25,chunk=320/chain0", 2.0)]),
        _run(
            "parrot", "fig11/out=50,chunk=320", {"sweep": "output", "x": 50}, 0, [_app("fig11/o/chain0", 3.0)]
        ),
        _run(
            "parrot", "fig11/out=25,chunk=80", {"sweep": "chunk", "x": 80}, 0, [_app("fig11/c/chain0", 4.0)]
        ),
    ]
    points: list[Point] = group_runs(runs)["fig11"]
    sweeps = _sweeps(points)
    assert [p.workload for p in sweeps["output"]] == ["fig11/out=25,chunk=320", "fig11/out=50,chunk=320"]
    assert [p.workload for p in sweeps["chunk"]] == ["fig11/out=25,chunk=80", "fig11/out=25,chunk=320"]
    build_report(runs, {}, tmp_path)
    assert (tmp_path / "fig11.png").read_bytes()[:8] == PNG_MAGIC


def test_machine_load_section_flags_busy_runs(raw: list[dict], tmp_path: Path) -> None:
    quiet = {"wall_s": 10.0, "loadavg_before": [0.5, 0, 0], "loadavg_after": [0.7, 0, 0], "flagged": False,
             "foreign_cpu_s": 0.1, "idle_systems_cpu_s": 0.0, "foreign_share": 0.005}  # fmt: skip
    busy = {
        **quiet,
        "foreign_cpu_s": 4.0,
        "foreign_share": 0.2,
        "flagged": True,
        "loadavg_after": [2.5, 0, 0],
        "steal_cpu_s": 1.5,
    }
    for run in raw:
        run["extra"] = {"load": busy if (run["system"], run["repeat"]) == ("vllm", 1) else quiet}
    header = {"load_before": {"loadavg": [0.1, 0.2, 0.3], "busy_share": 0.02, "seconds": 2.0},
              "idle_cpu": {"vllm (engines 1)": [0.001]}}  # fmt: skip
    md = build_report(raw, header, tmp_path, plots=False)
    section = md.split("## Machine load", 1)[1]
    assert "Before the run: load average [0.1, 0.2, 0.3], machine busy 2% over 2.0 s." in section
    # 4 runs in repeat 1, each with 1.5 s stolen (runs recorded without steal count none)
    assert "| vllm | 12 | 120 | 16.8 | 0.0 | 6.0 | 2.50 | 4/12 |" in section
    assert f"- vllm / {FIG11_A} / repeat 1: other processes used 20% of the machine" in section
    assert "vllm (engines 1): 0.001" in section


def test_fig17_a_system_that_sustains_no_rate_loses_by_infinity(raw: list[dict], tmp_path: Path) -> None:
    from benchmarks.suite.report import compare, group_runs

    for run in raw:  # vllm over the bound at every rate
        if run["figure"] == "fig17" and run["system"] == "vllm":
            for app in run["apps"]:
                app["end_s"] = app["arrival_s"] + 100.0
    points = group_runs(raw)["fig17"]
    c = compare(points, "fig17", "vllm", "max_rate", "max_rate", 0.5)
    assert c.value == math.inf and c.per_repeat == {0: math.inf}
    md = build_report(raw, {}, tmp_path, plots=False)
    assert "vllm rate ≥ 1.3×: met (∞)" in md


def test_the_mixed_load_reports_the_mean_and_the_99th_percentile_of_app_latency() -> None:
    from benchmarks.suite.report import metrics_for

    run = {"apps": [{"kind": "chat", "arrival_s": 1.0, "end_s": 1.0 + i} for i in range(1, 101)]}
    run["apps"].append({"kind": "chain", "arrival_s": 0.0, "end_s": 500.0, "error": "failed"})  # left out
    mean, p99 = (m.fn(run) for m in metrics_for("app_load"))
    assert (mean, p99) == (50.5, 99.0)
    assert metrics_for("app_load")[1].fn({"apps": []}) is None

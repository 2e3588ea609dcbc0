"""The evaluation suite's workload generators and filler text (no model, no network)."""

from __future__ import annotations

import itertools
import json
import math
import random
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(_ROOT))

from benchmarks.suite import textgen  # noqa: E402
from benchmarks.suite.spec import AppSpec, Workload, check_app  # noqa: E402
from benchmarks.suite.workloads import (  # noqa: E402
    APP_LOAD_RATES,
    CONTEXT_TOKENS,
    FIGURES,
    all_workloads,
    app_cost,
    generate,
    poisson_arrivals,
    sharegpt_lengths,
    workload_cost,
)

ALL_FIGURES = [
    "fig11",
    "fig12a",
    "fig12b",
    "fig14",
    "fig15_16",
    "fig17",
    "fig18",
    "fig19",
    "app_load",
    "instructed_chain",
    "agents_load",
]


@pytest.fixture(scope="module")
def suite() -> list[Workload]:
    return all_workloads(1.0, 0)


def _text(workloads: list[Workload]) -> str:
    return "".join(
        c.template + "".join(c.consts.values()) for w in workloads for a in w.apps for c in a.calls
    )


def _prefix(template: str) -> str:
    """The constant text before the first placeholder."""
    return template.split("{{", 1)[0]


# --------------------------------------------------------------------------- textgen


def test_filler_is_deterministic_and_sized() -> None:
    text = textgen.filler(7, 500)
    assert text == textgen.filler(random.Random(7), 500)
    assert text != textgen.filler(8, 500)
    assert len(text.split()) == textgen.words_for_tokens(500)
    assert abs(textgen.estimate_tokens(text) - 500) <= 2
    assert text.endswith(".") and "{{" not in text and "}}" not in text
    assert textgen.filler(0, 0) == ""


def test_filler_advances_a_given_rng() -> None:
    rng = random.Random(3)
    assert textgen.filler(rng, 50) != textgen.filler(rng, 50)


def test_filler_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="token count"):
        textgen.filler(0, -1)
    with pytest.raises(TypeError, match="seed"):
        textgen.filler("x", 10)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the suite


def test_figures_registry() -> None:
    assert list(FIGURES) == ALL_FIGURES


@pytest.mark.parametrize("figure", ALL_FIGURES)
def test_generator_is_deterministic(figure: str) -> None:
    first = generate(figure, 1.0, 0)
    assert first == generate(figure, 1.0, 0)
    assert _text(first) != _text(generate(figure, 1.0, 1))
    assert all(w.figure == figure for w in first)


def test_every_app_is_valid_and_names_unique(suite: list[Workload]) -> None:
    names = [w.name for w in suite]
    assert len(names) == len(set(names))
    app_ids = [a.app_id for w in suite for a in w.apps]
    assert len(app_ids) == len(set(app_ids))
    for workload in suite:
        assert workload.apps, workload.name
        assert {"sweep", "x"} <= set(workload.params)
        json.dumps(dict(workload.params))  # JSON-able
        arrivals = [a.arrival_s for a in workload.apps]
        assert arrivals == sorted(arrivals) and arrivals[0] >= 0
        for app in workload.apps:
            check_app(app)
            assert app.app_id.startswith(workload.name + "/")


def test_scale_one_fits_the_context(suite: list[Workload]) -> None:
    assert max(workload_cost(w).max_call_tokens for w in suite) < 2048


@pytest.mark.parametrize("figure", ALL_FIGURES)
def test_scale_grows_the_work_monotonically(figure: str) -> None:
    costs = [sum(workload_cost(w).decode_tokens for w in generate(figure, s, 0)) for s in (0.25, 1.0, 2.0)]
    assert costs[0] < costs[1] < costs[2], costs
    calls = [sum(workload_cost(w).calls for w in generate(figure, s, 0)) for s in (0.25, 1.0, 2.0)]
    assert calls[0] <= calls[1] <= calls[2]


def test_too_large_a_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="context budget"):
        generate("fig14", 6.0)
    assert max(workload_cost(w).max_call_tokens for w in generate("fig14", 3.0)) < CONTEXT_TOKENS


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("fig99",), "unknown figure 'fig99'"),
        (("fig11", 0.0), "scale must be a finite number > 0"),
        (("fig11", -1.0), "scale must be a finite number > 0"),
        (("fig11", math.nan), "scale must be a finite number > 0"),
        (("fig11", math.inf), "scale must be a finite number > 0"),
        (("fig11", 1.0, "0"), "seed must be an int"),
    ],
)
def test_bad_arguments(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        generate(*args)


def test_all_workloads_rejects_bad_scale() -> None:
    with pytest.raises(ValueError, match="scale"):
        all_workloads(0)


# --------------------------------------------------------------------------- Poisson and chat lengths


def test_poisson_arrivals_have_the_requested_rate() -> None:
    times = poisson_arrivals(random.Random(1), 2.0, 2000.0, start_s=5.0)
    assert times == sorted(times)
    assert times[0] >= 5.0 and times[-1] < 2005.0
    assert abs(len(times) / 2000.0 - 2.0) < 0.1
    assert poisson_arrivals(random.Random(1), 0.0, 100.0) == []
    with pytest.raises(ValueError):
        poisson_arrivals(random.Random(1), -1.0, 10.0)


@pytest.mark.parametrize(("figure", "kind"), [("fig17", "shared_prompt"), ("fig12a", "chat")])
def test_figure_arrival_rates(figure: str, kind: str) -> None:
    for workload in generate(figure, 10.0, 0):
        arrivals = [a.arrival_s for a in workload.apps if a.kind == kind]
        assert arrivals == sorted(arrivals)
        expected = workload.params["x"] * workload.params["window_s"]
        assert abs(len(arrivals) - expected) <= max(3.0, 0.15 * expected), (workload.name, len(arrivals))
        assert all(0 <= t < workload.params["window_s"] for t in arrivals)


def test_sharegpt_lengths_are_capped_and_near_the_model() -> None:
    rng = random.Random(0)
    draws = [sharegpt_lengths(rng) for _ in range(4000)]
    prompts, outputs = zip(*draws, strict=True)
    assert min(prompts) >= 16 and max(prompts) <= 512
    assert min(outputs) >= 8 and max(outputs) <= 128
    assert 120 < sum(prompts) / len(prompts) < 170  # mean 161 before capping
    assert 65 < sum(outputs) / len(outputs) < 90  # mean 84.5 before capping


# --------------------------------------------------------------------------- app structure


def _chains(figures: list[str]) -> list[AppSpec]:
    return [a for f in figures for w in generate(f) for a in w.apps if a.kind == "chain"]


def test_chain_dependencies_form_a_chain() -> None:
    apps = _chains(["fig11", "fig12a", "fig12b"])
    assert apps
    for app in apps:
        assert not app.calls[0].deps
        for prev, call in zip(app.calls, app.calls[1:], strict=False):
            assert dict(call.deps) == {"summary": prev.name}
        assert app.outputs == (app.calls[-1].name,)


def test_fig11_gives_each_point_its_own_document_and_runs_the_shared_point_once() -> None:
    workloads = generate("fig11")
    docs = {" ".join(c.consts["chunk"] for c in w.apps[0].calls) for w in workloads}
    assert len(docs) == len(workloads)  # no point finds another's prompts in a prefix cache
    points = {(w.params["output_tokens"], w.params["chunk_tokens"]): w for w in workloads}
    assert {p: len(w.apps[0].calls) for p, w in points.items()} == {
        (25, 320): 10,
        (50, 320): 10,
        (100, 320): 10,
        (25, 160): 20,
        (25, 80): 40,
    }
    assert all(w.apps[0].calls[0].max_tokens == out for (out, _), w in points.items())

    def sweep(name: str) -> dict[float, str]:
        return {
            (w.params["x"] if w.params["sweep"] == name else w.params["also"][name]): w.name
            for w in workloads
            if w.params["sweep"] == name or name in w.params.get("also", {})
        }

    assert sorted(sweep("output")) == [25, 50, 100]
    assert sorted(sweep("chunk")) == [80, 160, 320]
    assert sweep("output")[25] == sweep("chunk")[320]  # one workload on both sweeps


def test_fig12a_chain_amid_chat() -> None:
    for workload in generate("fig12a"):
        kinds = [a.kind for a in workload.apps]
        assert kinds.count("chain") == 1
        assert kinds.count("chat") == workload.params["chat_apps"]
        assert next(a for a in workload.apps if a.kind == "chain").arrival_s == 3.0
    assert generate("fig12a")[0].params["chat_apps"] == 0


def test_fig12b_apps_have_their_own_documents() -> None:
    assert [w.params["x"] for w in generate("fig12b")] == [10, 25]
    workload = generate("fig12b")[-1]
    assert len(workload.apps) == workload.params["x"] == 25
    firsts = {a.calls[0].consts["chunk"] for a in workload.apps}
    assert len(firsts) == len(workload.apps)
    assert all(a.arrival_s < 0.5 for a in workload.apps)


@pytest.mark.parametrize("figure", ["fig14", "fig19"])
def test_reduce_depends_on_every_map(figure: str) -> None:
    apps = [a for w in generate(figure) for a in w.apps if a.kind == "map_reduce"]
    assert apps
    for app in apps:
        *maps, reduce = app.calls
        assert all(not m.deps for m in maps) and len(maps) >= 2
        assert sorted(reduce.deps.values()) == sorted(m.name for m in maps)
        assert app.outputs == (reduce.name,)
        assert app.criteria == ("throughput" if figure == "fig19" else "latency")


def test_shared_prompt_apps_share_a_constant_prefix_within_each_point() -> None:
    workloads = generate("fig15_16")
    assert len({_prefix(w.apps[0].calls[0].template) for w in workloads}) == len(workloads)
    for workload in workloads:
        prefixes = {_prefix(a.calls[0].template) for a in workload.apps}
        assert len(prefixes) == 1
        (prefix,) = prefixes
        assert 950 < textgen.estimate_tokens(prefix) < 1100
        assert len(workload.apps) == workload.params["x"]
        for app in workload.apps:
            (call,) = app.calls
            assert call.template.startswith(prefix) and set(call.consts) == {"query"}
            assert call.max_tokens == workload.params["output_tokens"] and app.arrival_s == 0.0
    assert sorted({w.params["x"] for w in workloads}) == [8, 16, 32]
    assert {w.params["output_tokens"] for w in workloads} == {64}


def test_fig17_one_prefix_per_application_and_rate() -> None:
    seen: set[str] = set()
    for workload in generate("fig17"):
        assert workload.engines == 2
        per_app = workload.params["app_output_tokens"]
        prefixes: dict[str, set[str]] = {}
        for app in workload.apps:
            gpt = app.app_id.rsplit("/", 1)[1].rstrip("0123456789")
            prefixes.setdefault(gpt, set()).add(_prefix(app.calls[0].template))
            assert per_app[app.app_id] == app.calls[0].max_tokens
        assert all(len(p) == 1 for p in prefixes.values())
        mine = {next(iter(p)) for p in prefixes.values()}
        assert len(mine) == len(prefixes) and not mine & seen  # no rate finds another's in a cache
        seen |= mine
    assert len(seen) > 4


def test_fig18_agents_dag_has_parallel_rounds_with_fan_in_reviews() -> None:
    assert [w.params["x"] for w in generate("fig18")] == [4, 8, 16]
    for workload in generate("fig18"):
        (app,) = workload.apps
        files = workload.params["x"]
        plan, *rest = app.calls
        assert plan.name == "plan" and not plan.deps
        assert len(app.calls) == 1 + files * (1 + 2 * 3) == workload.params["calls"]
        shared = _prefix(rest[0].template)
        assert plan.template.startswith(shared.split("Design plan:")[0])
        names = {c.name: c for c in app.calls}
        for call in rest:
            assert call.deps["plan"] == "plan"
            assert _prefix(call.template) == shared  # the plan placeholder comes first
        for f in range(files):
            assert dict(names[f"code0_f{f:02d}"].deps) == {"plan": "plan"}
            for r in (1, 2, 3):
                review = names[f"review{r}_f{f:02d}"]
                # each review reads the whole code of the previous round
                assert sorted(set(review.deps.values()) - {"plan"}) == [
                    f"code{r - 1}_f{g:02d}" for g in range(files)
                ]
                assert dict(names[f"code{r}_f{f:02d}"].deps) == {
                    "plan": "plan",
                    "code": f"code{r - 1}_f{f:02d}",
                    "review": f"review{r}_f{f:02d}",
                }
        # the reviewers of a round see one common text up to their own instruction
        reviews = [names[f"review1_f{f:02d}"].template for f in range(files)]
        common = reviews[0].split("Reviewer:")[0]
        assert all(t.split("Reviewer:")[0] == common for t in reviews)
        assert app.outputs == tuple(f"code3_f{f:02d}" for f in range(files))
        assert app_cost(app).max_call_tokens < 2048


def test_fig19_mixes_chat_and_map_reduce() -> None:
    (workload,) = generate("fig19")
    assert workload.engines == 2
    kinds = [a.kind for a in workload.apps]
    assert kinds.count("map_reduce") == workload.params["map_reduce_apps"] == 9
    assert 190 <= workload.params["maps"] <= 210
    assert 30 <= workload.params["chat_apps"] <= 50
    assert kinds.count("chat") == workload.params["chat_apps"] > 0
    chat_ids = {a.app_id for a in workload.apps if a.kind == "chat"}
    assert set(workload.params["app_output_tokens"]) == chat_ids


def test_app_load_mixes_kinds_and_a_higher_rate_has_more_apps_over_the_same_window() -> None:
    workloads = generate("app_load")
    assert [w.params["x"] for w in workloads] == list(APP_LOAD_RATES)
    counts = [len(w.apps) for w in workloads]
    assert counts == sorted(counts) and counts[0] > 0
    for workload in workloads:
        rate, window = workload.params["x"], workload.params["window_s"]
        assert workload.engines == 1 and window == 60.0
        assert abs(len(workload.apps) - rate * window) <= 4 * math.sqrt(rate * window)  # Poisson
        assert max(a.arrival_s for a in workload.apps) < window
        kinds = [a.kind for a in workload.apps]
        assert workload.params["kinds"] == {k: kinds.count(k) for k in ("chat", "chain", "map_reduce")}
        assert all(kinds.count(k) > 0 for k in ("chat", "chain", "map_reduce"))
        sizes = {len(a.calls) for a in workload.apps if a.kind != "chat"}
        assert len(sizes) >= 5  # multi-call apps of many sizes: their order decides the mean


def test_app_load_rates_can_be_chosen_and_each_rate_keeps_its_apps() -> None:
    default = {w.name: w for w in generate("app_load", seed=3)}
    chosen = generate("app_load", seed=3, app_load_rates=[2.0, 1.75])
    assert [w.params["x"] for w in chosen] == [2.0, 1.75]
    same = chosen[0]  # a rate of the default sweep: the same apps, run alone or beside others
    assert [a.app_id for a in same.apps] == [a.app_id for a in default[same.name].apps]
    assert [a.calls for a in same.apps] == [a.calls for a in default[same.name].apps]
    assert chosen[1].name not in default and len(chosen[1].apps) < len(same.apps) + 20
    assert [w.name for w in generate("fig11", app_load_rates=[3.0])] == [w.name for w in generate("fig11")]


@pytest.mark.parametrize("rates", [[], [0.0], [-1.0], [float("nan")], [float("inf")]])
def test_app_load_rejects_rates_that_are_not_positive_and_finite(rates: list[float]) -> None:
    with pytest.raises(ValueError, match="app_load rates must be finite and > 0"):
        generate("app_load", app_load_rates=rates)


def test_the_suite_and_the_simulator_take_app_load_rates_and_refuse_them_without_the_figure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks.sim.__main__ import main as sim_main
    from benchmarks.suite import run

    args, _, first = run.parse_args(["--figures", "app_load", "--app-load-rates", "1.75", "2.25"])
    assert args.app_load_rates == [1.75, 2.25] and [w.params["x"] for w in first] == [1.75, 2.25]
    assert run.collect_header(args)["app_load_rates"] == [1.75, 2.25] and "app_load_rates" in run.RUN_DEFINING
    for argv, said in [
        (["--figures", "fig11", "--app-load-rates", "2"], "--app-load-rates needs the figure app_load"),
        (["--figures", "app_load", "--app-load-rates", "0"], "app_load rates must be finite and > 0"),
    ]:
        with pytest.raises(SystemExit) as info:
            run.parse_args(argv)
        assert info.value.code == 2 and said in capsys.readouterr().err
    for argv, said in [
        (["--figures", "app_load", "--tokenizer", "tiny", "--app-load-rates", "nan"], "finite and > 0"),
        (["--figures", "fig14", "--app-load-rates", "2"], "--app-load-rates needs the figure app_load"),
    ]:
        with pytest.raises(SystemExit) as info:
            sim_main(argv)
        assert info.value.code == 2 and said in capsys.readouterr().err


def test_fig17_rates_span_both_saturations_with_enough_requests() -> None:
    workloads = generate("fig17")
    rates = [w.params["x"] for w in workloads]
    assert rates == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    for workload in workloads:
        assert workload.params["window_s"] * workload.params["x"] >= 10 - 1e-9
        assert len(workload.apps) == workload.params["requests"] >= 1


def test_tiny_scales_still_give_every_workload_an_app() -> None:
    for workload in all_workloads(0.05, 0):
        assert workload.apps, workload.name


def test_instructed_chain_steps_each_start_with_instructions_of_their_own() -> None:
    for workload in generate("instructed_chain"):
        (app,) = workload.apps
        assert len(app.calls) == workload.params["steps"] == 6
        heads = [c.template.split("{{", 1)[0] for c in app.calls]
        assert len(set(heads)) == len(heads)  # no step's start is another's: nothing for a prefix cache
        tokens = workload.params["x"]
        assert all(abs(textgen.estimate_tokens(h) - tokens) < 0.2 * tokens for h in heads)
        assert all(set(c.deps.values()) == {p.name} for p, c in itertools.pairwise(app.calls))


def test_agents_load_apps_each_have_a_system_prompt_of_their_own() -> None:
    workloads = generate("agents_load")
    counts = [len(w.apps) for w in workloads]
    assert counts == sorted(counts) and counts[0] >= 3
    for workload in workloads:
        starts = {a.calls[0].template[:200] for a in workload.apps}
        assert len(starts) == len(workload.apps)  # no app's prefix is another's
        assert all(len(a.calls) == 21 and a.kind == "agents" for a in workload.apps)
    top = workloads[-1]
    prefixes = sum(textgen.estimate_tokens(a.calls[0].template.split("Architect:")[0]) for a in top.apps)
    assert prefixes > top.params["kv_cache_tokens"]  # the pool cannot hold every app's prefix

"""The suite's run-time estimate (benchmarks/suite/estimate.py): a fluid simulation, checked by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(_ROOT))

from benchmarks.suite import textgen  # noqa: E402
from benchmarks.suite.estimate import SPEEDS, Profile, estimate_apps, estimate_workload, profile_of  # noqa: E402
from benchmarks.suite.spec import AppSpec, CallSpec, Workload  # noqa: E402

F32 = SPEEDS["float32"]
TEXT = "word " * 100  # 100 words


def _single(app_id: str, prefix: str, out: int, arrival: float = 0.0) -> AppSpec:
    call = CallSpec("a", prefix + "{{input:q}} answer:{{output:a}}", out, consts={"q": "one two"})
    return AppSpec(app_id, "shared_prompt", (call,), ("a",), arrival_s=arrival)


def _prompt(prefix: str) -> int:
    rest = textgen.estimate_tokens("one two") + textgen.estimate_tokens(" answer:")
    return textgen.estimate_tokens(prefix) + rest


def test_step_times_interpolate_and_extrapolate() -> None:
    assert F32.step_s(1) == pytest.approx(0.033)
    assert F32.step_s(3) == pytest.approx(0.039)
    assert F32.step_s(32) == pytest.approx(0.062 + (0.062 - 0.048) * 2)


def test_one_call_is_delay_prefill_and_decode() -> None:
    app = _single("w/a", TEXT, 10)
    w = Workload("figX", "figX/one", {"sweep": "x", "x": 1}, (app,))
    prompt = _prompt(TEXT)
    decode = 9 * F32.step_s(1)  # the prefill step yields the first token
    base = estimate_workload(w, Profile("baseline", sharing=False), delay_s=0.25)
    assert base == pytest.approx(0.25 + prompt / 600 + decode)
    parrot = estimate_workload(w, Profile("parrot", sharing=True), delay_s=0.25)
    assert parrot == pytest.approx(2 * 0.25 + prompt / 600 + decode)  # submit (with the session), get


def test_a_chain_pays_a_delay_per_call_on_the_baseline_only() -> None:
    calls = [CallSpec("c0", "x {{input:t}} y{{output:c0}}", 5, consts={"t": TEXT})]
    for i in (1, 2, 3):
        template = "z {{input:p}} y{{output:c" + str(i) + "}}"
        calls.append(CallSpec(f"c{i}", template, 5, deps={"p": f"c{i - 1}"}))
    app = AppSpec("w/c", "chain", tuple(calls), ("c3",))
    w = Workload("figX", "figX/chain", {"sweep": "x", "x": 1}, (app,))
    base = {d: estimate_workload(w, Profile("baseline", sharing=False), delay_s=d) for d in (0.0, 1.0)}
    parrot = {d: estimate_workload(w, Profile("parrot", sharing=False), delay_s=d) for d in (0.0, 1.0)}
    assert base[0.0] == pytest.approx(parrot[0.0])  # the same engine work
    assert base[1.0] - base[0.0] == pytest.approx(4.0)  # one delay per call
    assert parrot[1.0] - parrot[0.0] == pytest.approx(2.0)  # submit and get, whatever the length


def test_sharing_skips_a_common_prefix_and_fastchat_serialises() -> None:
    apps = tuple(_single(f"w/r{i}", TEXT * 5, 8, arrival=5.0 * i) for i in range(4))
    w = Workload("figX", "figX/shared", {"sweep": "x", "x": 1}, apps)

    def total(profile: Profile) -> float:
        return sum(a.latency_s for a in estimate_apps(w, profile, delay_s=0.0))

    saved = total(Profile("baseline", sharing=False)) - total(Profile("baseline", sharing=True))
    # the prompts are identical: the last three prefill one token instead of all of them
    assert saved == pytest.approx(3 * (_prompt(TEXT * 5) - 1) / 600)
    apps = tuple(_single(f"w/r{i}", TEXT * 5, 8) for i in range(4))
    w = Workload("figX", "figX/together", {"sweep": "x", "x": 1}, apps)
    plain = estimate_workload(w, Profile("baseline", sharing=False), delay_s=0.0)
    serial = estimate_workload(w, profile_of("fastchat"), delay_s=0.0)
    assert serial > plain  # one request at a time: no batched decode
    ends = sorted(a.end_s for a in estimate_apps(w, profile_of("fastchat"), delay_s=0.0))
    per_request = _prompt(TEXT * 5) / 600 + 7 * F32.step_s(1)
    assert ends == pytest.approx([per_request * (i + 1) for i in range(4)], rel=1e-6)


def test_two_engines_split_the_threads() -> None:
    apps = (_single("w/a", TEXT, 4), _single("w/b", "other " * 50, 4))
    one = Workload("figX", "figX/1", {"sweep": "x", "x": 1}, apps)
    two = Workload("figX", "figX/2", {"sweep": "x", "x": 1}, apps, engines=2)
    profile = Profile("baseline", sharing=False)
    a_alone = _prompt(TEXT) / 300 + 3 * 2 * F32.step_s(1)  # half the rate, twice the step
    ends = {a.app_id: a.end_s for a in estimate_apps(two, profile, delay_s=0.0)}
    assert ends["w/a"] == pytest.approx(a_alone)
    assert estimate_workload(one, profile, delay_s=0.0) < estimate_workload(two, profile, delay_s=0.0)

"""The Parrot-over-vLLM greedy-equality script (benchmarks/parrot_over_vllm_check.py),
without vLLM: its app building, command line and report, one whole run with a real
Parrot server standing in for vLLM (``--backend-kind openai``: text prompts), and its
structured-output requests against a real Parrot server."""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
check = importlib.import_module("parrot_over_vllm_check")


def test_every_example_app_is_built_and_unknown_ones_are_refused():
    args = check.parse_args([])
    apps = check.build_apps(list(check.APPS), 8, 150, args.file, "owls")
    assert sorted(apps) == sorted(check.APPS) and all(callable(a) for a in apps.values())
    with pytest.raises(ValueError, match=r"unknown apps \['nope'\]"):
        check.build_apps(["qa_chain", "nope"], 8, 150, args.file, "owls")


def test_serve_command_puts_parrot_in_front_of_the_backend():
    cmd = check.serve_command("http://127.0.0.1:8100", "/m/smollm2", 9400)
    assert cmd[1:4] == ["-m", "parrot.cli", "serve"]
    joined = " ".join(cmd)
    assert "--backend vllm --backend-url http://127.0.0.1:8100 --backend-tokenizer /m/smollm2" in joined
    assert "--port 9400" in joined


def test_report_counts_equal_apps_and_shows_where_outputs_differ():
    same = check.AppResult("qa_chain", True, "abc", "abc", 1.0, 2.0, "outputs equal: yes")
    other = check.AppResult("map_reduce", False, "abd", "abc", 1.0, 2.0, "outputs equal: no, at 2")
    text = check.report([same, other], "python x.py")
    assert text.splitlines()[0] == "$ python x.py"
    assert "qa_chain       outputs equal: yes" in text and "outputs equal: no, at 2" in text
    assert text.endswith("1/2 apps with equal greedy outputs")


def test_a_whole_check_against_a_parrot_backend(live, tmp_path):
    args = check.parse_args(
        ["--apps", "qa_chain", "--backend-kind", "openai", "--out", str(tmp_path), "--parrot-port", "0",
         "--no-constraints"]  # an openai-kind backend refuses them (tested in test_openai_backend)
    )  # fmt: skip
    results, constraints = check.run_check(args, lambda: contextlib.nullcontext(live.url), "tiny")
    (r,) = results
    assert constraints == []
    assert r.app == "qa_chain" and r.equal and r.difference == "outputs equal: yes" and r.parrot_value
    assert "manager ready at" in (tmp_path / "parrot-serve.log").read_text()


def test_the_constraint_checks_tell_an_answer_that_follows_from_one_that_does_not(live):
    # Parrot's own API takes every field the check sends, so both "servers" follow them
    found = check.check_constraints(live.url, live.url, model="tiny")
    assert [(c.constraint, c.server) for c in found] == [
        (name, server) for name in check.CONSTRAINTS for server in ("parrot", "vllm")
    ]
    assert all(c.follows for c in found), found
    ignored = check.ConstraintResult("guided_choice", "vllm", "a story", False)
    text = check.report([], "python x.py", [*found[:1], ignored])
    assert "guided_choice              vllm   ignores it: 'a story'" in text
    assert f"structured_outputs.choice  parrot follows it: {found[0].text!r}" in text

"""The example applications run end to end both ways -- semantic functions and a
request-level client -- against a real server with the tiny model, and report
what the demo prints: both times, their ratio, the requests each way sent, and
whether the final values are equal."""

import importlib
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

two_ways = importlib.import_module("_two_ways")

DELAY_MS = 40.0
# the tiny model's tokenizer is byte-level, so chunks must be small to fit its context
SUMMARY_ARGS = ["--max-tokens", "8", "--chunk-words", "150"]


def _calls(app: str, out: str) -> int:
    """How many semantic-function calls the app made, from what it printed."""
    if app == "qa_chain":
        return 5
    chunks = int(re.search(r"words in (\d+) chunks", out).group(1))
    assert chunks > 5
    return chunks + (app == "map_reduce")  # one call per chunk (+ the reduce)


@pytest.mark.parametrize("app", ["chain_summary", "map_reduce", "qa_chain"])
def test_example_runs_both_ways(live, app, capsys):
    module = importlib.import_module(app)
    args = ["--url", live.url, "--delay-ms", f"{DELAY_MS:g}"]
    comparison = module.main(args + (SUMMARY_ARGS if app != "qa_chain" else []))
    out = capsys.readouterr().out
    calls = _calls(app, out)
    parrot, request_level = comparison.parrot, comparison.request_level

    # Request level: one completion per call, and nothing else.
    assert request_level.requests == [("POST", "/v1/completions")] * calls
    # Parrot: the whole app in the request that creates the session, then only gets of
    # the final value.
    assert parrot.requests[0] == ("POST", "/v1/sessions")
    gets = parrot.requests[1:]
    assert gets and all(
        m == "GET" and re.fullmatch(r"/v1/sessions/[^/]+/variables/[^/]+", p) for m, p in gets
    )
    assert len({p for _, p in gets}) == 1  # one variable fetched: the final value
    # The server saw the same: one session, whose calls all came with its creation (no
    # later batch or single-call submission), closed after the run; and one completion per
    # call in the untimed run and in the timed one.
    seen = live.requests
    assert seen.count(("POST", "/v1/sessions")) == 1
    assert not any(p.endswith(("/batch", "/calls")) for _, p in seen)
    assert not live.manager.sessions
    assert seen.count(("POST", "/v1/completions")) == 2 * calls  # the app ran untimed first

    # Every request paid the emulated round trip, one after another on the critical path.
    assert parrot.seconds >= len(parrot.requests) * DELAY_MS / 1000
    if app != "map_reduce":  # a chain: every completion waits for the previous answer
        assert request_level.seconds >= calls * DELAY_MS / 1000

    assert parrot.value.strip() and request_level.value.strip()
    # What is printed comes from the values themselves.
    assert comparison.equal == (parrot.value == request_level.value)
    assert two_ways.equality_line(parrot.value, request_level.value) in out
    assert parrot.value in out and request_level.value in out
    assert f"{parrot.seconds:6.2f} s, requests {len(parrot.requests)} (submit 1, get {len(gets)})" in out
    assert f"{request_level.seconds:6.2f} s, requests {calls} (completion {calls})" in out
    assert f"request level / Parrot: {request_level.seconds / parrot.seconds:.2f}x" in out
    assert f"{DELAY_MS:g} ms round trip per HTTP request" in out
    # The manager tokenizes a semantic function's rendered prompt whole, as a completion's,
    # so both ways give the model the same tokens and, greedy, must agree.
    assert comparison.equal, out


def test_example_script_runs(live, tmp_path):
    """As the demo runs it: a script, printing the comparison (on a two-paragraph text)."""
    text = tmp_path / "short.txt"
    text.write_text("Lighthouses guide ships at night.\n\nMost of them are automated today.\n")
    args = [
        "--url",
        live.url,
        "--delay-ms",
        "0",
        "--file",
        str(text),
        "--chunk-words",
        "5",
        "--max-tokens",
        "4",
    ]
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "chain_summary.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "words in 2 chunks" in out.stdout
    assert "requests 2 (completion 2)" in out.stdout and "request level / Parrot:" in out.stdout
    assert "outputs equal: yes" in out.stdout


def test_first_difference_and_equality_line():
    assert two_ways.first_difference("abc", "abc") is None
    assert two_ways.first_difference("abc", "abd") == 2
    assert two_ways.first_difference("ab", "abc") == 2
    assert two_ways.first_difference("", "x") == 0
    assert two_ways.equality_line("same", "same") == "outputs equal: yes"
    line = two_ways.equality_line("The cat sat.", "The cat ran.")
    assert line.startswith("outputs equal: no (first difference at character 8 of 12 / 12:")
    assert "'The cat sat.'" in line and "'The cat ran.'" in line
    far = two_ways.equality_line("x" * 100 + "a", "x" * 100 + "b")
    assert "character 100" in far and "'..." in far  # long values are cut around the difference


def test_network_delays_and_logs_only_while_charging(live):
    network = two_ways.Network(0.05, charging=False)
    with httpx.Client(base_url=live.url, transport=network) as http:
        http.get("/healthz")
        assert network.log == []
        network.charging = True
        start = time.perf_counter()
        assert http.get("/healthz").status_code == 200
        assert time.perf_counter() - start >= 0.05
    assert network.log == [("GET", "/healthz")]
    assert two_ways.describe_requests([("POST", "/v1/completions")] * 3) == "3 (completion 3)"

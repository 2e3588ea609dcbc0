"""``GET /metrics`` (Prometheus text) on a real manager over loopback with the tiny engine.

Every scrape is parsed with prometheus_client's own parser, and the counters are
checked against what the test itself made happen: the requests it sent (as the
server's request log saw them), the calls its app ran, the tokens the engine
filled, reused and generated."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import parrot as P
from parrot.manager.service import ManagerConfig
from parrot.protocol.cluster import CLUSTER_SECRET_HEADER
from parrot.protocol.schemas import PlaceholderBinding, SubmitCall
from tests.api_client import expect_error
from tests.conftest import LiveServer

ROOT = Path(__file__).resolve().parents[1]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

SECRET = "metrics-operator-secret-0123"
ALICE = "alice-key-0123456789abcdef"


def parse(text: str) -> Samples:
    """Every sample of a scrape, keyed by (name, sorted labels); fails on text that is not
    the Prometheus format."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: Samples, metric: str, /, **labels: str) -> float:
    """Sum of the samples of ``metric`` whose labels include ``labels``."""
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == metric and all(dict(ls).get(k) == want for k, want in labels.items())
    )


@pytest.fixture
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=60) as client:
        yield client


def scrape(http: httpx.Client, **headers: str) -> Samples:
    response = http.get("/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")
    return parse(response.text)


def tok(n: int) -> P.Output:
    return P.Output(max_tokens=n, temperature=0.0, ignore_eos=True)


@P.semantic_function
def draft(topic: P.Input, text: tok(6)):
    """Write about {{topic}}: {{text}}"""


@P.semantic_function
def improve(text: P.Input, better: tok(5)):
    """Improve this: {{text}} -> {{better}}"""


def test_an_app_and_a_completion_move_the_counters_by_what_they_did(live: LiveServer, http) -> None:
    live.requests.clear()
    before = scrape(http)  # counted once its answer starts, so in the next scrape, not in itself
    with P.connect(live.url) as s:
        a = draft("lighthouses")
        b = improve(a)
        b.get(P.LATENCY, timeout=60)
        sid = s.session_id
        during = scrape(http)  # the session is open: its calls are counted by state
        calls = list(live.manager.sessions[sid].calls.values())
    # exactly 4 tokens (a sampled end of text after one token would leave no time per output token)
    completion = {"model": "tiny", "prompt": "one two three", "max_tokens": 4, "ignore_eos": True}
    done = http.post("/v1/completions", json=completion)
    assert done.status_code == 200, done.text
    usage = done.json()["usage"]
    after = scrape(http)

    # requests: exactly those the server's request log saw since the first scrape
    endpoints = {dict(ls)["endpoint"] for n, ls in after if n == "parrot_http_requests_total"}

    def templated(path: str) -> str:  # the one route template that matches the path
        [endpoint] = [e for e in endpoints if re.fullmatch(re.sub(r"\{\w+\}", "[^/]+", e), path)]
        return endpoint

    seen: dict[tuple[str, str], int] = {}
    for method, path in live.requests[:-1]:  # the last is the scrape that reported them
        seen[(templated(path), method)] = seen.get((templated(path), method), 0) + 1
    assert seen[("/v1/sessions/{session_id}/calls", "POST")] == 2
    for (endpoint, method), n in seen.items():
        moved = total(after, "parrot_http_requests_total", endpoint=endpoint, method=method)
        moved -= total(before, "parrot_http_requests_total", endpoint=endpoint, method=method)
        assert moved == n, (endpoint, method, moved, n)
    assert total(after, "parrot_http_requests_total") - total(before, "parrot_http_requests_total") == sum(
        seen.values()
    )
    assert total(after, "parrot_http_requests_total", status="2xx") - total(
        before, "parrot_http_requests_total", status="2xx"
    ) == sum(seen.values())

    # calls of the open session: both done, deduced latency-sensitive (get(P.LATENCY))
    assert total(during, "parrot_calls", state="done", objective="latency") == 2
    assert total(during, "parrot_calls") == 2
    assert total(after, "parrot_calls") == 0  # its session closed; the completion's too

    # three runs (two calls and the completion): each placed once, each with a first token
    # and an output of at least two tokens
    for name in (
        "parrot_queue_wait_seconds_count",
        "parrot_time_to_first_token_seconds_count",
        "parrot_time_per_output_token_seconds_count",
    ):
        assert total(after, name) - total(before, name) == 3, name
    assert total(after, "parrot_queue_length") == 0

    # tokens: the engine filled every prompt and generated every output token
    prompts = sum(c.prompt_tokens or 0 for c in calls) + usage["prompt_tokens"]
    generated = 6 + 5 + usage["completion_tokens"]
    engine = calls[0].engine_id
    assert engine is not None
    for name, want in (
        ("parrot_engine_filled_tokens_total", prompts),
        ("parrot_engine_generated_tokens_total", generated),
    ):
        assert total(after, name, engine=engine) - total(before, name, engine=engine) == want, name


def test_prefix_reuse_is_counted_block_by_block(live: LiveServer, http) -> None:
    """Two completions sharing a long prefix (random, so no earlier test cached it): the
    second reuses the whole 16-token blocks of the common token prefix."""
    prefix = secrets.token_hex(40)
    prompts = [f"{prefix} question one", f"{prefix} question two"]
    before = scrape(http)
    for prompt in prompts:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3})
        assert r.status_code == 200, r.text
    after = scrape(http)
    [handle] = live.manager.pool
    ids = [handle.api.tokenizer.encode(p) for p in prompts]
    common = next(i for i, (x, y) in enumerate(zip(*ids, strict=False)) if x != y)
    block = handle.stats.kv_block_size
    labels = {"engine": handle.engine_id}
    reused = total(after, "parrot_engine_prefix_reused_tokens_total", **labels) - total(
        before, "parrot_engine_prefix_reused_tokens_total", **labels
    )
    filled = total(after, "parrot_engine_filled_tokens_total", **labels) - total(
        before, "parrot_engine_filled_tokens_total", **labels
    )
    assert common >= 2 * block
    assert reused == (common // block) * block
    assert filled == len(ids[0]) + len(ids[1])


def test_engine_gauges_match_the_engines_own_stats(live: LiveServer, http) -> None:
    samples = scrape(http)
    [handle] = live.manager.pool
    stats = live.run_on_loop(handle.api.stats())
    labels = {"engine": handle.engine_id}
    assert total(samples, "parrot_engines", alive="true") == 1
    assert total(samples, "parrot_engines", alive="false") == 0
    assert total(samples, "parrot_engine_info", engine=handle.engine_id, name="tiny", model=handle.model) == 1
    assert total(samples, "parrot_engine_kv_blocks_total", **labels) == stats.kv_blocks_total > 0
    assert total(samples, "parrot_engine_kv_blocks_used", **labels) == stats.kv_blocks_used
    assert total(samples, "parrot_engine_token_capacity", **labels) == stats.token_capacity
    assert total(samples, "parrot_sessions") == 0


def test_every_family_is_documented_with_its_type(http) -> None:
    """docs/metrics.md lists each metric as `name` | type: the scrape and the page agree."""
    families = {f.name: f.type for f in text_string_to_metric_families(http.get("/metrics").text)}
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = dict(re.findall(r"^\| `(parrot_\w+)` \| (counter|gauge|histogram) \|", doc, re.M))
    # the parser names a counter's family without its _total (as the docs do not)
    scraped = {(n + "_total" if t == "counter" else n): t for n, t in families.items()}
    assert scraped == documented


def test_labels_never_carry_what_clients_sent(live: LiveServer, http) -> None:
    """A prompt, its value, the session and call ids, odd methods and unknown paths: none
    of them appears in a scrape; unknown routes and methods share one label value."""
    marker = "zebra" + secrets.token_hex(8)
    with P.connect(live.url) as s:
        out = draft(marker)
        value = out.get(timeout=60)
        ids = [s.session_id, out.id, *live.manager.sessions[s.session_id].calls]
        http.get(f"/no/such/{marker}")
        http.request("BREW", f"/v1/sessions/{s.session_id}")
        text = http.get("/metrics").text
    for secret in (marker, value.strip(), *ids):
        assert secret and secret not in text
    samples = parse(text)
    assert total(samples, "parrot_http_requests_total", endpoint="unmatched", method="GET", status="4xx") == 1
    assert total(samples, "parrot_http_requests_total", method="other", status="4xx") == 1


@pytest.mark.timing
def test_scraping_is_fast_with_many_open_sessions(live: LiveServer, http) -> None:
    """2,000 open sessions of 5 waiting calls each: a scrape reads them all on the event
    loop, well within the ~100 ms a request may hold it."""
    manager = live.manager

    async def populate() -> None:
        for _ in range(2000):
            session, _ = manager.create_session()
            var = manager.create_variable(session, None, None)
            for _ in range(5):
                manager.submit_call(
                    session,
                    SubmitCall(
                        template="Q {{input:a}} {{output:y}}",
                        placeholders=[
                            PlaceholderBinding(name="a", direction="input", var_id=var.var_id),
                            PlaceholderBinding(name="y", direction="output", sampling={"max_tokens": 2}),
                        ],
                    ),
                )

    live.run_on_loop(populate(), timeout=120)

    async def timed_render() -> float:
        started = time.perf_counter()
        manager.metrics.render()
        return time.perf_counter() - started

    took = min(live.run_on_loop(timed_render()) for _ in range(3))
    assert took < 0.1, f"a scrape held the event loop {took * 1000:.0f} ms"
    samples = scrape(http)
    assert total(samples, "parrot_sessions") == 2000
    assert total(samples, "parrot_calls", state="waiting") == 10000


@pytest.mark.parametrize("manager_config", [ManagerConfig(api_keys={ALICE: "alice"}, cluster_secret=SECRET)])
def test_with_api_keys_a_scrape_needs_the_cluster_secret(live: LiveServer, http) -> None:
    wrong = "wrong-secret-0123456789"
    for headers in ({}, {"Authorization": f"Bearer {ALICE}"}, {CLUSTER_SECRET_HEADER: wrong}):
        expect_error(http.get("/metrics", headers=headers), 401, "unauthorized", "cluster secret")
    assert http.get("/healthz").json()["ok"] is True  # the refusals disturbed nothing
    by_header = scrape(http, **{CLUSTER_SECRET_HEADER: SECRET})
    by_bearer = scrape(http, Authorization=f"Bearer {SECRET}")
    assert total(by_header, "parrot_http_requests_total", endpoint="/metrics", status="4xx") == 3
    assert total(by_bearer, "parrot_http_requests_total", endpoint="/metrics", status="2xx") == 1
    assert "alice" not in http.get("/metrics", headers={CLUSTER_SECRET_HEADER: SECRET}).text


@pytest.mark.parametrize("manager_config", [ManagerConfig(api_keys={ALICE: "alice"})])
def test_with_api_keys_and_no_cluster_secret_nobody_scrapes(http) -> None:
    response = http.get("/metrics", headers={"Authorization": f"Bearer {ALICE}"})
    err = expect_error(response, 401, "unauthorized")
    assert "started without one" in err["message"]
    assert http.get("/healthz").status_code == 200


def test_each_manager_has_its_own_registry(live: LiveServer, http) -> None:
    """Managers in one process count apart: a fresh manager's counters start at zero."""
    from parrot.manager.service import Manager

    http.get("/healthz")
    other = Manager(ManagerConfig())
    assert total(parse(other.metrics.render().decode()), "parrot_http_requests_total") == 0
    assert total(scrape(http), "parrot_http_requests_total", endpoint="/healthz") == 1

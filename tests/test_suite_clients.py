"""The evaluation suite's clients (``benchmarks/suite/clients.py``) and its command line.

The baseline client runs against a real loopback HTTP server that implements
``/v1/completions`` and records every request; Parrot's client runs against a
real Parrot manager with the tiny engine (the ``live`` fixture).  No model is
downloaded and no peer server is started.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, StreamingResponse

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.suite.clients import (  # noqa: E402 - after the sys.path line
    Delay,
    Router,
    _snapshot,
    render_prompt,
    run_baseline_app,
    run_parrot_app,
    run_workload,
)
from benchmarks.suite.spec import AppSpec, CallSpec, RunRecord, Workload, check_app  # noqa: E402
from benchmarks.suite.systems import SystemHandle  # noqa: E402

from parrot.manager.service import ManagerConfig  # noqa: E402
from parrot.protocol import clock  # noqa: E402
from parrot.protocol.cluster import CLUSTER_SECRET_HEADER  # noqa: E402

ANSWER_S = 0.1
OPERATOR_SECRET = "suite-operator-secret-0123"  # how long the fake server takes per completion


def completion_of(prompt: str) -> str:
    """The fake server's deterministic completion for ``prompt``."""
    return f" OUT[{hashlib.sha1(prompt.encode()).hexdigest()[:8]}]"


# ------------------------------------------------------------------ a fake OpenAI server
@dataclass
class Seen:
    body: dict[str, Any]
    start: float  # time.perf_counter() when the request arrived
    first: float = 0.0  # ... when its first text was sent
    end: float = 0.0  # ... and when its answer was complete


@dataclass
class FakeOpenAI:
    url: str = ""
    seen: list[Seen] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    metrics: str = ""  # what GET /metrics answers (vLLM's Prometheus text)
    generation: int = 0  # bumped by reset: a request of an earlier test no longer counts

    def reset(self) -> None:
        self.seen.clear()
        self.in_flight = self.max_in_flight = 0
        self.metrics = ""
        self.generation += 1


def _fake_app(state: FakeOpenAI) -> FastAPI:
    app = FastAPI()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> Any:
        """Streams (as the suite's client asks) the first half of the text after
        ANSWER_S / 2, the rest after ANSWER_S, then the usage chunk."""
        seen = Seen(body, time.perf_counter())
        state.seen.append(seen)
        generation = state.generation
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        text = completion_of(body["prompt"])
        usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": 3}
        usage["total_tokens"] = usage["prompt_tokens"] + 3

        def chunk(piece: str, reason: str | None) -> bytes:
            event = {"choices": [{"text": piece, "index": 0, "finish_reason": reason}]}
            return f"data: {json.dumps(event)}\n\n".encode()

        async def events() -> Any:
            try:
                await asyncio.sleep(ANSWER_S / 2)
                seen.first = time.perf_counter()
                yield chunk(text[:4], None)
                await asyncio.sleep(ANSWER_S / 2)
                yield chunk(text[4:], "length")
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                if state.generation == generation:  # an earlier test's stream may end late
                    state.in_flight -= 1
                seen.end = time.perf_counter()

        assert body.get("stream") is True
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_openai() -> Iterator[FakeOpenAI]:
    state = FakeOpenAI()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    state.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(_fake_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.01)
    yield state
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


@pytest.fixture
def fake(fake_openai: FakeOpenAI) -> FakeOpenAI:
    fake_openai.reset()
    return fake_openai


# ------------------------------------------------------------------ apps
def chain_app(app_id: str = "chain-0", arrival_s: float = 0.0) -> AppSpec:
    calls = (
        CallSpec("s1", "Document: {{input:doc}}\nSummary:{{output:s1}}", 7, consts={"doc": "alpha beta"}),
        CallSpec(
            "s2",
            "Summary so far:{{input:prev}}\nNext part: {{input:part}}\nNew summary:{{output:s2}}",
            8,
            consts={"part": "gamma {{input:not_a_placeholder}}"},
            deps={"prev": "s1"},
        ),
        CallSpec("s3", "Text:{{input:prev}}\nTitle:{{output:s3}}", 9, deps={"prev": "s2"}),
    )
    app = AppSpec(app_id, "chain", calls, ("s3",), arrival_s=arrival_s)
    check_app(app)
    return app


def map_reduce_app(n_maps: int = 4, app_id: str = "mr-0") -> AppSpec:
    maps = tuple(
        CallSpec(
            f"m{i}", "Part: {{input:chunk}}\nSummary:{{output:m" + str(i) + "}}", 5, consts={"chunk": f"c{i}"}
        )
        for i in range(n_maps)
    )
    parts = "\n".join(f"{{{{input:p{i}}}}}" for i in range(n_maps))
    reduce = CallSpec(
        "r", f"Summaries:\n{parts}\nFinal:{{{{output:r}}}}", 6, deps={f"p{i}": f"m{i}" for i in range(n_maps)}
    )
    app = AppSpec(app_id, "map_reduce", (*maps, reduce), ("r",))
    check_app(app)
    return app


def baseline(fake: FakeOpenAI, app: AppSpec, delay: Delay, **kw: Any):
    async def go():
        import httpx

        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            return await run_baseline_app(client, fake.url, "m", app, time.perf_counter(), delay, **kw)

    return asyncio.run(go())


# ------------------------------------------------------------------ baseline client
def test_render_prompt_substitutes_once_and_stops_before_the_output() -> None:
    call = chain_app().calls[1]
    prompt = render_prompt(call, {"s1": " X {{input:part}}"})
    assert (
        prompt
        == "Summary so far: X {{input:part}}\nNext part: gamma {{input:not_a_placeholder}}\nNew summary:"
    )


def test_baseline_chain_renders_client_side_one_request_per_call(fake: FakeOpenAI) -> None:
    record = baseline(fake, chain_app(), Delay(0, 0))
    assert record.error is None
    assert len(fake.seen) == 3
    p1 = "Document: alpha beta\nSummary:"
    p2 = f"Summary so far:{completion_of(p1)}\nNext part: gamma {{{{input:not_a_placeholder}}}}\nNew summary:"
    p3 = f"Text:{completion_of(p2)}\nTitle:"
    assert [s.body["prompt"] for s in fake.seen] == [p1, p2, p3]
    for seen, max_tokens in zip(fake.seen, (7, 8, 9), strict=True):
        assert seen.body == {
            "model": "m",
            "prompt": seen.body["prompt"],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    # each call was sent only after its producer answered
    assert fake.seen[1].start >= fake.seen[0].end and fake.seen[2].start >= fake.seen[1].end
    assert [c.name for c in record.calls] == ["s1", "s2", "s3"]
    assert [c.output_tokens for c in record.calls] == [3, 3, 3]
    assert record.calls[0].prompt_tokens == len(p1.split())
    assert record.end_s == record.calls[-1].end_s >= record.start_s
    for call in record.calls:  # streamed: the first text came half-way through the answer
        assert call.ready_s == call.start_s < call.first_token_s < call.end_s
        assert call.first_token_s - call.start_s >= ANSWER_S / 2 - 0.01
        assert call.end_s - call.first_token_s >= ANSWER_S / 2 - 0.01
    assert (record.delays, record.delay_s) == (3, 0.0)


def test_baseline_without_ignore_eos_does_not_send_it(fake: FakeOpenAI) -> None:
    record = baseline(fake, chain_app(), Delay(0, 0), ignore_eos=False)
    assert record.error is None
    assert all("ignore_eos" not in s.body for s in fake.seen)


def test_baseline_map_reduce_sends_maps_concurrently_then_the_reduce(fake: FakeOpenAI) -> None:
    app = map_reduce_app(4)
    record = baseline(fake, app, Delay(0, 0))
    assert record.error is None
    assert len(fake.seen) == len(app.calls) == 5
    maps = {s.body["prompt"]: s for s in fake.seen[:4]}
    assert set(maps) == {f"Part: c{i}\nSummary:" for i in range(4)}
    assert fake.max_in_flight == 4  # all maps overlapped on the server
    reduce = fake.seen[4]
    assert reduce.start >= max(s.end for s in maps.values())
    parts = "\n".join(completion_of(f"Part: c{i}\nSummary:") for i in range(4))
    assert reduce.body["prompt"] == f"Summaries:\n{parts}\nFinal:"
    # the maps ran together: every map was sent before any map had answered (a sequential
    # client would start each only after the previous ended); no wall-clock bound, which a
    # loaded machine can break
    assert max(s.start for s in maps.values()) < min(s.end for s in maps.values())


def test_baseline_pays_one_delay_per_request(fake: FakeOpenAI) -> None:
    delay = Delay(50, 50)
    record = baseline(fake, chain_app(), delay)
    assert record.error is None
    assert delay.count == 3
    assert record.latency_s >= 3 * 0.050 + 3 * ANSWER_S
    # the delay is paid before sending: the first request left >= 50 ms after the app started
    assert record.calls[0].start_s - record.start_s >= 0.049


def test_baseline_error_is_recorded_not_raised(fake: FakeOpenAI) -> None:
    async def go():
        import httpx

        async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
            # nothing listens on the fake's /nope path prefix: 404 for every call
            return await run_baseline_app(
                client, fake.url + "/nope", "m", chain_app(), time.perf_counter(), Delay(0, 0)
            )

    record = asyncio.run(go())
    assert record.error is not None and "404" in record.error
    assert record.calls == []


def test_router_sends_to_the_fewest_in_flight_then_round_robin() -> None:
    router = Router(["a", "b", "c"])
    with router.pick() as first, router.pick() as second:
        assert (first, second) == ("a", "b")
        with router.pick() as third:
            assert third == "c"
        with router.pick() as fourth:  # c is free again: the only one with none in flight
            assert fourth == "c"
    picks = []
    for _ in range(4):  # all idle: round-robin from where it left off
        with router.pick() as url:
            picks.append(url)
    assert picks == ["a", "b", "c", "a"]
    assert router.sent == [3, 2, 3] and router.in_flight == [0, 0, 0]
    with pytest.raises(ValueError):
        Router([])


def test_baseline_spreads_requests_over_servers(fake: FakeOpenAI) -> None:
    app = map_reduce_app(4)
    workload = Workload("figX", "figX/servers", {"sweep": "x", "x": 1}, (app,))
    urls = [fake.url, fake.url + "/"]  # two names of one server, told apart by the router
    system = SystemHandle("fake", "openai", fake.url, "m", 2, backend="vllm", base_urls=urls)
    run = asyncio.run(run_workload(system, workload, repeat=0, delay_ms=(0, 0)))
    assert run.apps[0].error is None
    # the four maps went out together, two to each; the reduce went to the first again
    assert run.extra["requests_per_server"] == {urls[0]: 3, urls[1]: 2}
    assert {c.engine for c in run.apps[0].calls} == set(urls)


def test_delay_is_seeded_and_bounded() -> None:
    a, b = Delay(200, 300, seed=7), Delay(200, 300, seed=7)
    draws = [a.sample() for _ in range(100)]
    assert draws == [b.sample() for _ in range(100)]
    assert all(0.2 <= d <= 0.3 for d in draws)
    with pytest.raises(ValueError):
        Delay(300, 200)


def test_run_workload_honours_arrivals(fake: FakeOpenAI) -> None:
    apps = (chain_app("a", 0.0), chain_app("b", 0.3))
    workload = Workload("figX", "figX/test", {"sweep": "x", "x": 1}, apps)
    system = SystemHandle("fake", "openai", fake.url, "m", 1, backend="fastchat", ignore_eos=False)
    seen: list[str] = []
    run = asyncio.run(
        run_workload(system, workload, repeat=2, delay_ms=(0, 0), progress=lambda r: seen.append(r.app_id))
    )
    assert sorted(seen) == ["a", "b"]
    assert (run.system, run.workload, run.figure, run.repeat) == ("fake", "figX/test", "figX", 2)
    a, b = run.apps
    assert a.error is None and b.error is None
    assert b.start_s >= 0.3 and b.arrival_s == 0.3
    assert run.wall_s == pytest.approx(max(a.end_s, b.end_s))
    assert len(fake.seen) == 6
    assert run.extra["system"]["name"] == "fake" and "engine_metrics" not in run.extra


def test_an_isolated_run_runs_apps_one_at_a_time_each_on_its_own_clock(fake: FakeOpenAI) -> None:
    apps = (chain_app("late", 30.0), chain_app("early", 20.0), chain_app("first", 0.0))
    workload = Workload("figX", "figX/test", {"sweep": "x", "x": 1}, apps)
    system = SystemHandle("fake", "openai", fake.url, "m", 1, backend="fastchat", ignore_eos=False)
    started = time.perf_counter()
    run = asyncio.run(run_workload(system, workload, repeat=0, delay_ms=(0, 0), isolated=True))
    took = time.perf_counter() - started
    assert took < 10  # the 30 s arrival was not waited for
    assert fake.max_in_flight == 1  # no two requests, hence no two apps, ever overlapped
    assert [a.app_id for a in run.apps] == ["first", "early", "late"]  # arrival order
    for app in run.apps:
        assert app.error is None
        assert app.start_s == pytest.approx(app.arrival_s, abs=0.5)  # started at once, on its own clock
        assert 0 < app.end_s - app.arrival_s < took
    assert sum(a.end_s - a.arrival_s for a in run.apps) <= took
    assert run.extra["isolated"] is True and run.wall_s == pytest.approx(took, abs=1.0)


# ------------------------------------------------------------------ Parrot client
def _parrot_app() -> AppSpec:
    calls = (
        CallSpec("m0", "Part one: {{input:a}}. Summary:{{output:m0}}", 5, consts={"a": "red"}),
        CallSpec("m1", "Part two: {{input:b}}. Summary:{{output:m1}}", 6, consts={"b": "blue"}),
        CallSpec("r", "One: {{input:x}} Two: {{input:y}} Final:{{output:r}}", 7, deps={"x": "m0", "y": "m1"}),
    )
    app = AppSpec("p-0", "map_reduce", calls, ("m0", "r"))
    check_app(app)
    return app


_VAR_GET = re.compile(r"^/v1/sessions/[^/]+/variables/([^/]+)$")


def test_parrot_app_submits_the_whole_app_in_one_request_and_fetches_only_outputs(live) -> None:
    app = _parrot_app()
    delay = Delay(100, 100)
    before = len(live.requests)
    record = asyncio.run(run_parrot_app(live.url, app, time.perf_counter(), delay))
    assert record.error is None, record.error
    writes = [(m, p) for m, p in live.requests[before:] if m in ("POST", "PUT")]
    assert writes == [("POST", "/v1/sessions")]  # the session, constants, calls and values at once
    fetched = [m.group(1) for meth, p in live.requests[before:] if meth == "GET" and (m := _VAR_GET.match(p))]
    # r came back with the submission's answer; m1 flowed into r on the server, never to the
    # client; m0, an output r also reads, is not final, so the client reads it with a get
    assert len(fetched) == 1
    assert not any(p.endswith("/v1/completions") for _, p in live.requests)
    # one delay for the submission (which opened the session), one for the get of m0
    assert delay.count == record.delays == 2
    assert record.delay_s == pytest.approx(0.1 * record.delays)
    # records of every call from the session graph, with the engine's token counts
    assert [c.name for c in record.calls] == ["m0", "m1", "r"]
    assert [c.output_tokens for c in record.calls] == [5, 6, 7]  # ignore_eos: exactly max_tokens
    assert all(c.prompt_tokens and c.prompt_tokens > 0 for c in record.calls)
    engines = httpx.get(f"{live.url}/v1/engines", timeout=10).json()
    assert {c.engine for c in record.calls} == {engines[0]["engine_id"]}  # where each call ran
    # nothing ran before the submission's delay was over; the answers' delay came after the last call
    first_start = min(c.start_s for c in record.calls)
    assert first_start - record.start_s >= 0.09
    assert record.end_s - max(c.end_s for c in record.calls) >= 0.09
    # each call: ready (inputs there) <= placed <= first token <= finished; r waited for m0 and m1
    for c in record.calls:
        assert c.ready_s <= c.start_s <= c.first_token_s <= c.end_s
    by = {c.name: c for c in record.calls}
    # (a producer records its end after freeing its engine context, a moment after its value went on)
    assert by["r"].ready_s == pytest.approx(max(by["m0"].end_s, by["m1"].end_s), abs=0.05)


def test_parrot_call_times_stay_on_the_workload_clock_after_the_system_clock_steps(live, monkeypatch) -> None:
    """The manager stamps calls on its own clock, fixed against the system's when it
    started; after a step of the system clock (17 s here) the records still lie in
    the app's span: they are placed through the manager's time as it answered."""
    monkeypatch.setattr(clock, "_EPOCH_MINUS_MONOTONIC", clock._EPOCH_MINUS_MONOTONIC - 17.0)
    record = asyncio.run(run_parrot_app(live.url, _parrot_app(), time.perf_counter(), Delay(100, 100)))
    assert record.error is None, record.error
    assert min(c.ready_s for c in record.calls) - record.start_s >= 0.09  # after the submission's delay
    assert record.end_s - max(c.end_s for c in record.calls) >= 0.09  # before the answers' delay


def test_parrot_submit_bodies_carry_the_objective_on_final_outputs_only() -> None:
    from benchmarks.suite.clients import _semantic_function

    app = _parrot_app()
    bodies = {
        c.name: _semantic_function(c, "THROUGHPUT" if c.name in app.outputs else None).submit_body(
            {**c.consts, **{k: "v" for k in c.deps}}
        )
        for c in app.calls
    }
    for name, body in bodies.items():
        (out,) = [p for p in body["placeholders"] if p["direction"] == "output"]
        assert out["criteria"] == ("THROUGHPUT" if name in app.outputs else None)
        assert out["sampling"]["ignore_eos"] is True and out["sampling"]["temperature"] == 0.0
        assert body["chat"] is False and body["name"] == name


def test_parrot_app_failure_is_recorded(live) -> None:
    too_long = CallSpec("x", "{{input:doc}}{{output:x}}", 4, consts={"doc": "word " * 5000})
    app = AppSpec("bad", "chain", (too_long,), ("x",))
    record = asyncio.run(run_parrot_app(live.url, app, time.perf_counter(), Delay(0, 0)))
    assert record.error is not None
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    record = asyncio.run(run_parrot_app(dead, _parrot_app(), time.perf_counter(), Delay(0, 0)))
    assert record.error is not None and "ConnectionFailed" in record.error


@pytest.mark.parametrize("manager_config", [ManagerConfig(cluster_secret=OPERATOR_SECRET)])
def test_run_workload_on_parrot_samples_engine_metrics(live) -> None:
    """The counters come from the operator's view of the engines (the cluster secret)."""
    workload = Workload("figX", "figX/parrot", {"sweep": "x", "x": 1}, (_parrot_app(),))
    headers = {CLUSTER_SECRET_HEADER: OPERATOR_SECRET}
    system = SystemHandle("parrot", "parrot", live.url, "tiny", 1, operator_headers=headers)
    run = asyncio.run(run_workload(system, workload, repeat=0, delay_ms=(0, 0)))
    assert run.apps[0].error is None, run.apps[0].error
    metrics = run.extra["engine_metrics"]
    assert metrics["counters_delta"]["generated_tokens"] >= 5 + 6 + 7
    assert "kv_tokens_used" in metrics["peaks"]


# vLLM's /metrics as prometheus_client writes it (v0.10, trimmed): HELP and TYPE lines,
# counters with their _created series, a histogram, label values with spaces and escapes
VLLM_METRICS = r"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Smol LM \"2\""} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Smol LM \"2\""} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Smol LM \"2\""} 1200.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="Smol LM \"2\""} 1.7e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="Smol LM \"2\""} 3.0e+02
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Smol LM \"2\""} 1000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Smol LM \"2\""} 640.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="Smol LM \"2\""} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="Smol LM \"2\""} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Smol LM \"2\""} 5.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Smol LM \"2\""} 5.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Smol LM \"2\""} 0.9
"""


def test_vllm_metrics_are_read_with_prometheus_clients_parser_and_summed_over_servers(fake) -> None:
    fake.metrics = VLLM_METRICS
    system = SystemHandle("vllm", "openai", fake.url, "m", 2, backend="vllm", base_urls=[fake.url, fake.url])

    async def snap() -> dict[str, float] | None:
        async with httpx.AsyncClient(timeout=10) as client:
            return await _snapshot(client, system)

    assert asyncio.run(snap()) == {
        "vllm:num_requests_running": 6.0,
        "vllm:kv_cache_usage_perc": 0.5,
        "vllm:prompt_tokens_total": 2400.0,
        "vllm:generation_tokens_total": 600.0,
        "vllm:prefix_cache_queries_total": 2000.0,
        "vllm:prefix_cache_hits_total": 1280.0,
        "vllm:num_preemptions_total": 0.0,
    }
    fake.metrics = 'vllm:num_requests_running{engine="0" 3.0\n'  # cut off: not the format
    assert asyncio.run(snap()) is None  # a bad scrape is skipped, not half-read


# ------------------------------------------------------------------ command line
def test_schedule_interleaves_systems_per_repeat_within_each_layout() -> None:
    from benchmarks.suite.run import schedule

    one = Workload("f", "f/1", {}, (chain_app(),), engines=1)
    two = Workload("g", "g/2", {}, (chain_app(),), engines=2)
    turns = schedule(["parrot", "base", "vllm"], [[two, one], [two, one]])
    assert [(t.engines, t.repeat, t.system, [w.name for w in t.workloads]) for t in turns] == [
        (1, 0, "parrot", ["f/1"]),
        (1, 0, "base", ["f/1"]),
        (1, 0, "vllm", ["f/1"]),
        (1, 1, "base", ["f/1"]),  # rotated: repeat 1 starts with the second system
        (1, 1, "vllm", ["f/1"]),
        (1, 1, "parrot", ["f/1"]),
        (2, 0, "parrot", ["g/2"]),
        (2, 0, "base", ["g/2"]),
        (2, 0, "vllm", ["g/2"]),
        (2, 1, "base", ["g/2"]),
        (2, 1, "vllm", ["g/2"]),
        (2, 1, "parrot", ["g/2"]),
    ]


def test_fleet_stops_a_system_that_spins_while_idle(monkeypatch, tmp_path: Path) -> None:
    from benchmarks.suite import load, run

    stopped: list[str] = []

    class Started:
        def __init__(self, name: str):
            self.name = name

        def __enter__(self) -> SystemHandle:
            return SystemHandle(
                self.name, "openai", "http://x", "m", 1, pgids=[1 if self.name == "vllm" else 2]
            )

        def __exit__(self, *exc: object) -> None:
            stopped.append(self.name)

    monkeypatch.setattr(run, "start_system", lambda name, **kw: Started(name))
    monkeypatch.setattr(run, "_warm_up", lambda handle: None)
    monkeypatch.setattr(run.time, "sleep", lambda s: None)
    monkeypatch.setattr(run, "mem_available_gib", lambda: float("inf"))
    monkeypatch.setattr(load, "idle_cpu_share", lambda pgids, seconds: 0.5 if pgids == [1] else 0.0)
    header: dict = {"starts": [], "idle_cpu": {}}
    args = run._parser().parse_args([])
    fleet = run.Fleet(args, 1, tmp_path, header)
    for _ in range(2):
        for name in ("vllm", "parrot"):
            fleet.get(name)
            fleet.after_turn(name)
    assert stopped == ["vllm", "vllm"]  # stopped after each of its turns, measured once
    assert header["idle_cpu"] == {"vllm (engines 1)": [0.5], "parrot (engines 1)": [0.0, 0.0]}
    assert [s["system"] for s in header["starts"]] == ["vllm", "parrot", "vllm"]
    fleet.close()
    assert stopped == ["vllm", "vllm", "parrot"] and not fleet.up


def test_fleet_stops_the_cheapest_idle_system_when_memory_is_short(monkeypatch, tmp_path: Path) -> None:
    from benchmarks.suite import run

    stopped: list[str] = []

    class Started:
        def __init__(self, name: str):
            self.name = name

        def __enter__(self) -> SystemHandle:
            return SystemHandle(self.name, "openai", "http://x", "m", 1, pgids=[])

        def __exit__(self, *exc: object) -> None:
            stopped.append(self.name)

    # GiB available before the 2nd and 3rd start (each needs 2.5 + 2), and after a stop
    free = iter([20.0, 4.0, 20.0])
    monkeypatch.setattr(run, "mem_available_gib", lambda: next(free))
    monkeypatch.setattr(run, "start_system", lambda name, **kw: Started(name))
    monkeypatch.setattr(run, "_warm_up", lambda handle: None)
    header: dict = {"starts": [], "idle_cpu": {}}
    fleet = run.Fleet(run._parser().parse_args([]), 1, tmp_path, header)
    for name in ("vllm", "parrot", "parrot-baseline-latency"):
        fleet.get(name)
    # short before the third start: parrot (cheap to restart) goes, vLLM (minutes) stays up
    assert stopped == ["parrot"] and set(fleet.up) == {"vllm", "parrot-baseline-latency"}
    assert header["memory_stops"] == [{"system": "parrot", "engines": 1}]
    fleet.close()


def test_an_interrupted_run_stops_every_system(monkeypatch, tmp_path: Path) -> None:
    from benchmarks.suite import run

    stopped: list[str] = []

    class Started:
        def __init__(self, name: str):
            self.name = name

        def __enter__(self) -> SystemHandle:
            return SystemHandle(self.name, "openai", "http://x", "m", 1, pgids=[])

        def __exit__(self, *exc: object) -> None:
            stopped.append(self.name)

    turns: list[str] = []

    def turn(args, fleet, turn, raw, out, bar) -> None:
        fleet.get(turn.system)
        turns.append(turn.system)
        if len(turns) == 3:
            raise run._Terminated()  # SIGTERM arrives during the third turn

    monkeypatch.setattr(run, "start_system", lambda name, **kw: Started(name))
    monkeypatch.setattr(run, "_warm_up", lambda handle: None)
    monkeypatch.setattr(run, "run_turn", turn)
    monkeypatch.setattr(run.load, "idle_cpu_share", lambda pgids, seconds: 0.0)
    monkeypatch.setattr(run.time, "sleep", lambda s: None)
    monkeypatch.setattr(run, "mem_available_gib", lambda: float("inf"))
    args = run._parser().parse_args(["--systems", "parrot", "vllm", "--repeats", "2", "--no-plots"])
    one = Workload("f", "f/1", {}, (chain_app(),), engines=1)
    header = {"starts": [], "idle_cpu": {}, "failures": []}
    with pytest.raises(run._Terminated):
        run.run_suite(args, type("W", (), {"generate": lambda *a, **kw: [one]}), [one], header, tmp_path)
    assert turns == ["parrot", "vllm", "vllm"]
    assert sorted(stopped) == ["parrot", "vllm"]  # both were up, both stopped
    assert header["failures"] == []  # an interruption is not a system's failure


def test_a_resumed_run_runs_only_what_the_interrupted_one_lacks(monkeypatch, tmp_path: Path) -> None:
    from benchmarks.suite import run

    started: list[str] = []

    class Started:
        def __init__(self, name: str):
            self.name = name

        def __enter__(self) -> SystemHandle:
            started.append(self.name)
            return SystemHandle(self.name, "openai", "http://x", "m", 1, pgids=[])

        def __exit__(self, *exc: object) -> None:
            pass

    ran: list[tuple[str, str, int]] = []

    async def fake_run(handle, workload, *, repeat, **kw) -> RunRecord:
        ran.append((handle.name, workload.name, repeat))
        return RunRecord(handle.name, workload.name, workload.figure, dict(workload.params), repeat, 1.0, [])

    monkeypatch.setattr(run, "start_system", lambda name, **kw: Started(name))
    monkeypatch.setattr(run, "_warm_up", lambda handle: None)
    monkeypatch.setattr(run, "run_workload", fake_run)
    monkeypatch.setattr(run, "_over_bound", lambda record, bound: record.params["x"] >= 2)
    monkeypatch.setattr(run.load, "idle_cpu_share", lambda pgids, seconds: 0.0)
    monkeypatch.setattr(run.time, "sleep", lambda s: None)
    monkeypatch.setattr(run, "mem_available_gib", lambda: float("inf"))
    fig11 = Workload("fig11", "fig11/a", {}, (chain_app(),), engines=1)
    rates = [Workload("fig17", f"fig17/rate={x}", {"x": x}, (chain_app(),), engines=1) for x in (1, 2, 4)]
    workloads = [fig11, *rates]
    args = run._parser().parse_args(["--systems", "parrot", "vllm", "--repeats", "2", "--no-plots"])

    def record(system: str, workload: Workload, repeat: int, **extra: Any) -> dict[str, Any]:
        return {
            "system": system,
            "workload": workload.name,
            "figure": workload.figure,
            "repeat": repeat,
            "params": dict(workload.params),
            "wall_s": 1.0,
            "apps": [],
            "extra": extra,
        }

    # the interrupted run: repeat 0 done (vLLM stopped raising its rate at 2), repeat 1 only vLLM's fig11
    kept = [
        record("parrot", fig11, 0),
        record("parrot", rates[0], 0),
        record("parrot", rates[1], 0),
        record("vllm", fig11, 0),
        record("vllm", rates[0], 0),
        record("vllm", rates[1], 0, fig17_stop="over"),
        record("vllm", fig11, 1),
    ]
    kept[2]["extra"]["fig17_stop"] = "over"
    header = {"starts": [], "idle_cpu": {}, "failures": []}
    generator = type("W", (), {"generate": lambda *a, **kw: workloads})
    run.run_suite(args, generator, workloads, header, tmp_path, raw=list(kept))

    assert ran == [
        ("vllm", "fig17/rate=1", 1),
        ("vllm", "fig17/rate=2", 1),
        ("parrot", "fig11/a", 1),
        ("parrot", "fig17/rate=1", 1),
        ("parrot", "fig17/rate=2", 1),
    ]
    assert started == ["vllm", "parrot"]  # repeat 0 is complete: nobody started for it
    saved = json.loads((tmp_path / "raw.json").read_text())
    assert saved[: len(kept)] == kept and len(saved) == len(kept) + len(ran)


def test_resume_refuses_a_run_with_other_arguments_and_hands_on_the_kept_records(
    monkeypatch, tmp_path: Path
) -> None:
    from benchmarks.suite import run

    measure = run.load_now  # the header's load over 50 ms, not 2 s: this test reads none of it
    monkeypatch.setattr(run, "load_now", lambda: measure(0.05))
    args = run._parser().parse_args(["--systems", "parrot", "--figures", "fig11", "--out", str(tmp_path)])
    fresh = run.collect_header(args) | {"load_before": {}}
    (tmp_path / "header.json").write_text(json.dumps(fresh | {"scale": 0.5, "interrupted_at": "t"}))
    (tmp_path / "raw.json").write_text("[]")
    with pytest.raises(ValueError, match=re.escape("scale 0.5 there, 1.0 now")):
        run.resumed(tmp_path, fresh)
    (tmp_path / "header.json").write_text(json.dumps(fresh | {"isolated": True, "interrupted_at": "t"}))
    with pytest.raises(ValueError, match=re.escape("isolated True there, False now")):
        run.resumed(tmp_path, fresh)  # apps alone are not apps under load
    before_isolated = {k: v for k, v in fresh.items() if k != "isolated"}  # a run from before the option
    (tmp_path / "header.json").write_text(json.dumps(before_isolated | {"interrupted_at": "t"}))
    assert run.resumed(tmp_path, fresh)[0]["resumed"][0]["records_kept"] == 0
    (tmp_path / "header.json").write_text(json.dumps(fresh | {"interrupted_at": "t"}))
    (tmp_path / "raw.json").write_text('[{"system": "parrot"}]')
    with pytest.raises(ValueError, match="not what the suite writes"):
        run.resumed(tmp_path, fresh)
    (tmp_path / "raw.json").write_text("[]")
    header, raw = run.resumed(tmp_path, fresh)
    assert raw == [] and "interrupted_at" not in header and header["resumed"][0]["records_kept"] == 0
    handed: list[Any] = []
    monkeypatch.setattr(run, "run_suite", lambda *a: handed.append(a))
    (tmp_path / "raw.json").write_text(json.dumps([{"system": "parrot", "workload": "w", "repeat": 0}]))
    argv = ["--systems", "parrot", "--figures", "fig11", "--out", str(tmp_path), "--resume", "--no-plots"]
    assert run.main(argv) == 0
    assert handed[0][-1] == [{"system": "parrot", "workload": "w", "repeat": 0}]  # kept, handed to the run
    proc = _suite("--resume", "--figures", "fig11", "--systems", "parrot")
    assert proc.returncode == 2 and "--resume needs --out DIR" in proc.stderr
    missing = tmp_path / "none"
    proc = _suite("--resume", "--out", str(missing), "--figures", "fig11", "--systems", "parrot")
    assert proc.returncode == 2 and "cannot resume" in proc.stderr and not missing.exists()


def _suite(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.suite", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dry_run_prints_the_plan() -> None:
    proc = _suite("--figures", "fig11", "--systems", "parrot", "vllm", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "fig11/" in out and "machine" in out and "dtype float32" in out
    turns = re.findall(r"^\s+([+ ]) engines (\d)\s+repeat (\d)\s+(\S+)", out, re.M)
    assert turns == [
        ("+", "1", "0", "parrot"),
        ("+", "1", "0", "vllm"),
        (" ", "1", "1", "vllm"),
        (" ", "1", "1", "parrot"),
        (" ", "1", "2", "parrot"),
        (" ", "1", "2", "vllm"),
    ]
    assert re.search(r"estimated \d+\.\d h of wall time", out)


@pytest.mark.parametrize(
    ("args", "name"),
    [(("--figures", "fig99"), "fig99"), (("--systems", "parrot", "nosuch"), "nosuch")],
)
def test_unknown_names_exit_2(args: tuple[str, ...], name: str) -> None:
    proc = _suite(*args, "--dry-run")
    assert proc.returncode == 2
    assert f"unknown {'figure' if 'fig' in name else 'system'}(s): {name}" in proc.stderr
    assert "known:" in proc.stderr


def test_parrot_system_commands_split_the_cores_and_pass_dtype_flags_and_cap() -> None:
    from benchmarks.suite.systems import parrot_commands

    serve, engines = parrot_commands("parrot", Path("/m"), 1, 9100, 2)
    assert engines == []
    assert serve[serve.index("--model") :] == [
        "--model", "/m", "--weight-dtype", "float32", "--kv-dtype", "float32", "--threads", "2"
    ]  # fmt: skip
    assert "--latency-cap" not in serve and "--no-engine" not in serve
    serve, engines = parrot_commands(
        "no-affinity",
        Path("/m"),
        2,
        9100,
        2,
        latency_cap=2048,
        dtype="bfloat16",
        serve_flags=("--no-app-fifo",),
        engine_flags=("--no-prefix-cache",),
    )
    assert serve[-1] == "--no-engine" and serve[serve.index("--latency-cap") + 1] == "2048"
    assert serve[serve.index("--policy") + 1] == "no-affinity" and "--no-app-fifo" in serve
    assert "--no-prefix-cache" not in serve  # an engine flag; this manager has no engine of its own
    assert len(engines) == 2 and all(e[e.index("--threads") + 1] == "1" for e in engines)
    assert all(e[e.index("--manager") + 1] == "http://127.0.0.1:9100" for e in engines)
    for e in engines:
        assert e[e.index("--weight-dtype") + 1] == e[e.index("--kv-dtype") + 1] == "bfloat16"
        assert "--no-prefix-cache" in e and "--no-app-fifo" not in e
    serve, _ = parrot_commands("parrot", Path("/m"), 1, 9100, 2, engine_flags=("--no-prefix-cache",))
    assert "--no-prefix-cache" in serve  # the embedded engine takes it on `parrot serve`
    with pytest.raises(ValueError, match="dtype"):
        parrot_commands("parrot", Path("/m"), 1, 9100, 2, dtype="float16")
    # --step-log: every engine of the layout logs its steps to its own file
    from parrot.cli import _parser

    serve, _ = parrot_commands("parrot", Path("/m"), 1, 9100, 2, step_log_dir=Path("/logs/p"))
    assert serve[serve.index("--step-log") + 1] == "/logs/p/steps-embedded.jsonl"
    assert _parser().parse_args(serve[3:]).step_log == "/logs/p/steps-embedded.jsonl"
    serve, engines = parrot_commands("parrot", Path("/m"), 2, 9100, 2, step_log_dir=Path("/logs/p"))
    assert "--step-log" not in serve
    assert [e[e.index("--step-log") + 1] for e in engines] == [
        "/logs/p/steps-engine-0.jsonl",
        "/logs/p/steps-engine-1.jsonl",
    ]


def test_systems_change_one_mechanism_each_and_only_the_apc_baselines_keep_a_prefix_cache() -> None:
    from benchmarks.suite.systems import SYSTEMS

    parrot = SYSTEMS["parrot"]
    assert not parrot.ablation and parrot.policy == "parrot"
    assert not parrot.serve_flags and not parrot.engine_flags
    ablations = {name: spec for name, spec in SYSTEMS.items() if spec.ablation}
    assert set(ablations) == {
        "parrot-no-app-fifo",
        "parrot-no-deduction",
        "parrot-no-affinity",
        "parrot-no-prefix-cache",
        "parrot-affinity-spill",
        "parrot-latency-batching",
        "parrot-paper-cap",
        "parrot-program-scheduling",
        "parrot-no-early-prefill",
    }
    changes = {name: (spec.policy, spec.serve_flags, spec.engine_flags) for name, spec in ablations.items()}
    assert changes == {
        "parrot-no-app-fifo": ("parrot", ("--no-app-fifo",), ()),
        "parrot-program-scheduling": ("parrot", ("--program-scheduling",), ()),
        "parrot-no-early-prefill": ("parrot", ("--no-early-prefill",), ()),
        "parrot-no-deduction": ("no-deduction", (), ()),
        "parrot-no-affinity": ("no-affinity", (), ()),
        "parrot-no-prefix-cache": ("parrot", (), ("--no-prefix-cache",)),
        "parrot-affinity-spill": ("parrot", ("--affinity-spill",), ()),
        "parrot-latency-batching": ("parrot", ("--latency-cap-scope", "mixed"), ()),
        "parrot-paper-cap": ("parrot", ("--no-saturation-batching",), ()),
    }
    for name in ("parrot-baseline-latency", "parrot-baseline-throughput"):
        spec = SYSTEMS[name]
        assert spec.kind == "openai" and spec.engine_flags == ("--no-prefix-cache",)
    assert SYSTEMS["vllm"].engine_flags == ()
    apc = SYSTEMS["parrot-baseline-apc"]  # the request-level client with vLLM's prefix caching
    assert apc.kind == "openai" and apc.backend == "parrot" and apc.engine_flags == ()
    assert apc.policy == SYSTEMS["parrot-baseline-latency"].policy and not apc.ablation
    admits_all = SYSTEMS["parrot-baseline-throughput-apc"]  # schedules as vLLM does, prefix cache on
    assert admits_all.kind == "openai" and admits_all.engine_flags == () and not admits_all.ablation
    assert admits_all.policy == SYSTEMS["parrot-baseline-throughput"].policy
    priority = SYSTEMS["parrot-vllm-priority"]  # a way to drive vLLM, not a mechanism switched off
    assert not priority.ablation and priority.serve_flags == ("--backend-priority",)
    assert priority.peer_flags == ("--scheduling-policy", "priority") and not SYSTEMS["vllm"].peer_flags


def test_every_flag_of_the_systems_exists_in_the_cli() -> None:
    """The ablations and baselines switch mechanisms off with real options of ``parrot``."""
    from benchmarks.suite.systems import SYSTEMS

    from parrot.cli import _parser

    for spec in SYSTEMS.values():
        if spec.backend != "parrot":
            if spec.kind == "parrot" and spec.serve_flags:  # Parrot over peers: options of serve --backend
                args = ["serve", "--backend", spec.backend, "--backend-url", "x", *spec.serve_flags]
                assert _parser().parse_args(args) is not None
            continue
        if spec.serve_flags:
            assert _parser().parse_args(["serve", *spec.serve_flags]) is not None
        for flag in spec.engine_flags:
            for sub in (["serve"], ["engine", "--manager", "http://127.0.0.1:1"]):
                assert _parser().parse_args([*sub, flag]) is not None


def test_vllm_servers_each_get_their_own_cores() -> None:
    from benchmarks.peers import start_command
    from benchmarks.suite.systems import vllm_layout

    assert vllm_layout(1, 2) == ["0-1"]
    assert vllm_layout(2, 2) == ["0", "1"]
    assert vllm_layout(2, 8) == ["0-3", "4-7"]
    assert vllm_layout(4, 2) == ["0", "1", "0", "1"]  # more servers than cores: shared, in turn
    with pytest.raises(ValueError):
        vllm_layout(0, 2)
    cmd = start_command("vllm", "/m", 8101, prefix_caching=True, threads="1", dtype="bfloat16", timeout=60)
    assert cmd[cmd.index("--port") + 1] == "8101" and "--prefix-caching" in cmd
    assert cmd[cmd.index("--threads") + 1] == "1" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    with pytest.raises(ValueError, match="vLLM options"):
        start_command("fastchat", "/m", 8200, dtype="bfloat16")


def test_parrot_client_lets_nothing_run_before_the_whole_dag_is_submitted(live) -> None:
    from benchmarks.suite.clients import _submit_app

    import parrot as P

    maps = [
        CallSpec(f"m{i}", f"Part {i}: {{{{input:t}}}}. Summary:{{{{output:m{i}}}}}", 4, consts={"t": "x"})
        for i in range(3)
    ]
    reduce = CallSpec(
        "r",
        "All: {{input:a}} {{input:b}} {{input:c}} =>{{output:r}}",
        4,
        deps={"a": "m0", "b": "m1", "c": "m2"},
    )
    app = AppSpec("dag-0", "map_reduce", (*maps, reduce), ("r",))

    async def run() -> tuple[str, list[dict]]:
        async with P.aconnect(live.url) as session:
            outs = await _submit_app(session, app)
            assert all(var.id for var in outs.values())
            await outs["r"].aget(P.LATENCY, timeout=60)
            headers = {"Authorization": f"Bearer {session.token}"}
            url = f"{live.url}/v1/sessions/{session.session_id}/graph"
            return str(session.session_id), httpx.get(url, headers=headers, timeout=10).json()["calls"]

    sid, after = asyncio.run(run())
    writes = [
        (m, p) for m, p in live.requests if m in ("POST", "PUT") and p.startswith(f"/v1/sessions/{sid}/")
    ]
    assert writes == [("POST", f"/v1/sessions/{sid}/batch")]
    assert len(after) == 4
    # no call was placed before the last one was on the server ...
    assert min(c["dispatched_at"] for c in after) >= max(c["submitted_at"] for c in after)
    # ... and the first round already deduced objectives over the whole DAG
    objectives = {c["name"]: (c["objective"], c["task_group"]) for c in after}
    assert objectives["r"] == ("latency", None)
    assert {objectives[f"m{i}"] for i in range(3)} == {
        ("throughput", f"tg:{next(c['call_id'] for c in after if c['name'] == 'r')}")
    }


def test_parrot_vllm_puts_parrots_manager_in_front_of_the_peer_servers(live, monkeypatch, tmp_path) -> None:
    """``parrot-vllm``: the peers start as for the ``vllm`` baseline (here a real Parrot
    server stands in for them, spoken to in the plain OpenAI dialect), then ``parrot
    serve --backend`` registers each as an engine; the client talks to that manager,
    the sampler to the peers; everything it started stops with it."""
    from benchmarks.suite import systems

    spec = systems.SYSTEMS["parrot-vllm"]
    assert spec.kind == "parrot" and spec.backend == "vllm" and not spec.ablation
    cmd = systems.parrot_backend_command(
        "parrot", Path("/m/smollm2"), "vllm", ["http://a:1", "http://b:2"], 9400
    )
    joined = " ".join(cmd)
    assert "--backend vllm --backend-tokenizer /m/smollm2" in joined
    assert "--backend-url http://a:1 --backend-url http://b:2" in joined and "--latency-cap" not in joined
    from parrot.cli import _parser

    assert _parser().parse_args(cmd[3:]).backend_url == ["http://a:1", "http://b:2"]

    @contextlib.contextmanager
    def stand_in(name, spec, model_path, engines, log_dir, timeout_s, dtype="float32"):
        yield SystemHandle(name, spec.kind, live.url, "tiny", 1, backend="vllm", pgids=[], notes=["peer"])

    monkeypatch.setattr(systems, "_peer_system", stand_in)
    openai_spec = systems.SystemSpec("parrot", "openai", "parrot", "over a stand-in")
    with systems._parrot_over_peers("parrot-x", openai_spec, Path("tiny"), 1, tmp_path, 60) as handle:
        assert handle.kind == "parrot" and handle.base_urls == [live.url] and handle.base_url != live.url
        engines = httpx.get(f"{handle.base_url}/v1/engines", timeout=10).json()
        assert [e["alive"] for e in engines] == [True]
        record = asyncio.run(run_parrot_app(handle.base_url, _parrot_app(), time.perf_counter(), Delay(0, 0)))
        assert record.error is None, record.error
        # (the plain dialect returns text, which the manager counts by encoding it again)
        assert [c.name for c in record.calls] == ["m0", "m1", "r"]
        assert all(c.output_tokens and c.output_tokens > 0 for c in record.calls)
        manager_pid = handle.pgids[-1]
    with pytest.raises(ProcessLookupError):
        os.kill(manager_pid, 0)


def test_a_kv_pool_size_goes_to_parrots_engines_only() -> None:
    from benchmarks.suite.systems import SYSTEMS, with_kv_pool

    sized = with_kv_pool(SYSTEMS["parrot-no-prefix-cache"], 8192)
    assert sized.engine_flags == ("--no-prefix-cache", "--kv-cache-tokens", "8192")
    assert with_kv_pool(SYSTEMS["vllm"], 8192) == SYSTEMS["vllm"]
    assert with_kv_pool(SYSTEMS["parrot"], None) == SYSTEMS["parrot"]
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="kv_cache_tokens"):
            with_kv_pool(SYSTEMS["parrot"], bad)


def test_a_kv_pool_below_one_token_exits_2() -> None:
    proc = _suite("--figures", "agents_load", "--systems", "parrot", "--kv-cache-tokens", "0", "--dry-run")
    assert proc.returncode == 2 and "--kv-cache-tokens must be >= 1" in proc.stderr

"""End to end: the client library against a real manager HTTP server on
loopback, with the tiny seeded engine embedded."""

from __future__ import annotations

import asyncio
import re
import time

import httpx

import parrot as P


def tok(n: int = 6, **kw) -> P.Output:
    return P.Output(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@P.semantic_function
def step1(topic: P.Input, draft: tok()):
    """Write about {{topic}}: {{draft}}"""


@P.semantic_function
def step2(draft: P.Input, better: tok()):
    """Improve this: {{draft}} -> {{better}}"""


@P.semantic_function
def step3(better: P.Input, final: tok()):
    """Conclude: {{better}} => {{final}}"""


def var_paths(requests, var_ids):
    return [(m, p) for m, p in requests if any(v in p for v in var_ids)]


def test_three_step_chain_runs_server_side(live):
    with P.connect(live.url) as s:
        a = step1("lighthouses")
        b = step2(a)
        c = step3(b)
        final = c.get(P.LATENCY, timeout=60)
        sid = s.session_id
    calls = [r for r in live.requests if r == ("POST", f"/v1/sessions/{sid}/calls")]
    assert len(calls) == 3  # one submit per call
    assert var_paths(live.requests, [a.id, b.id]) == []  # intermediates never travel to the client
    gets = var_paths(live.requests, [c.id])
    assert gets == [("GET", f"/v1/sessions/{sid}/variables/{c.id}")]  # one (long-poll) get
    assert set(live.requests) <= {
        ("POST", "/v1/sessions"),
        ("POST", f"/v1/sessions/{sid}/calls"),
        ("GET", f"/v1/sessions/{sid}/variables/{c.id}"),
        ("DELETE", f"/v1/sessions/{sid}"),
    }
    assert isinstance(final, str) and final


def test_server_side_values_equal_client_side_orchestration(live):
    """The value the manager passes downstream is exactly the upstream output:
    the same chain orchestrated client-side (fetching each value and sending it
    back as a constant) produces the same final output with greedy sampling."""
    with P.connect(live.url):
        server_side = step3(step2(step1("ships"))).get(timeout=60)
    with P.connect(live.url):
        a = step1("ships").get(timeout=60)
        b = step2(a).get(timeout=60)
        client_side = step3(b).get(timeout=60)
    assert server_side == client_side


def test_async_session_submits_everything_before_waiting(live):
    async def app():
        async with P.aconnect(live.url) as s:
            outs = [step2(step1(f"topic {i}")) for i in range(3)]
            values = await asyncio.gather(*(o.aget(P.THROUGHPUT, timeout=60) for o in outs))
            return s.session_id, values

    sid, values = asyncio.run(app())
    assert len(values) == 3 and all(isinstance(v, str) for v in values)
    assert sum(1 for r in live.requests if r == ("POST", f"/v1/sessions/{sid}/calls")) == 6


def test_transform_is_applied_server_side_before_the_value_flows(live):
    raw_fn = P.template_function("Say {{input:x}}: {{output:y}}", y=tok(8))
    first_char = P.template_function(
        "Say {{input:x}}: {{output:y}}", y=tok(8, transform=P.transforms.regex(r"(?s)(.)"))
    )
    echo = P.template_function("Echo {{input:v}} {{output:w}}", w=tok(4))
    with P.connect(live.url):
        raw = raw_fn("hello").get(timeout=60)
        v = first_char("hello")
        downstream = echo(v).get(timeout=60)
        transformed = v.get(timeout=60)
    with P.connect(live.url):
        expected_downstream = echo(raw[0]).get(timeout=60)
    assert transformed == re.search(r"(?s)(.)", raw).group(1)
    assert downstream == expected_downstream


def test_template_with_two_outputs_generates_in_order(live):
    fn = P.template_function("Q: {{input:q}} A: {{output:a}} Then: {{output:b}}", a=tok(5), b=tok(5))
    with P.connect(live.url):
        a, b = fn("why")
        va, vb = a.get(timeout=60), b.get(timeout=60)
    assert isinstance(va, str) and isinstance(vb, str)


def test_variables_created_and_set_by_the_client_feed_calls(live):
    with P.connect(live.url) as s:
        x = s.variable(name="topic")
        out = step1(x)  # submitted before the input exists
        x.set("the sea")
        later = out.get(timeout=60)
    with P.connect(live.url):
        direct = step1("the sea").get(timeout=60)
    assert later == direct


def test_stream_yields_the_generation_as_it_happens(live):
    fn = P.template_function("Tell {{input:x}} {{output:y}}", y=tok(12))
    with P.connect(live.url):
        y = fn("a story")
        pieces = list(y.stream(timeout=60))
        final = y.get(timeout=60)
    assert "".join(pieces) == final


def test_graph_introspection_shows_calls_and_engine(live):
    with P.connect(live.url) as s:
        c = step2(step1("x"))
        c.get(timeout=60)
        graph = httpx.get(
            f"{live.url}/v1/sessions/{s.session_id}/graph",
            headers={"Authorization": f"Bearer {s.token}"},
        ).json()
    states = sorted(call["state"] for call in graph["calls"])
    assert states == ["done", "done"]
    assert all(call["engine_id"] for call in graph["calls"])
    assert all(call["prompt_tokens"] > 0 and call["generated_tokens"] == 6 for call in graph["calls"])


def test_contexts_are_freed_when_calls_finish(live, tiny_engine):
    before = live.run_on_loop(tiny_engine.stats()).num_contexts
    with P.connect(live.url):
        step3(step2(step1("z"))).get(timeout=60)
    deadline = time.monotonic() + 10  # freeing follows the value by a moment
    while True:
        after = live.run_on_loop(tiny_engine.stats())
        if (after.num_contexts, after.num_running) == (before, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert after.num_contexts == before
    assert after.num_running == 0


def test_openapi_schema_is_published(live):
    schema = httpx.get(f"{live.url}/openapi.json").json()
    paths = schema["paths"]
    for path in (
        "/v1/sessions",
        "/v1/sessions/{session_id}/calls",
        "/v1/sessions/{session_id}/variables/{var_id}",
        "/v1/sessions/{session_id}/variables/{var_id}/stream",
        "/v1/engines",
    ):
        assert path in paths


def test_template_without_output_is_rejected(live):
    with P.connect(live.url) as s:
        resp = httpx.post(
            f"{live.url}/v1/sessions/{s.session_id}/calls",
            headers={"Authorization": f"Bearer {s.token}"},
            json={"template": "just text {{input:x}}", "placeholders": [{"name": "x", "value": "1"}]},
        )
        graph = httpx.get(
            f"{live.url}/v1/sessions/{s.session_id}/graph", headers={"Authorization": f"Bearer {s.token}"}
        ).json()
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_template"
    assert "no output" in resp.json()["error"]["message"]
    assert graph == {"calls": [], "variables": []}


def test_multibyte_value_over_the_context_is_rejected(live, tiny_engine):
    """Fewer characters than the context, but more tokens (byte-level: 'é' is two)."""
    n = tiny_engine.max_seq_len * 3 // 4
    with P.connect(live.url) as s:
        try:
            s.variable(value="é" * n)
        except P.ContextTooLong as exc:
            assert exc.detail["tokens"] == 2 * n
        else:
            raise AssertionError("a value longer than the context was accepted")
        assert step1("ok").get(timeout=60)  # the session still works


def test_a_call_reads_done_as_soon_as_its_value_is_ready(tiny_engine):
    """The call is marked done when its last output is set, before the manager frees its
    engine context (an await): a client that reads the value and then the call (or the
    session's graph) never sees the producer still running.  Served without Nagle's
    delay, as ``parrot serve`` is, so the second request comes right after the first."""
    from parrot.manager.api.app import create_app
    from parrot.manager.service import Manager
    from tests.conftest import LiveServer, serve_asgi

    manager = Manager()
    manager.pool.register(tiny_engine, name="tiny")
    live = serve_asgi(create_app(manager), LiveServer(url="", manager=manager), nodelay=True)
    try:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            created = http.post("/v1/sessions").json()
            path = f"/v1/sessions/{created['session_id']}"
            auth = {"Authorization": f"Bearer {created['token']}"}
            seen = []
            for i in range(20):
                body = {
                    "template": "Q {{input:x}} A:{{output:y}}",
                    "placeholders": [
                        {"name": "x", "value": str(i)},
                        {"name": "y", "sampling": {"max_tokens": 1, "ignore_eos": True}},
                    ],
                }
                ids = http.post(f"{path}/calls", json=body, headers=auth).json()
                var = http.get(f"{path}/variables/{ids['outputs']['y']}", params={"wait": 30}, headers=auth)
                assert var.json()["state"] == "ready"
                seen.append(http.get(f"{path}/calls/{ids['call_id']}", headers=auth).json()["state"])
        assert seen == ["done"] * 20, seen
    finally:
        live.stop()

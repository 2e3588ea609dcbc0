"""``POST /v1/sessions/{sid}/batch`` and ``session.batch()`` against the real
manager HTTP server (``live``: loopback uvicorn, tiny seeded engine embedded).

A batch is applied all or none: every rejected batch below leaves its session
exactly as it was (same graph, same values, no edge left on an earlier
variable), names the op at fault, never reaches the engine, and disturbs no
other session (the bystander from ``test_api_errors`` completes afterwards).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

import parrot as P
from parrot.protocol.schemas import MAX_BATCH_OPS
from tests.api_client import (
    STALL_LIMIT_S,
    WAIT,
    Bystander,
    Raw,
    engine_work,
    expect_error,
    healthz_stalls,
    inp,
    out,
)
from tests.conftest import LiveServer

T1 = "Q: {{input:x}} A: {{output:y}}"


# ------------------------------------------------------------------ ops
def create(ref: str | None = None, value: str | None = None, name: str | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"op": "create_variable"}
    for key, v in (("ref", ref), ("value", value), ("name", name)):
        if v is not None:
            op[key] = v
    return op


def call(template: str, *placeholders: dict[str, Any]) -> dict[str, Any]:
    return {"op": "submit_call", "template": template, "placeholders": list(placeholders)}


def put(value: str, ref: str | None = None, var_id: str | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"op": "set_variable", "value": value}
    if ref is not None:
        op["ref"] = ref
    if var_id is not None:
        op["var_id"] = var_id
    return op


def use(name: str, ref: str) -> dict[str, Any]:
    """An input binding naming a variable by its batch ref."""
    return {"name": name, "direction": "input", "ref": ref}


def send(raw: Raw, ops: list[Any]) -> httpx.Response:
    return raw.http.post(f"{raw.path}/batch", json={"ops": ops}, headers=raw.auth)


CHAIN = [
    create("topic", name="topic"),
    call("Topic: {{input:topic}}\nIdea: {{output:idea}}", use("topic", "topic"), out("idea", define_ref="i")),
    call("Idea: {{input:idea}}\nCritique: {{output:crit}}", use("idea", "i"), out("crit", define_ref="c")),
    call("Both: {{input:a}} / {{input:b}} =>{{output:end}}", use("a", "i"), use("b", "c"), out("end")),
    put("parrots", ref="topic"),
]


# ------------------------------------------------------------------ a good batch
def test_a_chain_in_one_batch_runs_server_side_like_separate_requests(live, raw: Raw) -> None:
    resp = send(raw, CHAIN)
    assert resp.status_code == 200, resp.text
    result = resp.json()
    refs = result["refs"]
    assert set(refs) == {"topic", "i", "c"}
    assert [r["op"] for r in result["results"]] == [op["op"] for op in CHAIN]
    created, first, second, third, setting = result["results"]
    assert created["var_id"] == setting["var_id"] == refs["topic"]
    assert first["outputs"] == {"idea": refs["i"]} and second["outputs"] == {"crit": refs["c"]}
    end = third["outputs"]["end"]
    values = [raw.value(v) for v in (refs["i"], refs["c"], end)]

    graph = raw.graph()
    calls = {c["call_id"]: c for c in graph["calls"]}
    assert list(calls) == [first["call_id"], second["call_id"], third["call_id"]]
    assert [(c["state"], c["generated_tokens"]) for c in calls.values()] == [("done", 4)] * 3
    assert calls[second["call_id"]]["inputs"] == {"idea": refs["i"]}
    assert calls[third["call_id"]]["inputs"] == {"a": refs["i"], "b": refs["c"]}
    assert [v["var_id"] for v in graph["variables"]] == [refs["topic"], refs["i"], refs["c"], end]

    # the same chain as separate requests (greedy): the same values
    seq = Raw(live)
    try:
        topic = seq.var(name="topic")
        idea = seq.call(CHAIN[1]["template"], [inp("topic", topic), out("idea")])["outputs"]["idea"]
        crit = seq.call(CHAIN[2]["template"], [inp("idea", idea), out("crit")])["outputs"]["crit"]
        end_seq = seq.call(CHAIN[3]["template"], [inp("a", idea), inp("b", crit), out("end")])["outputs"][
            "end"
        ]
        seq.set(topic, "parrots")
        assert [seq.value(v) for v in (idea, crit, end_seq)] == values
    finally:
        seq.close()


def test_the_scheduler_deduces_objectives_over_the_whole_batch(raw: Raw) -> None:
    """Maps with constant inputs are ready at once, yet their first scheduling
    round already knows the reduce they feed (throughput, its task group)."""
    maps = [
        call(
            f"Part {i}: {{{{input:t}}}} =>{{{{output:m}}}}",
            inp("t", value=f"c{i}"),
            out("m", define_ref=f"m{i}"),
        )
        for i in range(3)
    ]
    reduce = call(
        "All: {{input:a}} {{input:b}} {{input:c}} =>{{output:r}}",
        use("a", "m0"),
        use("b", "m1"),
        use("c", "m2"),
        out("r", criteria="LATENCY"),
    )
    resp = send(raw, [*maps, reduce])
    assert resp.status_code == 200, resp.text
    r_call = resp.json()["results"][-1]
    raw.value(r_call["outputs"]["r"])
    graph = {c["call_id"]: c for c in raw.graph()["calls"]}
    assert (graph[r_call["call_id"]]["objective"], graph[r_call["call_id"]]["task_group"]) == (
        "latency",
        None,
    )
    map_ids = [r["call_id"] for r in resp.json()["results"][:3]]
    assert {(graph[c]["objective"], graph[c]["task_group"]) for c in map_ids} == {
        ("throughput", f"tg:{r_call['call_id']}")
    }


# ------------------------------------------------------------------ the client
FIRST, SECOND = Bystander.FIRST, Bystander.SECOND
BOTH = P.template_function(
    "Both: {{input:a}} / {{input:b}} =>{{output:end}}", end=P.Output(max_tokens=4, ignore_eos=True)
)


def _session_writes(live, sid: str) -> list[tuple[str, str]]:
    """Requests that create or change anything in session ``sid``."""
    return [(m, p) for m, p in live.requests if m in ("POST", "PUT") and p.startswith(f"/v1/sessions/{sid}/")]


def test_async_session_batch_sends_the_whole_app_in_one_request(live) -> None:
    async def app() -> tuple[str, list[str]]:
        async with P.aconnect(live.url, timeout=WAIT) as s:
            async with s.batch():
                topic = s.variable(name="topic")
                idea = FIRST(topic)
                crit = SECOND(idea)
                end = BOTH(idea, crit)
                with pytest.raises(P.BadRequest, match="read it after"):
                    await idea.aget()
                await topic.aset("parrots")
                assert idea.id is None and not topic.is_ready  # recorded, not sent
            assert all(v.id for v in (topic, idea, crit, end)) and topic.is_ready
            values = await asyncio.gather(*(v.aget(timeout=WAIT) for v in (idea, crit, end)))
            return str(s.session_id), list(values)

    sid, values = asyncio.run(app())
    assert _session_writes(live, sid) == [("POST", f"/v1/sessions/{sid}/batch")]

    with P.connect(live.url, timeout=WAIT) as s:  # one request per call and per variable
        topic = s.variable(name="topic")
        idea = FIRST(topic)
        crit = SECOND(idea)
        end = BOTH(idea, crit)
        topic.set("parrots")
        assert [v.get(timeout=WAIT) for v in (idea, crit, end)] == values
        assert len(_session_writes(live, str(s.session_id))) == 5


def test_sync_session_batch_sends_one_request(live) -> None:
    with P.connect(live.url, timeout=WAIT) as s:
        with s.batch():
            topic = s.variable("parrots", name="topic")
            idea = FIRST(topic)
            end = BOTH(idea, "constant")
            with pytest.raises(P.BadRequest, match="read it after"):
                end.get()
        assert all(isinstance(v.get(timeout=WAIT), str) for v in (idea, end))
        assert topic.get() == "parrots" and topic.id is not None
        assert _session_writes(live, str(s.session_id)) == [("POST", f"/v1/sessions/{s.session_id}/batch")]


def test_a_deferred_session_opens_with_its_first_batch_in_one_request(live) -> None:
    async def app(defer: bool) -> tuple[str, list[str], int]:
        before = len(live.requests)
        async with P.aconnect(live.url, timeout=WAIT, defer_open=defer) as s:
            assert (s.session_id is None) == defer
            async with s.batch():
                topic = s.variable(name="topic")
                idea = FIRST(topic)
                end = BOTH(idea, "constant")
                await topic.aset("parrots")
            assert s.session_id is not None and all(v.id for v in (topic, idea, end))
            values = [await v.aget(timeout=WAIT) for v in (idea, end)]
            sid = str(s.session_id)
            writes = [r for r in live.requests[before:] if r[0] in ("POST", "PUT")]
            return sid, values, len(writes)

    sid, values, writes = asyncio.run(app(True))
    assert writes == 1  # the session and the whole app at once
    assert ("POST", "/v1/sessions") in live.requests and _session_writes(live, sid) == []
    assert asyncio.run(app(False))[1:] == (values, 2)  # same values; the session was a request of its own


def test_a_deferred_session_with_a_rejected_first_batch_leaves_no_session(live) -> None:
    async def app() -> None:
        sessions = len(live.manager.sessions)
        async with P.aconnect(live.url, timeout=WAIT, defer_open=True) as s:
            with pytest.raises(P.Conflict) as rejected:
                async with s.batch():
                    topic = s.variable(name="topic")
                    FIRST(topic)
                    await topic.aset("one")
                    await topic.aset("two")
            assert rejected.value.detail["op"] == 3 and s.session_id is None
            assert len(live.manager.sessions) == sessions  # nothing was kept
            idea = FIRST("a plain call opens the session first")  # two requests: session, call
            assert await idea.aget(timeout=WAIT)
            sid = str(s.session_id)
        assert [p.rsplit("/", 1)[-1] for _, p in _session_writes(live, sid)] == ["calls"]

    asyncio.run(app())


def test_session_creation_carries_a_batch_over_http(raw: Raw) -> None:
    ops = [create("t", value="parrots"), call(T1, use("x", "t"), out("y", define_ref="y"))]
    body = {"batch": {"ops": ops}}
    created = raw.http.post("/v1/sessions", json=body)
    assert created.status_code == 201, created.text
    data = created.json()
    assert set(data["batch"]["refs"]) == {"t", "y"} and [r["op"] for r in data["batch"]["results"]] == [
        "create_variable",
        "submit_call",
    ]
    auth = {"Authorization": f"Bearer {data['token']}"}
    got = raw.http.get(
        f"/v1/sessions/{data['session_id']}/variables/{data['batch']['refs']['y']}",
        params={"wait": WAIT},
        headers=auth,
    )
    assert got.json()["state"] == "ready"
    plain = raw.http.post("/v1/sessions")  # no body: a session, no batch
    assert plain.status_code == 201 and plain.json()["batch"] is None
    bad = raw.http.post("/v1/sessions", json={"batch": {"ops": [put("v", ref="nowhere")]}})
    assert bad.status_code >= 400 and bad.json()["error"]["detail"]["op"] == 0


def test_client_batch_errors_are_raised_and_nothing_is_applied(live) -> None:
    async def app() -> None:
        async with P.aconnect(live.url, timeout=WAIT) as s:
            topic = s.variable(name="topic")  # an ordinary request, before the batch
            with pytest.raises(P.Conflict) as rejected:
                async with s.batch():
                    idea = FIRST(topic)
                    SECOND(idea)
                    await topic.aset("one")
                    await topic.aset("two")
            err = rejected.value
            assert err.code == "variable_not_pending" and err.detail["op"] == 3
            assert str(err).startswith("op 3 (set_variable): ")
            with pytest.raises(P.Conflict):
                await idea.aget()  # the batch's variables carry its error
            with pytest.raises(RuntimeError):
                async with s.batch():
                    abandoned = FIRST("never sent")
                    raise RuntimeError("the block failed")
            with pytest.raises(P.BadRequest, match="not sent"):
                await abandoned.aget()
            with pytest.raises(P.BadRequest, match="do not nest"):
                async with s.batch(), s.batch():
                    pass
            # the session goes on: nothing of the rejected batch was applied
            await topic.aset("parrots")
            assert await FIRST(topic).aget(timeout=WAIT)
            sid = str(s.session_id)
        assert [p.rsplit("/", 1)[-1] for _, p in _session_writes(live, sid)] == [
            "variables",
            "batch",
            topic.id,
            "calls",
        ]

    asyncio.run(app())


def test_sync_batch_errors_raise_at_the_block_and_fail_its_variables(live) -> None:
    with P.connect(live.url, timeout=WAIT) as s:
        with pytest.raises(P.BadRequest, match=f"at most {MAX_BATCH_OPS}"), s.batch():
            for _ in range(MAX_BATCH_OPS + 1):
                s.variable()
        with pytest.raises(P.NotFound) as rejected, s.batch():
            x = s.variable(name="x")
            FIRST(x)
            FIRST(P.SemanticVariable(s, name="ghost", var_id="v-nope"))
        assert rejected.value.code == "variable_not_found" and rejected.value.detail["op"] == 2
        with pytest.raises(P.NotFound):
            x.get()  # the batch's variables carry its error
        assert _session_writes(live, str(s.session_id)) == [("POST", f"/v1/sessions/{s.session_id}/batch")]


# ------------------------------------------------------------------ bad batches
def _cases(raw: Raw) -> list[tuple[list[Any], int, str, int, list[str]]]:
    """(ops, status, code, index of the bad op, message fragments)."""
    later, seed, reply = raw.later, raw.seed, raw.reply
    return [
        # refs
        (
            [create("a"), call(T1, use("x", "nope"), out("y"))],
            400,
            "unknown_ref",
            1,
            ["'nope'", "not defined"],
        ),
        ([call(T1, use("x", "a"), out("y")), create("a")], 400, "unknown_ref", 0, ["'a'", "before op 1"]),
        ([put("v", ref="nope")], 400, "unknown_ref", 0, ["'nope'"]),
        ([create("a"), create("a")], 400, "duplicate_ref", 1, ["'a'", "already defined by op 0"]),
        ([create("a"), call(T1, use("x", "a"), out("y", define_ref="a"))], 400, "duplicate_ref", 1, ["'a'"]),
        (
            [create("a"), call(T1, {**use("x", "a"), "var_id": seed}, out("y"))],
            400,
            "invalid_binding",
            1,
            ["both"],
        ),
        (
            [call(T1, {**inp("x", value="v"), "define_ref": "z"}, out("y"))],
            400,
            "invalid_binding",
            0,
            ["only outputs"],
        ),
        ([put("v")], 400, "invalid_binding", 0, ["exactly one of 'var_id' or 'ref'"]),
        # an earlier op's edges on existing variables are removed again
        (
            [
                call(T1, inp("x", later), out("y", define_ref="y")),
                call(T1, use("x", "y"), out("y")),
                create("y"),
            ],
            400,
            "duplicate_ref",
            2,
            ["'y'"],
        ),
        (
            [call("R: {{output:o}}", out("o", var_id=later)), call("Q: {{x", out("y"))],
            400,
            "invalid_template",
            1,
            [],
        ),
        ([put("v", var_id=later), call("Q: {{x", out("y"))], 400, "invalid_template", 1, ["unbalanced"]),
        # conflicts
        (
            [create("x"), call(T1, use("x", "x"), out("y", define_ref="y")), put("v", ref="y")],
            409,
            "variable_has_producer",
            2,
            ["it cannot be set"],
        ),
        ([put("v", var_id=reply)], 409, "variable_has_producer", 0, [reply]),
        ([put("v", var_id=seed)], 409, "variable_not_pending", 0, [seed, "already ready"]),
        (
            [create("x"), put("v", ref="x"), put("w", ref="x")],
            409,
            "variable_not_pending",
            2,
            ["set by op 1"],
        ),
        (
            [create("x"), put("v", ref="x"), call("R: {{output:o}}", out("o", ref="x"))],
            409,
            "variable_has_value",
            2,
            ["set by op 1"],
        ),
        ([create("x", "v"), call("R: {{output:o}}", out("o", ref="x"))], 409, "variable_has_value", 1, []),
        (
            [
                create("x"),
                call("A {{input:i}} -> {{output:o}}", use("i", "x"), out("o", define_ref="y")),
                call("B {{input:i}} -> {{output:o}}", use("i", "y"), out("o", ref="x")),
            ],
            400,
            "dependency_cycle",
            2,
            ["own output"],
        ),
        # what the single-op endpoints check
        ([create("a"), call("Q: {{x", use("x", "a"), out("y"))], 400, "invalid_template", 1, ["unbalanced"]),
        ([call(T1, inp("x", "v-nope"), out("y"))], 404, "variable_not_found", 0, ["v-nope"]),
        ([create("a"), put("word " * 5000, ref="a")], 400, "context_too_long", 1, ["tokens"]),
        ([call(T1, inp("x", value="v"), out("y", sampling={"top_p": 2}))], 400, "invalid_sampling", 0, []),
    ]


SCHEMA_CASES: list[tuple[list[Any], list[str]]] = [
    ([create("a"), {"op": "submit_call", "placeholders": []}], ["ops.1", "template", "required"]),
    ([{"op": "delete_variable", "var_id": "x"}], ["ops.0", "does not match"]),
    ([{"template": "Q {{output:y}}"}], ["ops.0", "discriminator"]),
    ([{"op": "create_variable", "reff": "a"}], ["ops.0.create_variable.reff", "not permitted"]),
    ([create("")], ["ops.0.create_variable.ref"]),
    ([call(T1, {**inp("x", value="v"), "reff": "a"}, out("y"))], ["ops.0.submit_call.placeholders.0.reff"]),
    ([create() for _ in range(MAX_BATCH_OPS + 1)], ["ops", f"at most {MAX_BATCH_OPS}"]),
]


def test_bad_batches_change_nothing_and_name_the_op(live, raw: Raw, bystander: Bystander) -> None:
    before = raw.baseline()
    work = engine_work(live)
    for ops, status, code, index, fragments in _cases(raw):
        err = expect_error(send(raw, ops), status, code, f"op {index} ({ops[index]['op']}): ", *fragments)
        assert err["detail"]["op"] == index, err
        assert raw.graph() == before, f"{code} at op {index} left something behind"
    for ops, fragments in SCHEMA_CASES:
        expect_error(send(raw, ops), 400, "invalid_request", *fragments)
        assert raw.graph() == before
    assert engine_work(live) == work  # nothing reached the engine
    raw.assert_intact(before)

    # other work of the session still completes, in a batch too
    resp = send(raw, [call(T1, inp("x", raw.later), out("y", define_ref="y")), put("now", var_id=raw.later)])
    assert resp.status_code == 200, resp.text
    assert raw.value(resp.json()["refs"]["y"])
    bystander.finish()


def test_a_batch_needs_the_session_token(live, raw: Raw) -> None:
    resp = raw.http.post(f"{raw.path}/batch", json={"ops": [create("a")]})
    expect_error(resp, 401, "unauthorized")
    resp = raw.http.post(
        f"{raw.path}/batch", json={"ops": [create("a")]}, headers={"Authorization": "Bearer x"}
    )
    expect_error(resp, 403, "forbidden")
    assert raw.graph() == {"calls": [], "variables": []}


@pytest.mark.timing
def test_the_largest_batch_holds_the_event_loop_briefly(live: LiveServer) -> None:
    """A batch of MAX_BATCH_OPS calls, each with a 1,000-character template, is staged
    while /healthz keeps answering at once (4,096 such ops held the loop for ~0.5 s)."""
    raw = Raw(live)
    try:
        template = "Q" + "x" * 1000 + " {{input:a}} {{output:y}}"
        bindings = [{"name": "a", "ref": "p"}, {"name": "y", "sampling": {"max_tokens": 1}}]
        call = {"op": "submit_call", "template": template, "placeholders": bindings}
        ops = [{"op": "create_variable", "ref": "p"}] + [call] * (MAX_BATCH_OPS - 1)
        with healthz_stalls(live.url) as stalls:
            resp = raw.http.post(f"{raw.path}/batch", json={"ops": ops}, headers=raw.auth)
        assert resp.status_code == 200, resp.text[:500]
        assert len(resp.json()["results"]) == MAX_BATCH_OPS
        assert stalls and max(stalls) < STALL_LIMIT_S, max(stalls)
    finally:
        raw.http.delete(raw.path, headers=raw.auth)
        raw.close()

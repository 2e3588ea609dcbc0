"""A batch whose answer carries its outputs' values (``BatchRequest.wait``), and the
client's ``session.batch(fetch_outputs=True)``: an app's submission and its results in
one round trip, against the real manager HTTP server (``live``: loopback uvicorn, tiny
seeded engine embedded).

A rejected wait changes nothing (the batch is all or none), names what is wrong, never
reaches the engine and disturbs no other session.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

import parrot as P
from parrot.protocol.schemas import MAX_BATCH_WAIT_S
from tests.api_client import WAIT, Bystander, Raw, engine_work, expect_error, inp, out
from tests.test_batch_submit import CHAIN, T1, call, create, put, use

FIRST = P.template_function(
    "Topic: {{input:topic}}\nIdea: {{output:idea}}", idea=P.Output(max_tokens=4, ignore_eos=True)
)
SECOND = P.template_function(
    "Idea: {{input:idea}}\nCritique: {{output:crit}}", crit=P.Output(max_tokens=4, ignore_eos=True)
)
NEVER = P.template_function(
    "Q: {{input:q}} A: {{output:a}}",
    a=P.Output(max_tokens=4, ignore_eos=True, transform=P.transforms.regex("(?!)")),
)


def send(raw: Raw, ops: list[Any], wait: dict[str, Any] | None) -> httpx.Response:
    body: dict[str, Any] = {"ops": ops}
    if wait is not None:
        body["wait"] = wait
    return raw.http.post(f"{raw.path}/batch", json=body, headers=raw.auth, timeout=WAIT + MAX_BATCH_WAIT_S)


def _reads(live, before: int) -> list[tuple[str, str]]:
    return [(m, p) for m, p in live.requests[before:] if m == "GET" and "/variables/" in p]


# ------------------------------------------------------------------ over HTTP
def test_the_answer_carries_the_waited_values_once_they_are_in(raw: Raw) -> None:
    resp = send(raw, CHAIN, {"refs": ["c", "i", "c"]})
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert set(data["values"]) == {"c", "i"}  # a ref asked twice is answered once
    for ref in ("i", "c"):
        info = data["values"][ref]
        assert info["state"] == "ready" and info["var_id"] == data["refs"][ref]
        assert info["value"] == raw.value(data["refs"][ref])  # what a later read gives
    plain = send(raw, [create("t", value="x"), call(T1, use("x", "t"), out("y", define_ref="y"))], None)
    assert plain.status_code == 200 and plain.json()["values"] == {}


def test_a_wait_of_zero_answers_at_once_with_pending_values(raw: Raw) -> None:
    resp = send(raw, CHAIN, {"refs": ["c"], "wait_s": 0})
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["values"]["c"]["state"] == "pending" and data["values"]["c"]["value"] is None
    assert raw.value(data["refs"]["c"])  # the work goes on after the answer


def test_a_failed_output_comes_back_failed(raw: Raw) -> None:
    ops = [call("Q {{output:y}}", out("y", define_ref="y", transform=[{"kind": "regex", "pattern": "(?!)"}]))]
    resp = send(raw, ops, {"refs": ["y"]})
    assert resp.status_code == 200, resp.text
    info = resp.json()["values"]["y"]
    assert info["state"] == "failed" and info["error"]["code"] == "transform_failed", info


def test_session_creation_with_a_wait_is_the_whole_app_in_one_request(live, raw: Raw) -> None:
    ops = [create("t", value="parrots"), call(T1, use("x", "t"), out("y", define_ref="y"))]
    created = raw.http.post("/v1/sessions", json={"batch": {"ops": ops, "wait": {"refs": ["y"]}}})
    assert created.status_code == 201, created.text
    data = created.json()
    value = data["batch"]["values"]["y"]
    assert value["state"] == "ready" and value["value"]
    auth = {"Authorization": f"Bearer {data['token']}"}
    again = raw.http.get(f"/v1/sessions/{data['session_id']}/variables/{value['var_id']}", headers=auth)
    assert again.json()["value"] == value["value"]


def _wait_cases(raw: Raw) -> list[tuple[list[Any], dict[str, Any], str, list[str]]]:
    """(ops, wait, error code, message fragments) of batches whose wait is refused."""
    return [
        ([create("t", value="v")], {"refs": ["nope"]}, "unknown_ref", ["wait: ref 'nope'"]),
        # the input is never set: only a later request of this client could give it
        (
            [create("t", name="topic"), call(T1, use("x", "t"), out("y", define_ref="y"))],
            {"refs": ["y"]},
            "wait_needs_input",
            ["wait: ref 'y'", "'topic'", "later request"],
        ),
        # two steps up, through a call of the batch, to a variable of an earlier request
        (
            [
                call(T1, inp("x", raw.later), out("y", define_ref="y")),
                call(T1, use("x", "y"), out("y", define_ref="z")),
            ],
            {"refs": ["z"]},
            "wait_needs_input",
            [raw.later],
        ),
        # an unset input waited on directly
        ([create("t")], {"refs": ["t"]}, "wait_needs_input", ["wait: ref 't'"]),
    ]


SCHEMA_CASES: list[tuple[dict[str, Any], list[str]]] = [
    ({"refs": []}, ["wait.refs", "at least 1"]),
    ({"refs": ["t"], "wait_s": MAX_BATCH_WAIT_S + 1}, ["wait.wait_s", "less than or equal"]),
    ({"refs": ["t"], "wait_s": -1}, ["wait.wait_s", "greater than or equal"]),
    ({"refs": ["t"], "timeout": 1}, ["wait.timeout", "not permitted"]),
    ({"refs": "t"}, ["wait.refs"]),
]


def test_a_wait_that_cannot_be_answered_is_refused_and_changes_nothing(
    live, raw: Raw, bystander: Bystander
) -> None:
    before = raw.baseline()
    work = engine_work(live)
    for ops, wait, code, fragments in _wait_cases(raw):
        err = expect_error(send(raw, ops, wait), 400, code, *fragments)
        assert raw.graph() == before, f"{code} left something behind"
        if code == "wait_needs_input":
            assert err["detail"]["ref"] == wait["refs"][0]
    for wait, fragments in SCHEMA_CASES:
        expect_error(send(raw, [create("t", value="v")], wait), 400, "invalid_request", *fragments)
        assert raw.graph() == before
    assert engine_work(live) == work  # nothing reached the engine
    raw.assert_intact(before)

    # the same batches are taken once their inputs are given in them
    fixed = [create("t"), call(T1, use("x", "t"), out("y", define_ref="y")), put("now", ref="t")]
    resp = send(raw, fixed, {"refs": ["y"]})
    assert resp.status_code == 200 and resp.json()["values"]["y"]["state"] == "ready", resp.text
    resp = send(
        raw,
        [call(T1, inp("x", raw.later), out("y", define_ref="y")), put("v", var_id=raw.later)],
        {"refs": ["y"]},
    )
    assert resp.status_code == 200 and resp.json()["values"]["y"]["state"] == "ready", resp.text
    bystander.finish()


def test_a_session_whose_first_batch_has_a_bad_constraint_is_not_made(live, raw: Raw) -> None:
    sessions = len(live.manager.sessions)
    bad = out("y", sampling={"constraint": {"kind": "regex", "value": "(unclosed"}})
    resp = raw.http.post("/v1/sessions", json={"batch": {"ops": [call("Q {{output:y}}", bad)]}})
    expect_error(resp, 400, "invalid_constraint", "output 'y'")
    assert len(live.manager.sessions) == sessions


# ------------------------------------------------------------------ the client
def test_a_deferred_session_runs_a_whole_app_in_one_request(live) -> None:
    async def app(fetch: bool) -> tuple[list[str], list[tuple[str, str]], int]:
        before = len(live.requests)
        async with P.aconnect(live.url, timeout=WAIT, defer_open=True) as s:
            async with s.batch(fetch_outputs=fetch):
                topic = s.variable(name="topic")
                idea = FIRST(topic)
                crit = SECOND(idea)
                await topic.aset("parrots")
            assert crit.is_ready == fetch and not idea.is_ready  # idea is read inside the batch
            values = [await crit.aget(timeout=WAIT), await idea.aget(timeout=WAIT)]
            requests = list(live.requests[before:])
        return values, requests, len(_reads(live, before))

    values, requests, reads = asyncio.run(app(True))
    assert requests[0] == ("POST", "/v1/sessions") and reads == 1  # the intermediate idea only
    plain, _, plain_reads = asyncio.run(app(False))
    assert plain == values and plain_reads == 2


def test_a_sync_batch_fetches_its_final_outputs(live) -> None:
    with P.connect(live.url, timeout=WAIT) as s:
        before = len(live.requests)
        with s.batch(fetch_outputs=True):
            a = FIRST("parrots")
            b = FIRST("crows")
        assert a.is_ready and b.is_ready
        assert a.get() and b.get() and _reads(live, before) == []


def test_a_fetched_output_that_failed_raises_at_its_read(live) -> None:
    async def app() -> None:
        async with P.aconnect(live.url, timeout=WAIT) as s:
            before = len(live.requests)
            async with s.batch(fetch_outputs=True):
                bad = NEVER("x")
                good = FIRST("parrots")
            with pytest.raises(P.CallFailed, match="transform"):
                await bad.aget()
            assert await good.aget() and _reads(live, before) == []

    asyncio.run(app())


def test_a_client_batch_that_needs_a_later_input_is_refused(live) -> None:
    with P.connect(live.url, timeout=WAIT) as s:
        topic = s.variable(name="topic")
        with pytest.raises(P.BadRequest, match="later request") as refused, s.batch(fetch_outputs=True):
            idea = FIRST(topic)
        assert refused.value.code == "wait_needs_input"
        with pytest.raises(P.BadRequest):
            idea.get()
        topic.set("parrots")  # the session goes on
        assert FIRST(topic).get(timeout=WAIT)

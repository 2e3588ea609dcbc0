"""Bad input against the real manager HTTP server (``live``: loopback uvicorn,
tiny seeded engine embedded).

Every test checks three things: the exact 4xx status, the error body
``{"error": {"code", "message"[, "detail"]}}`` with a specific code and a
message that names the problem, and that nothing else was lost or disturbed:
a *bystander* session wired a 2-call chain before the bad requests (its input
still pending) and completes it afterwards, the bad session's earlier graph is
unchanged (no half-created call or variable), and a rejected request never
reached the engine.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import parrot as P
from parrot.manager.service import ManagerConfig
from tests.api_client import (
    WAIT,
    Bystander,
    Raw,
    assert_contexts_released,
    engine_contexts,
    engine_of,
    engine_work,
    expect_error,
    inp,
    out,
)

PROMPT_FAST = 3.0  # seconds: "promptly", for failures that must not wait on anything
MAX_BODY = 64 * 1024
LONG = 2000  # tokens: a generation still running when its session is closed (~1 s on a CPU)


@pytest.fixture
def manager_config() -> ManagerConfig:
    return ManagerConfig(max_body_bytes=MAX_BODY)


# ---------------------------------------------------------------- 1. templates
def test_malformed_templates_are_rejected(live, raw: Raw, bystander: Bystander) -> None:
    before = raw.baseline()
    work = engine_work(live)
    cases = [
        ("Q: {{x", ["unbalanced", "never closed", "offset 3"]),
        ("Q: x}} {{output:y}}", ["unbalanced", "closes nothing", "offset 4"]),
        ("Q: {{input:x {{output:y}}", ["unbalanced", "offset 3"]),
        ("Q: {{input:}} {{output:y}}", ["empty name", "offset 3"]),
        ("Q: {{inptu:x}} {{output:y}}", ["'inptu'", "direction"]),
        ("Q: {{input:1x}} {{output:y}}", ["'1x'", "not a valid name"]),
        ("Q: {{input:x}} {{output:y}} {{output:y}}", ["'y'", "more than once"]),
        ("{{output:y}} {{input:x}}", ["cannot start with an output"]),
    ]
    for template, fragments in cases:
        resp = raw.submit(template, [inp("x", value="v"), out("y")])
        expect_error(resp, 400, "invalid_template", *fragments)
    assert engine_work(live) == work  # nothing reached the engine
    raw.assert_intact(before)
    bystander.finish()


# ----------------------------------------------------------------- 2. bindings
def test_binding_mismatches_are_rejected(live, raw: Raw, bystander: Bystander) -> None:
    before = raw.baseline()
    work = engine_work(live)
    template = "Q: {{input:x}} A: {{output:y}}"
    cases = [
        ([out("y")], ["['x']", "no binding"]),  # a placeholder with no binding
        ([inp("x", value="v"), out("y"), out("z")], ["['z']", "no placeholder"]),  # binding, no placeholder
        ([inp("x", value="v"), inp("x", value="w"), out("y")], ["'x'", "bound twice"]),
        ([inp("x", raw.seed, value="v"), out("y")], ["'x'", "exactly one of"]),  # var_id and value
        ([inp("x"), out("y")], ["'x'", "exactly one of"]),  # neither
        ([{**inp("x", raw.seed), "sampling": {}}, out("y")], ["'x'", "cannot carry"]),
        ([inp("x", raw.seed), {**out("y"), "value": "v"}], ["'y'", "cannot have a value"]),
        ([{"name": "", "value": "v"}, out("y")], ["empty name"]),
    ]
    for placeholders, fragments in cases:
        expect_error(raw.submit(template, placeholders), 400, "invalid_binding", *fragments)
    # a binding's direction contradicting the template's
    resp = raw.submit(template, [{**inp("x", raw.seed), "direction": "output"}, out("y")])
    expect_error(resp, 400, "invalid_template", "'x'", "marked input")
    assert engine_work(live) == work
    raw.assert_intact(before)
    bystander.finish()


# ------------------------------------------------------- 3. two producers: 409
def test_variable_with_two_producers_is_a_conflict(live, raw: Raw, bystander: Bystander) -> None:
    x = raw.var(name="x")
    first = raw.call("Q: {{input:x}} A: {{output:y}}", [inp("x", x), out("y")])
    y = first["outputs"]["y"]
    z = raw.var(name="z")
    given = raw.var("given", name="given")
    before = raw.graph()
    work = engine_work(live)

    # a second call naming y as its output, alone or beside a fresh output
    resp = raw.submit("R: {{output:again}}", [out("again", var_id=y)])
    expect_error(resp, 409, "variable_has_producer", y, first["call_id"])
    resp = raw.submit("R: {{output:fresh}} S: {{output:again}}", [out("fresh"), out("again", var_id=y)])
    expect_error(resp, 409, "variable_has_producer", y, first["call_id"])
    # ... also when it consumes something (no consumer edge may be left behind)
    resp = raw.submit("R: {{input:x}} {{output:again}}", [inp("x", x), out("again", var_id=y)])
    expect_error(resp, 409, "variable_has_producer", y)
    # one call binding the same variable to two outputs
    resp = raw.submit("R: {{output:a}} S: {{output:b}}", [out("a", var_id=z), out("b", var_id=z)])
    expect_error(resp, 409, "variable_has_producer", "two outputs")
    # an output bound to a variable that already has a value
    resp = raw.submit("R: {{output:a}}", [out("a", var_id=given)])
    expect_error(resp, 409, "variable_has_value", given, "already has a value")
    # and the client may not set a produced variable
    expect_error(raw.put(y, "mine"), 409, "variable_has_producer", y, first["call_id"])

    assert raw.graph() == before  # no half-linked call, no orphan output variable
    assert engine_work(live) == work
    raw.set(x, "parrots")  # the original producer still runs and fills y
    raw.value(y)
    bystander.finish()


# ------------------------------------------------------------------ 4. cycles
def test_cycles_are_rejected(live, raw: Raw, bystander: Bystander) -> None:
    x = raw.var(name="x")  # no value
    a = raw.call("A {{input:x}} -> {{output:y}}", [inp("x", x), out("y")])
    y = a["outputs"]["y"]
    c = raw.call("C {{input:y}} -> {{output:z}}", [inp("y", y), out("z")])
    z = c["outputs"]["z"]
    before = raw.graph()
    work = engine_work(live)

    # B consumes y (A's output) and would produce x (A's input)
    resp = raw.submit("B {{input:y}} -> {{output:x}}", [inp("y", y), out("x", var_id=x)])
    expect_error(resp, 400, "dependency_cycle", f"{y} (y)", "own output")
    # ... also beside a fresh output, which must not be left behind
    resp = raw.submit(
        "B {{input:y}} -> {{output:x}} {{output:extra}}", [inp("y", y), out("x", var_id=x), out("extra")]
    )
    expect_error(resp, 400, "dependency_cycle", f"{y} (y)")
    # two hops: D consumes z (downstream of A via C) and would produce x
    resp = raw.submit("D {{input:z}} -> {{output:x}}", [inp("z", z), out("x", var_id=x)])
    expect_error(resp, 400, "dependency_cycle", f"{z} (z)")
    # directly: input x and output x in one call
    resp = raw.submit("E {{input:i}} -> {{output:o}}", [inp("i", x), out("o", var_id=x)])
    expect_error(resp, 400, "dependency_cycle", f"{x} (x)")

    after = raw.graph()
    assert after == before
    x_info = next(v for v in after["variables"] if v["var_id"] == x)
    assert x_info["producer"] is None and x_info["consumers"] == [a["call_id"]]
    assert engine_work(live) == work
    raw.set(x, "parrots")  # the acyclic part still runs end to end
    raw.value(z)
    bystander.finish()


# ---------------------------------------------------- 5. unknown ids / isolation
def test_unknown_and_foreign_ids_are_not_found(live, raw: Raw, bystander: Bystander) -> None:
    before = raw.baseline()
    other = Raw(live)
    try:
        theirs = other.var(name="theirs")  # pending, in another session
        their_call = other.call("T {{input:t}} {{output:u}}", [inp("t", theirs), out("u")])
        other_before = other.graph()
        work = engine_work(live)

        http, auth, p = raw.http, raw.auth, raw.path
        expect_error(
            http.get("/v1/sessions/s-nope/variables/v-1", headers=auth), 404, "session_not_found", "s-nope"
        )
        expect_error(http.get("/v1/sessions/s-nope/graph"), 404, "session_not_found", "s-nope")
        expect_error(http.delete("/v1/sessions/s-nope", headers=auth), 404, "session_not_found")
        expect_error(raw.get("v-nope"), 404, "variable_not_found", "v-nope")
        expect_error(raw.put("v-nope", "x"), 404, "variable_not_found", "v-nope")
        expect_error(http.get(f"{p}/variables/v-nope/stream", headers=auth), 404, "variable_not_found")
        expect_error(http.get(f"{p}/calls/c-nope", headers=auth), 404, "call_not_found", "c-nope")
        resp = raw.submit("Q {{input:x}} {{output:y}}", [inp("x", "v-nope"), out("y")])
        expect_error(resp, 404, "variable_not_found", "v-nope")
        resp = raw.submit("Q {{output:y}}", [out("y", var_id="v-nope")])
        expect_error(resp, 404, "variable_not_found", "v-nope")

        # ids of another session do not exist here, whatever the operation
        expect_error(raw.get(theirs), 404, "variable_not_found", theirs)
        expect_error(raw.put(theirs, "stolen"), 404, "variable_not_found", theirs)
        resp = http.get(f"{p}/calls/{their_call['call_id']}", headers=auth)
        expect_error(resp, 404, "call_not_found", their_call["call_id"])
        resp = raw.submit("Q {{input:x}} {{output:y}}", [inp("x", theirs), out("y")])
        expect_error(resp, 404, "variable_not_found", theirs)
        resp = raw.submit("Q {{input:x}} {{output:y}}", [inp("x", raw.seed), out("y", var_id=theirs)])
        expect_error(resp, 404, "variable_not_found", theirs)
        # and the reverse: this session's ids do not exist for the other one
        expect_error(other.get(raw.seed), 404, "variable_not_found", raw.seed)
        # the client library maps the body back to the same error
        with P.connect(live.url, timeout=WAIT) as s:
            ghost = P.SemanticVariable(s, name="ghost", var_id=theirs)
            with pytest.raises(P.NotFound) as caught:
                ghost.get(timeout=WAIT)
            assert caught.value.code == "variable_not_found" and theirs in caught.value.message

        assert engine_work(live) == work
        assert other.graph() == other_before  # untouched: still pending, no new consumer
        raw.assert_intact(before)
        other.set(theirs, "mine")
        other.value(their_call["outputs"]["u"])
    finally:
        other.close()
    bystander.finish()


# -------------------------------------------------------------------- 6. auth
def test_missing_wrong_and_foreign_tokens(live, raw: Raw, bystander: Bystander) -> None:
    before = raw.baseline()
    other = Raw(live)
    try:
        http, p = raw.http, raw.path
        requests = [
            ("GET", f"{p}/variables/{raw.seed}", None),
            ("PUT", f"{p}/variables/{raw.later}", {"value": "sneaky"}),
            ("POST", f"{p}/variables", {"value": "sneaky"}),
            ("POST", f"{p}/calls", {"template": "Q {{output:y}}", "placeholders": [out("y")]}),
            ("GET", f"{p}/graph", None),
            ("GET", f"{p}/calls/c-1", None),
            ("DELETE", p, None),
        ]
        work = engine_work(live)
        for method, path, body in requests:
            for headers, status, code in [
                ({}, 401, "unauthorized"),
                ({"Authorization": "Bearer"}, 401, "unauthorized"),
                ({"Authorization": f"Basic {raw.token}"}, 401, "unauthorized"),
                ({"Authorization": "Bearer not-the-token"}, 403, "forbidden"),
                ({"Authorization": f"Bearer {other.token}"}, 403, "forbidden"),
            ]:
                resp = http.request(method, path, json=body, headers=headers)
                fragments = [raw.sid] if status == 403 else ["token"]
                expect_error(resp, status, code, *fragments)
        assert engine_work(live) == work
        raw.assert_intact(before)  # not closed, not changed
        assert other.graph() == {"calls": [], "variables": []}
    finally:
        other.close()
    bystander.finish()


# ---------------------------------------------------------- 7. context length
def test_values_longer_than_the_context_are_rejected(live, raw: Raw, bystander: Bystander) -> None:
    max_seq_len = engine_of(live).max_seq_len
    too_long = "a" * (max_seq_len + 100)  # byte-level tokenizer: one token per character
    half = "b" * (max_seq_len * 3 // 4)  # fits alone; two of them do not
    raw.baseline()
    x = raw.var(name="x")
    waiting = raw.call("W {{input:x}} {{output:w}}", [inp("x", x), out("w")])
    before = raw.graph()
    work = engine_work(live)

    err = expect_error(raw.create(too_long), 400, "context_too_long", str(max_seq_len + 100))
    assert err["detail"] == {"tokens": max_seq_len + 100, "max_seq_len": max_seq_len}
    expect_error(raw.put(x, too_long), 400, "context_too_long", str(max_seq_len))
    resp = raw.submit("Q {{input:q}} {{output:y}}", [inp("q", value=too_long), out("y")])
    expect_error(resp, 400, "context_too_long", str(max_seq_len))
    # each value fits, but the rendered prompt cannot: rejected at submit when inputs are known
    resp = raw.submit(
        "Q {{input:a}} {{input:b}} {{output:y}}", [inp("a", value=half), inp("b", value=half), out("y")]
    )
    expect_error(resp, 400, "context_too_long", "rendered prompt", str(max_seq_len))
    h1, h2 = raw.var(half), raw.var(half)
    before["variables"] += raw.graph()["variables"][-2:]
    resp = raw.submit("Q {{input:a}} {{input:b}} {{output:y}}", [inp("a", h1), inp("b", h2), out("y")])
    expect_error(resp, 400, "context_too_long", "rendered prompt")

    assert raw.graph() == before  # no variable, no call, no consumer edge from any of these
    assert engine_work(live) == work
    # the client library raises the same class
    with P.connect(live.url, timeout=WAIT) as s:
        with pytest.raises(P.ContextTooLong):
            s.variable(too_long)
        v = s.variable()
        with pytest.raises(P.ContextTooLong):
            v.set(too_long)
        v.set("short")  # still pending after the rejected set, so this works
        assert v.get(timeout=WAIT) == "short"
    # x was not set by the rejected PUT: its consumer still waits, then runs
    assert raw.get(x).json()["state"] == "pending"
    raw.set(x, "fine")
    raw.value(waiting["outputs"]["w"])
    bystander.finish()


def test_prompt_too_long_only_at_run_time_fails_promptly(live, raw: Raw, bystander: Bystander) -> None:
    max_seq_len = engine_of(live).max_seq_len
    half = "c" * (max_seq_len * 3 // 4)
    contexts = engine_contexts(live)
    a, b = raw.var(name="a"), raw.var(name="b")
    first = raw.call("Q {{input:a}} {{input:b}} {{output:y}}", [inp("a", a), inp("b", b), out("y")])
    y = first["outputs"]["y"]
    second = raw.call("R {{input:y}} {{output:z}}", [inp("y", y), out("z")])
    z = second["outputs"]["z"]
    raw.set(a, half)  # each set is accepted: each value fits
    started = time.monotonic()
    raw.set(b, half)
    y_info, z_info = raw.settled(y), raw.settled(z)
    assert time.monotonic() - started < PROMPT_FAST
    assert y_info["state"] == "failed" and y_info["error"]["code"] == "context_too_long"
    assert "rendered prompt" in y_info["error"]["message"]
    assert y_info["error"]["detail"]["max_seq_len"] == max_seq_len
    assert z_info["state"] == "failed" and z_info["error"]["code"] == "context_too_long"
    assert z_info["error"]["detail"]["origin_call"] == first["call_id"]
    calls = {c["call_id"]: c for c in raw.graph()["calls"]}
    assert calls[first["call_id"]]["state"] == "failed" and calls[second["call_id"]]["state"] == "failed"
    assert_contexts_released(live, contexts)
    bystander.finish()


# ------------------------------------------------------ 8. sampling, transforms
def test_invalid_sampling_and_transforms(live, raw: Raw, bystander: Bystander) -> None:
    before = raw.baseline()
    work = engine_work(live)
    bad_sampling = [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 10**30}, "top_k"),  # used to overflow the engine step, failing every batched call
        ({"seed": 1.5}, "seed"),
        ({"stop": 5}, "stop"),  # used to be a TypeError -> 500
        ({"stop": "ab"}, "stop"),  # used to be split into the stop strings "a" and "b"
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"temprature": 0.5}, "'temprature'"),
    ]
    for sampling, fragment in bad_sampling:
        resp = raw.submit("Q {{output:y}}", [{"name": "y", "direction": "output", "sampling": sampling}])
        expect_error(resp, 400, "invalid_sampling", "invalid sampling", fragment)
    bad_transforms = [
        ("uppercase", "'uppercase'"),
        ({"kind": "upper"}, "'upper'"),
        ({"pattern": "a"}, "'kind'"),
        ({"kind": "regex"}, "'pattern'"),
        ({"kind": "regex", "pattern": "("}, "does not compile"),
        ({"kind": "regex", "pattern": "a", "group": 2}, "group 2"),
        ({"kind": "regex", "pattern": "a", "flags": "i"}, "'flags'"),
        ({"kind": "json", "path": "a..b"}, "malformed path"),
        ([{"kind": "strip"}, 7], "step 1"),
        (42, "int"),
        ([{"kind": "strip"}] * 33, "at most 32"),
    ]
    for transform, fragment in bad_transforms:
        resp = raw.submit("Q {{output:y}}", [out("y", transform=transform)])
        expect_error(resp, 400, "invalid_transform", "invalid transform", fragment)
    assert engine_work(live) == work
    raw.assert_intact(before)
    bystander.finish()


# ---------------------------------------------------------------- 9. body size
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_oversized_bodies_are_rejected(live, raw: Raw, bystander: Bystander, chunked: bool) -> None:
    before = raw.baseline()
    work = engine_work(live)
    seen = len(live.requests)
    body = json.dumps({"template": "Q {{output:y}}", "placeholders": [out("y")], "name": "x" * 200_000})
    data = body.encode()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(data), 8192):
            yield data[i : i + 8192]

    headers = {**raw.auth, "content-type": "application/json"}
    for path in (f"{raw.path}/calls", f"{raw.path}/variables"):
        resp = raw.http.post(path, content=chunks() if chunked else data, headers=headers)
        assert ("transfer-encoding" in resp.request.headers) is chunked
        expect_error(resp, 413, "payload_too_large", str(MAX_BODY))
    assert len(live.requests) == seen + 2  # they reached the server
    # just under the limit is read and handled (padding is insignificant JSON whitespace)
    padded = b'{"name": "padded"' + b" " * (MAX_BODY - 100) + b"}"
    resp = raw.http.post(f"{raw.path}/variables", content=padded, headers=headers)
    assert resp.status_code == 201, resp.text
    before["variables"].append(raw.graph()["variables"][-1])
    # the server keeps serving on fresh and reused connections
    assert raw.http.get("/healthz").json()["ok"] is True
    assert engine_work(live) == work
    raw.assert_intact(before)
    bystander.finish()


# ---------------------------------------------------------- 10. request schema
def test_request_schema_errors_name_the_field(live, raw: Raw, bystander: Bystander) -> None:
    before = raw.baseline()
    work = engine_work(live)
    http, auth, p = raw.http, raw.auth, raw.path
    cases = [
        ("POST", f"{p}/calls", {"placeholders": []}, ["template", "required"]),
        ("POST", f"{p}/calls", {"template": 5}, ["template", "string"]),
        ("POST", f"{p}/calls", {"template": "Q {{output:y}}", "placeholders": "y"}, ["placeholders"]),
        ("POST", f"{p}/calls", {"template": "Q {{output:y}}", "chat": "maybe"}, ["chat"]),
        ("POST", f"{p}/calls", {"template": "Q {{output:y}}", "templat": "x"}, ["templat", "not permitted"]),
        (
            "POST",
            f"{p}/calls",
            {"template": "Q", "placeholders": [{"direction": "output"}]},
            ["placeholders.0.name"],
        ),
        (
            "POST",
            f"{p}/calls",
            {"template": "Q", "placeholders": [{"name": "y", "direction": "sideways"}]},
            ["placeholders.0.direction"],
        ),
        (
            "POST",
            f"{p}/calls",
            {"template": "Q", "placeholders": [{"name": "y", "criteria": "FAST"}]},
            ["placeholders.0.criteria"],
        ),
        (
            "POST",
            f"{p}/calls",
            {"template": "Q", "placeholders": [{"name": "y", "nmae": "z"}]},
            ["placeholders.0.nmae"],
        ),
        ("POST", f"{p}/calls", ["template"], ["body", "dictionary"]),
        ("POST", f"{p}/variables", {"value": 5}, ["value", "string"]),
        ("POST", f"{p}/variables", {"valeu": "x"}, ["valeu", "not permitted"]),
        ("PUT", f"{p}/variables/{raw.later}", {}, ["value", "required"]),
        ("PUT", f"{p}/variables/{raw.later}", {"value": None}, ["value"]),
    ]
    for method, path, body, fragments in cases:
        resp = http.request(method, path, json=body, headers=auth)
        expect_error(resp, 400, "invalid_request", "invalid request", *fragments)
    resp = http.post(f"{p}/calls", content=b"{not json", headers={**auth, "content-type": "application/json"})
    expect_error(resp, 400, "invalid_request", "JSON")
    resp = http.get(f"{p}/variables/{raw.later}", params={"wait": "-1"}, headers=auth)
    expect_error(resp, 400, "invalid_request", "wait")
    resp = http.get(f"{p}/variables/{raw.later}", params={"criteria": "SOON"}, headers=auth)
    expect_error(resp, 400, "invalid_request", "criteria")
    assert engine_work(live) == work
    raw.assert_intact(before)
    bystander.finish()


# ------------------------------------------------------- 11. run-time failure
def test_run_time_failure_fails_everything_downstream_promptly(live, bystander: Bystander) -> None:
    never = P.template_function(  # (?!) matches no text at all, empty or not
        "Q: {{input:q}}\nA: {{output:a}}",
        a=P.Output(max_tokens=4, ignore_eos=True, transform=P.transforms.regex("(?!)")),
    )
    step = P.template_function(
        "In: {{input:x}}\nOut: {{output:y}}", y=P.Output(max_tokens=4, ignore_eos=True)
    )
    contexts = engine_contexts(live)
    with P.connect(live.url, timeout=WAIT) as s:
        q = s.variable(name="q")
        a = s.call(never, q)
        b = s.call(step, a)
        c = s.call(step, b)
        side = s.call(step, q)  # shares the input, not the failure
        started = time.monotonic()
        q.set("parrots")
        for var in (c, b, a):  # deepest first: nothing downstream may wait on the failure
            with pytest.raises(P.TransformFailed) as caught:
                var.get(timeout=WAIT)
            assert caught.value.code == "transform_failed"
            assert "(?!)" in caught.value.message and "does not match" in caught.value.message
        assert time.monotonic() - started < PROMPT_FAST
        assert isinstance(caught.value, P.CallFailed)
        # submitting onto a failed variable fails at once too
        d = s.call(step, c)
        with pytest.raises(P.TransformFailed):
            d.get(timeout=PROMPT_FAST)
        assert isinstance(side.get(timeout=WAIT), str)  # the rest of the session is unaffected

        with httpx.Client(base_url=live.url, timeout=WAIT) as http:
            resp = http.get(
                f"/v1/sessions/{s.session_id}/graph", headers={"Authorization": f"Bearer {s.token}"}
            )
        calls = resp.json()["calls"]
        assert [x["state"] for x in calls] == ["failed", "failed", "failed", "done", "failed"]
        assert all(x["error"]["code"] == "transform_failed" for x in calls if x["state"] == "failed")
        root = calls[0]["call_id"]
        assert calls[1]["error"]["detail"]["origin_call"] == root
        assert calls[2]["error"]["detail"]["origin_call"] == root
        assert calls[0]["generated_tokens"] == 4  # it did generate; the transform failed after
    assert_contexts_released(live, contexts)
    bystander.finish()


# --------------------------------------------------------------- 12. chat shape
def test_chat_needs_one_output_at_the_end(live, raw: Raw, bystander: Bystander) -> None:
    before = raw.baseline()
    work = engine_work(live)
    cases = [
        ("Q: {{input:q}} A: {{output:a}} thanks", [inp("q", value="hi"), out("a")]),
        ("Q: {{input:q}} A: {{output:a}} B: {{output:b}}", [inp("q", value="hi"), out("a"), out("b")]),
        ("A: {{output:a}} Q: {{input:q}}", [inp("q", raw.seed), out("a")]),
    ]
    for template, placeholders in cases:
        resp = raw.submit(template, placeholders, chat=True)
        expect_error(resp, 400, "invalid_template", "chat=True", "last element")
    assert engine_work(live) == work
    raw.assert_intact(before)
    # the same session can still run a well-formed chat call
    ok = raw.call("Q: {{input:q}} A: {{output:a}}  \n", [inp("q", raw.seed), out("a")], chat=True)
    raw.value(ok["outputs"]["a"])
    bystander.finish()


# ---------------------------------------------------------------- close session
def test_closed_session_ids_are_gone_and_others_continue(live, raw: Raw, bystander: Bystander) -> None:
    raw.baseline()
    contexts = engine_contexts(live)
    tokens_before = live.run_on_loop(engine_of(live).api.stats()).generated_tokens
    # a long generation running while the session is closed
    running = raw.call("Long: {{output:long}}", [out("long", sampling={"max_tokens": LONG})])
    deadline = time.monotonic() + WAIT
    while (
        raw.http.get(f"{raw.path}/calls/{running['call_id']}", headers=raw.auth).json()["state"] != "running"
    ):
        assert time.monotonic() < deadline, "the long call never started"
        time.sleep(0.01)
    # a bystander long-polling in another thread across the close
    result: dict[str, Any] = {}

    def finish() -> None:
        try:
            bystander.finish()
        except BaseException as exc:  # re-raised below
            result["error"] = exc

    thread = threading.Thread(target=finish)
    thread.start()
    resp = raw.http.delete(raw.path, headers=raw.auth)
    assert resp.status_code == 204 and resp.content == b""
    thread.join(WAIT * 3)
    assert not thread.is_alive(), "the bystander hung"
    if "error" in result:
        raise result["error"]

    gone = [
        ("GET", f"{raw.path}/variables/{raw.seed}", None),
        ("GET", f"{raw.path}/variables/{running['outputs']['long']}", None),
        ("PUT", f"{raw.path}/variables/{raw.later}", {"value": "late"}),
        ("GET", f"{raw.path}/calls/{running['call_id']}", None),
        ("GET", f"{raw.path}/graph", None),
        ("POST", f"{raw.path}/variables", {"value": "new"}),
        ("POST", f"{raw.path}/calls", {"template": "Q {{output:y}}", "placeholders": [out("y")]}),
        ("DELETE", raw.path, None),
    ]
    for method, path, body in gone:
        resp = raw.http.request(method, path, json=body, headers=raw.auth)
        expect_error(resp, 404, "session_not_found", raw.sid)
    assert raw.sid not in live.manager.sessions
    assert_contexts_released(live, contexts)  # the cancelled generation freed its context
    generated = live.run_on_loop(engine_of(live).api.stats()).generated_tokens - tokens_before
    assert generated < LONG, "closing the session did not stop its running generation"
    # new sessions still work end to end
    fresh = Raw(live)
    try:
        fresh.value(fresh.call("Hi {{output:y}}", [out("y")])["outputs"]["y"])
    finally:
        fresh.close()

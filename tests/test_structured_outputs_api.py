"""Structured outputs through the manager's APIs, against a real manager HTTP server on
loopback with the tiny seeded engine embedded: the official ``openai`` client with
``response_format``, vLLM's ``structured_outputs`` and its older guided fields, bad
constraints and compile limits (400s naming the field, the server still serving),
``P.Output(json_schema/regex/choices)``, and transform failures that name their call and keep the raw text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

import parrot as P
import tests.conftest as conftest
from parrot.protocol import constraint as C
from tests.api_client import STALL_LIMIT_S, healthz_stalls
from tests.test_structured_outputs import DIGITS, SCHEMA

WAIT = 60.0
CHOICES = ["yes", "no", "maybe so"]


def valid(value: Any) -> bool:
    """``value`` satisfies SCHEMA (checked with jsonschema)."""
    import jsonschema

    try:
        jsonschema.validate(value, SCHEMA)
    except jsonschema.ValidationError:
        return False
    return True


@pytest.fixture
def client(live: conftest.LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=WAIT) as c:
        yield c


@pytest.fixture
def api(live: conftest.LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=WAIT)


# ------------------------------------------------------------- the OpenAI API
def test_the_official_client_gets_json_from_response_format_on_chat(api: openai.OpenAI) -> None:
    answer = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Grade this essay."}],
        max_tokens=80,
        temperature=1.0,
        seed=3,
        n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "grade", "schema": SCHEMA}},
    )
    assert len(answer.choices) == 3
    for choice in answer.choices:  # each of the n forks follows the schema on its own
        assert choice.finish_reason == "stop"
        assert valid(json.loads(choice.message.content or "")), choice.message.content
    anything = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)
    else:  # cut by max_tokens: still a prefix of a JSON object
        assert (anything.choices[0].message.content or "").startswith("{")


def test_the_official_client_sends_guided_fields_on_completions(api: openai.OpenAI) -> None:
    regex = api.completions.create(
        model="tiny",
        prompt="Code: ",
        max_tokens=20,
        temperature=1.0,
        n=4,
        seed=1,
        extra_body={"guided_regex": DIGITS},
    )
    assert [bool(re.fullmatch(DIGITS, c.text)) for c in regex.choices] == [True] * 4
    choice = api.completions.create(
        model="tiny",
        prompt=["A? ", "B? "],
        max_tokens=20,
        temperature=1.0,
        extra_body={"guided_choice": CHOICES},
    )
    assert len(choice.choices) == 2 and all(c.text in CHOICES for c in choice.choices)
    streamed = api.completions.create(
        model="tiny",
        prompt="J: ",
        max_tokens=80,
        temperature=0.7,
        seed=5,
        stream=True,
        extra_body={"guided_json": json.dumps(SCHEMA)},
    )
    text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
    assert valid(json.loads(text)), text


def test_the_official_client_sends_vllms_structured_outputs(api: openai.OpenAI) -> None:
    """vLLM's current field (vLLM 0.32 no longer reads the guided_* ones), each kind once."""
    regex = api.completions.create(
        model="tiny", prompt="Code: ", max_tokens=20, temperature=1.0, n=3, seed=2,
        extra_body={"structured_outputs": {"regex": DIGITS}},
    )  # fmt: skip
    assert [bool(re.fullmatch(DIGITS, c.text)) for c in regex.choices] == [True] * 3
    choice = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Pick one."}], max_tokens=20, temperature=1.0,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )  # fmt: skip
    assert choice.choices[0].message.content in CHOICES
    schema = api.completions.create(
        model="tiny", prompt="J: ", max_tokens=80, temperature=0.7, seed=5,
        extra_body={"structured_outputs": {"json": SCHEMA}},
    )  # fmt: skip
    assert valid(json.loads(schema.choices[0].text)), schema.choices[0].text
    anything = api.completions.create(
        model="tiny", prompt="O: ", max_tokens=40, temperature=0.7, seed=6,
        extra_body={"structured_outputs": {"json_object": True}},
    )  # fmt: skip
    text = anything.choices[0].text
    assert text.lstrip().startswith("{"), text  # an object, finished or cut at max_tokens
    assert anything.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict), text


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (
            "/v1/completions",
            {"structured_outputs": {"grammar": "root ::= 'a'"}},
            "invalid structured_outputs: grammar not supported (only json, regex, choice, json_object)",
        ),
        (
            "/v1/chat/completions",
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "invalid structured_outputs: give exactly one of json, regex, choice, json_object, got 2",
        ),
        ("/v1/completions", {"structured_outputs": {}}, "give exactly one of json, regex, choice"),
        ("/v1/completions", {"structured_outputs": {"json_object": False}}, "json_object: must be true"),
        ("/v1/completions", {"structured_outputs": {"regex": "a(b"}}, "invalid structured_outputs.regex: "),
        (
            "/v1/chat/completions",
            {"structured_outputs": {"choice": ["a"]}, "guided_regex": "a"},
            "give at most one of structured_outputs and guided_regex",
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
            "give at most one of response_format and structured_outputs.choice",
        ),
        ("/v1/completions", {"guided_regex": "a(b"}, "invalid guided_regex: "),
        (
            "/v1/completions",
            {"guided_json": {"type": "objectx"}},
            "invalid guided_json: Invalid type: objectx",
        ),
        ("/v1/completions", {"guided_json": "{not json"}, "invalid guided_json: not valid JSON"),
        ("/v1/completions", {"guided_choice": []}, "invalid guided_choice: choices must be a non-empty list"),
        (
            "/v1/completions",
            {"guided_regex": "a", "guided_choice": ["a"]},
            "at most one of guided_json, guided_regex, guided_choice may be given",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "invalid response_format.json_schema.schema: ",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "invalid response_format.json_schema.schema: is required",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "yaml"}},
            "invalid response_format.type: must be",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "give at most one of response_format and guided_regex",
        ),
        (
            "/v1/completions",
            {"guided_regex": "a" * (C.MAX_REGEX_CHARS + 1)},
            f"invalid guided_regex: the regex has {C.MAX_REGEX_CHARS + 1} characters; the limit is",
        ),
        (
            "/v1/chat/completions",
            {"guided_choice": ["x"] * (C.MAX_CHOICES + 1)},
            f"invalid guided_choice: {C.MAX_CHOICES + 1} choices; the limit is {C.MAX_CHOICES}",
        ),
        (
            "/v1/completions",
            {"guided_json": {"enum": ["x" * C.MAX_SCHEMA_CHARS]}},
            f"characters; the limit is {C.MAX_SCHEMA_CHARS}",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field_and_the_server_keeps_serving(
    live: conftest.LiveServer, client: httpx.Client, path: str, body: dict[str, Any], field: str
) -> None:
    base: dict[str, Any] = {"model": "tiny", "max_tokens": 4}
    base.update(
        {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    )
    r = client.post(path, json={**base, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_constraint" and field in error["message"], error
    assert live.manager.sessions == {}  # nothing was created
    ok = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "y", "max_tokens": 10, "guided_choice": CHOICES}
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in CHOICES


def test_a_constraint_that_compiles_too_slowly_is_a_400(
    client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(C, "COMPILE_TIMEOUT_S", 0.0)  # every compile now takes "too long"
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "guided_regex": "[0-9]{3}"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "invalid guided_regex: it did not compile within 0 s"
    )
    monkeypatch.undo()
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "guided_regex": "[0-9]{3}"})
    assert r.status_code == 200 and re.fullmatch("[0-9]{3}", r.json()["choices"][0]["text"])


@pytest.mark.timing
def test_the_largest_schemas_hold_the_event_loop_briefly(
    live: conftest.LiveServer, client: httpx.Client
) -> None:
    """Schemas near MAX_SCHEMA_CHARS (400 patterned fields) compile off the loop while
    /healthz keeps answering; each distinct one is compiled afresh (no cache hit)."""
    fields = {
        f"field_{i:03d}": {"type": "string", "pattern": f"[a-z]{{1,{i % 50 + 1}}}[0-9]+"} for i in range(400)
    }
    schema = {"type": "object", "properties": fields, "required": list(fields)}
    with healthz_stalls(live.url) as stalls:
        for i in range(4):
            big = {**schema, "title": f"schema {i}"}
            assert len(json.dumps(big, separators=(",", ":"))) > C.MAX_SCHEMA_CHARS * 0.8
            body = {"model": "tiny", "prompt": "x", "max_tokens": 20, "guided_json": big}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith('{"field_000": "')
    assert stalls and max(stalls) < STALL_LIMIT_S, max(stalls)


# ------------------------------------------------------------- semantic functions
@P.semantic_function
def grade(essay: P.Input, verdict: P.Output(max_tokens=80, temperature=0.9, seed=2, json_schema=SCHEMA)):
    """Essay: {{essay}}
    Verdict as JSON: {{verdict}}"""


@P.semantic_function
def label(
    text: P.Input, tag: P.Output(max_tokens=10, choices=CHOICES), code: P.Output(max_tokens=10, regex=DIGITS)
):
    """Text: {{text}} Tag: {{tag}} Code: {{code}}"""


def test_semantic_function_outputs_follow_their_constraints(live: conftest.LiveServer) -> None:
    with P.connect(live.url):
        verdicts = [grade(f"essay {i}") for i in range(3)]
        tag, code = label("hello")
        values = [v.get(timeout=WAIT) for v in verdicts]
        assert tag.get(timeout=WAIT) in CHOICES
        assert re.fullmatch(DIGITS, code.get(timeout=WAIT))
    for value in values:
        assert valid(json.loads(value)), value


def test_a_bad_constraint_on_the_wire_is_a_400_naming_the_output_and_creates_nothing(
    live: conftest.LiveServer, client: httpx.Client
) -> None:
    session = client.post("/v1/sessions", json={}).json()
    headers = {"Authorization": f"Bearer {session['token']}"}
    sid = session["session_id"]
    bad = {"name": "y", "direction": "output", "sampling": {"constraint": {"regex": "(("}}}
    r = client.post(
        f"/v1/sessions/{sid}/calls",
        json={"template": "x {{output:y}}", "placeholders": [bad]},
        headers=headers,
    )
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("invalid output 'y' regex: ")
    batch = {"ops": [{"op": "submit_call", "template": "x {{output:y}}", "placeholders": [bad]}]}
    r = client.post(f"/v1/sessions/{sid}/batch", json=batch, headers=headers)
    assert r.status_code == 400 and "invalid output 'y' regex" in r.json()["error"]["message"]
    assert live.manager.sessions[sid].calls == {}
    good = {**bad, "sampling": {"max_tokens": 10, "constraint": {"choices": CHOICES}}}
    r = client.post(
        f"/v1/sessions/{sid}/calls",
        json={"template": "x {{output:y}}", "placeholders": [good]},
        headers=headers,
    )
    assert r.status_code == 201, r.text


@P.semantic_function
def as_json(
    topic: P.Input, data: P.Output(max_tokens=6, ignore_eos=True, transform=P.transforms.json_path("a"))
):
    """Topic: {{topic}} Data: {{data}}"""


@P.semantic_function
def echo(data: P.Input, again: P.Output(max_tokens=2)):
    """Again: {{data}} {{again}}"""


def test_a_failing_transform_names_the_call_and_keeps_the_raw_text(live: conftest.LiveServer) -> None:
    with P.connect(live.url) as s:
        data = as_json("birds")
        downstream = echo(data)
        with pytest.raises(P.ParrotError) as info:
            data.get(timeout=WAIT)
        with pytest.raises(P.ParrotError) as below:
            downstream.get(timeout=WAIT)
        with pytest.raises(P.ParrotError) as late:  # submitted once its input had failed
            echo(data).get(timeout=WAIT)
        graph = s.graph()
    error = info.value
    call = next(c for c in graph["calls"] if c["name"] == "as_json")
    raw = error.detail["raw_text"]
    assert error.code == "transform_failed" and len(raw) > 0
    assert error.message.startswith(
        f"call as_json ({call['call_id']}): the transform of output 'data' failed: "
    )
    assert repr(raw[:200]) in error.message
    assert (error.detail["function"], error.detail["output"], error.detail["call_id"]) == (
        "as_json",
        "data",
        call["call_id"],
    )
    assert call["state"] == "failed" and call["error"]["detail"]["raw_text"] == raw  # in the graph too
    for downstream_error in (below.value, late.value):  # the root cause travels downstream
        assert downstream_error.detail["raw_text"] == raw
        assert downstream_error.detail["origin_call"] == call["call_id"]

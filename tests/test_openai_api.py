"""The OpenAI-compatible ``/v1/completions`` and ``/v1/models`` routes, against a
real manager HTTP server on loopback with the tiny seeded engine embedded.

Each completion must run as one call of a short-lived internal session, so
every test also checks that no session is left behind.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import parrot as P
import tests.conftest as conftest
from parrot.engine.local import LocalEngine
from parrot.manager.api.app import create_app
from parrot.manager.backends.pool import EngineHandle
from parrot.manager.openai.completions import openai_router
from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.tokenizer import ChatFormat
from tests.slow_engine import slow_each_step

WAIT = 30.0


def _app_with_openai(manager: Manager):
    app = create_app(manager)
    if not any(getattr(r, "path", None) == "/v1/completions" for r in app.routes):
        app.include_router(openai_router(manager))
    return app


@pytest.fixture
def oa(
    tiny_engine: LocalEngine, manager_config: ManagerConfig, monkeypatch: pytest.MonkeyPatch
) -> Iterator[conftest.LiveServer]:
    monkeypatch.setattr(conftest, "create_app", _app_with_openai)
    manager = Manager(manager_config)
    manager.pool.register(tiny_engine, name="tiny")
    server = conftest.start_server(manager)
    yield server
    server.stop()


@pytest.fixture
def client(oa: conftest.LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=oa.url, timeout=WAIT) as c:
        yield c


def complete(client: httpx.Client, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny", "temperature": 0, **body}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(client: httpx.Client, **body: Any) -> list[Any]:
    """The decoded ``data:`` events of a streamed completion ("[DONE]" kept as a string)."""
    body = {"model": "tiny", "temperature": 0, "stream": True, **body}
    events: list[Any] = []
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    assert err["message"]
    return err


def no_sessions_soon(oa: conftest.LiveServer, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while oa.manager.sessions:
        assert time.monotonic() < deadline, f"sessions left behind: {list(oa.manager.sessions)}"
        time.sleep(0.02)


def engine_contexts(oa: conftest.LiveServer, engine: LocalEngine) -> int:
    return oa.run_on_loop(engine.stats()).num_contexts


# ----------------------------------------------------------------- completions


def test_completion_shape_and_usage(oa: conftest.LiveServer, client: httpx.Client) -> None:
    prompt = "The quick brown fox"
    body = complete(client, prompt=prompt, max_tokens=6, ignore_eos=True)
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert isinstance(body["created"], int)
    assert body["model"] == "tiny"
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["logprobs"] is None
    assert isinstance(choice["text"], str)
    assert choice["finish_reason"] == "length"
    # the tiny tokenizer is byte-level with no BOS: one prompt token per byte
    assert body["usage"] == {
        "prompt_tokens": len(prompt.encode()),
        "completion_tokens": 6,
        "total_tokens": 6 + len(prompt.encode()),
    }
    assert oa.manager.sessions == {}


def test_greedy_is_deterministic_and_matches_the_engine(
    oa: conftest.LiveServer, client: httpx.Client, tiny_engine: LocalEngine
) -> None:
    prompt = "Once upon a time"
    a = complete(client, prompt=prompt, max_tokens=10, ignore_eos=True)["choices"][0]["text"]
    b = complete(client, prompt=prompt, max_tokens=10, ignore_eos=True)["choices"][0]["text"]
    assert a == b
    assert direct_generate(oa, tiny_engine, prompt, 10) == a


def direct_generate(oa: conftest.LiveServer, engine: LocalEngine, prompt: str, n: int) -> str:
    """Greedy text for ``prompt`` straight from the engine (no manager, no template)."""

    async def run() -> str:
        ctx = EngineHandle.new_context_id()
        try:
            await engine.fill(engine.tokenizer.encode(prompt), ctx)
            parts = [
                c.text async for c in engine.generate(SamplingParams(max_tokens=n, ignore_eos=True), ctx)
            ]
        finally:
            await engine.free_context(ctx)
        return "".join(parts)

    return oa.run_on_loop(run())


def test_prompt_with_placeholder_syntax_is_passed_verbatim(
    oa: conftest.LiveServer, client: httpx.Client, tiny_engine: LocalEngine
) -> None:
    for prompt in ("Say {{x}} now", "{{output:text}}", "}} stray {{ open", "{{input:prompt}}{{"):
        body = complete(client, prompt=prompt, max_tokens=5, ignore_eos=True)
        assert body["usage"]["prompt_tokens"] == len(prompt.encode()), prompt
        assert body["choices"][0]["text"] == direct_generate(oa, tiny_engine, prompt, 5), prompt
    assert oa.manager.sessions == {}


def test_seeded_sampling_repeats(client: httpx.Client) -> None:
    kw = {
        "prompt": "Random:",
        "max_tokens": 8,
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": -1,
        "ignore_eos": True,
    }
    a = complete(client, seed=7, **kw)["choices"][0]["text"]
    b = complete(client, seed=7, **kw)["choices"][0]["text"]
    assert a == b


def test_stop_string_truncates(client: httpx.Client) -> None:
    full = complete(client, prompt="abc", max_tokens=12, ignore_eos=True)["choices"][0]["text"]
    stop = next((full[i : i + 2] for i in range(2, len(full) - 1) if "\ufffd" not in full[i : i + 2]), None)
    if stop is None:
        pytest.skip("the tiny model's greedy text has no clean two-character stop string")
    body = complete(client, prompt="abc", max_tokens=12, ignore_eos=True, stop=stop)
    assert body["choices"][0]["text"] == full[: full.find(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"
    body = complete(client, prompt="abc", max_tokens=12, ignore_eos=True, stop=[stop, "\x00never"])
    assert body["choices"][0]["text"] == full[: full.find(stop)]


def test_default_max_tokens_is_16(client: httpx.Client) -> None:
    body = complete(client, prompt="Hello", ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 16


def test_null_max_tokens_runs_up_to_the_context(
    oa: conftest.LiveServer, client: httpx.Client, tiny_engine: LocalEngine
) -> None:
    room = 5
    ids = [7] * (tiny_engine.max_seq_len - room)
    body = complete(client, prompt=ids, max_tokens=None, ignore_eos=True)
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": room,
        "total_tokens": tiny_engine.max_seq_len,
    }
    assert body["choices"][0]["finish_reason"] == "length"


def test_four_stop_strings_each_stop(client: httpx.Client) -> None:
    full = complete(client, prompt="abc", max_tokens=12, ignore_eos=True)["choices"][0]["text"]
    clean = [full[i : i + 2] for i in range(2, len(full) - 1) if "\ufffd" not in full[i : i + 2]]
    assert clean, "the tiny model's greedy text has no clean two-character stop string"
    first = clean[0]
    stops = ["\x00a", "\x00b", "\x00c", first]  # OpenAI's maximum: four
    body = complete(client, prompt="abc", max_tokens=12, ignore_eos=True, stop=stops)
    assert body["choices"][0]["text"] == full[: full.find(first)]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_models_lists_live_engines(client: httpx.Client) -> None:
    r = client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny"]
    assert body["data"][0]["object"] == "model"
    assert body["data"][0]["max_model_len"] > 0
    # the chat markup chat=True calls are wrapped in (the tiny model's: ChatML, no system turn)
    assert body["data"][0]["chat_format"] == dataclasses.asdict(ChatFormat.chatml())


@pytest.mark.parametrize("chat", [False, True])
def test_a_rendered_prompt_completes_like_the_semantic_function(
    oa: conftest.LiveServer, client: httpx.Client, chat: bool
) -> None:
    """A request-level client that sends ``fn.render(...)`` (chat-wrapped with the
    markup from /v1/models) gets what the call generates: the same prompt tokens."""
    fn = P.template_function(
        "  Facts: {{input:a}}\n\n{{input:b}} so {{output:c}}\n",
        chat=chat,
        c=P.Output(max_tokens=12, temperature=0.0, ignore_eos=True),
    )
    values = {"a": "Lighthouses warn ships.", "b": "{{not a placeholder}}"}
    with P.connect(oa.url) as session:
        via_parrot = session.call(fn, **values).get()
    chat_format = ChatFormat(**client.get("/v1/models").json()["data"][0]["chat_format"])
    prompt = fn.render(values, chat_format)
    assert ("<|im_start|>user\n" in prompt) == chat
    body = complete(client, prompt=prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert body["choices"][0]["text"] == via_parrot


# ------------------------------------------------------------------- streaming


def test_stream_concatenates_to_the_non_streamed_text(oa: conftest.LiveServer, client: httpx.Client) -> None:
    kw = {"prompt": "Streaming works", "max_tokens": 12, "ignore_eos": True}
    text = complete(client, **kw)["choices"][0]["text"]
    events = stream(client, **kw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["model"] == "tiny" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    no_sessions_soon(oa)


def test_stream_include_usage(oa: conftest.LiveServer, client: httpx.Client) -> None:
    events = stream(
        client, prompt="Count", max_tokens=5, ignore_eos=True, stream_options={"include_usage": True}
    )
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    no_sessions_soon(oa)


def test_stream_disconnect_closes_the_session_and_frees_the_context(
    oa: conftest.LiveServer, client: httpx.Client, tiny_engine: LocalEngine
) -> None:
    before = engine_contexts(oa, tiny_engine)
    body = {"model": "tiny", "prompt": "Go on", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                # streamed as generated: the first text arrives while the call still runs
                assert oa.manager.sessions
                break  # one chunk, then hang up
    no_sessions_soon(oa)
    deadline = time.monotonic() + WAIT
    while engine_contexts(oa, tiny_engine) > before:
        assert time.monotonic() < deadline, "the engine context of the abandoned call was not freed"
        time.sleep(0.05)
    # the server still works
    assert complete(client, prompt="after", max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2


def test_a_non_streaming_completion_is_cancelled_when_its_client_goes_away(
    oa: conftest.LiveServer, tiny_engine: LocalEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each engine step slowed by 3 ms, so the 1,900 tokens take at least 5.7 s whatever the
    # machine: far longer than the client's 0.5 s patience plus the server's disconnect poll
    slow_each_step(monkeypatch, tiny_engine, 0.003)
    before = engine_contexts(oa, tiny_engine)
    generated_before = oa.run_on_loop(tiny_engine.stats()).generated_tokens
    body = {"model": "tiny", "prompt": "Go on", "max_tokens": 1900, "ignore_eos": True}
    impatient = httpx.Client(base_url=oa.url, timeout=httpx.Timeout(10.0, read=0.5))
    with impatient, pytest.raises(httpx.ReadTimeout):
        impatient.post("/v1/completions", json=body)  # gives up and hangs up mid-generation
    no_sessions_soon(oa)
    deadline = time.monotonic() + WAIT
    while engine_contexts(oa, tiny_engine) > before:
        assert time.monotonic() < deadline, "the engine context of the abandoned call was not freed"
        time.sleep(0.05)
    generated = oa.run_on_loop(tiny_engine.stats()).generated_tokens
    time.sleep(0.5)
    assert oa.run_on_loop(tiny_engine.stats()).generated_tokens == generated  # it stopped ...
    assert generated - generated_before < 1900  # ... before its end
    with httpx.Client(base_url=oa.url, timeout=WAIT) as client:  # the server still works
        assert (
            complete(client, prompt="after", max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2
        )


def test_completion_frees_its_engine_context(
    oa: conftest.LiveServer, client: httpx.Client, tiny_engine: LocalEngine
) -> None:
    before = engine_contexts(oa, tiny_engine)
    complete(client, prompt="free me", max_tokens=3, ignore_eos=True)
    assert engine_contexts(oa, tiny_engine) == before


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("changes", "code"),
    [
        ({"n": 0}, "invalid_request"),
        ({"n": 17}, "invalid_request"),
        ({"n": 2, "best_of": 3}, "unsupported_parameter"),
        ({"best_of": 3}, "unsupported_parameter"),
        ({"n": 3, "best_of": 2}, "invalid_request"),
        ({"n": 16, "prompt": ["a"] * 9}, "invalid_request"),
        ({"prompt": ["a"] * 65}, "invalid_request"),
        ({"prompt": []}, "invalid_request"),
        ({"prompt": ["a", 1]}, "invalid_request"),
        ({"prompt": [[1, 2], "b"]}, "invalid_request"),
        ({"prompt": [1, True]}, "invalid_request"),
        ({"prompt": [1, -2]}, "invalid_token_id"),
        ({"prompt": [[1], [999999]]}, "invalid_token_id"),
        ({"prompt": [[]]}, "empty_prompt"),
        ({"prompt": list(range(2, 100)) * 30}, "context_too_long"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "invalid_request"),
        ({"logprobs": 6}, "invalid_request"),
        ({"suffix": "x"}, "unsupported_parameter"),
        ({"echo": True}, "unsupported_parameter"),
        ({"presence_penalty": 2.5}, "invalid_sampling"),
        ({"frequency_penalty": -2.01}, "invalid_sampling"),
        ({"logit_bias": {"50": 10}}, "unsupported_parameter"),
        ({"temperature": -1}, "invalid_sampling"),
        ({"top_p": 0}, "invalid_sampling"),
        ({"top_k": -2}, "invalid_sampling"),
        ({"max_tokens": 0}, "invalid_sampling"),
        ({"stop": [""]}, "invalid_sampling"),
        ({"stop_token_ids": [-1]}, "invalid_sampling"),
        ({"prompt": None}, "invalid_request"),
        ({"prompt": ""}, "empty_prompt"),
        ({"max_tokens": "many"}, "invalid_request"),
        ({"frobnicate": 1}, "invalid_request"),
        ({"stream_options": {"include_usage": True}}, "invalid_request"),
    ],
)
def test_bad_parameters_are_400(
    oa: conftest.LiveServer, client: httpx.Client, changes: dict[str, Any], code: str
) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **changes}
    assert_error(client.post("/v1/completions", json=body), 400, code)
    assert oa.manager.sessions == {}
    assert complete(client, prompt="still", max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2


def test_missing_prompt_is_400(client: httpx.Client) -> None:
    assert_error(client.post("/v1/completions", json={"model": "tiny"}), 400, "invalid_request")
    assert_error(client.post("/v1/completions", content=b"{not json"), 400, "invalid_request")


def test_unknown_model_is_503_no_engine(oa: conftest.LiveServer, client: httpx.Client) -> None:
    err = assert_error(
        client.post("/v1/completions", json={"model": "gpt-5", "prompt": "hi"}), 503, "no_engine"
    )
    assert "gpt-5" in err["message"]
    r = client.post("/v1/completions", json={"model": "gpt-5", "prompt": "hi", "stream": True})
    assert_error(r, 503, "no_engine")
    assert oa.manager.sessions == {}


def test_prompt_longer_than_the_context_is_400(oa: conftest.LiveServer, client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 5000, "max_tokens": 2})
    assert_error(r, 400, "context_too_long")
    assert oa.manager.sessions == {}


def test_model_may_be_omitted(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny"


def test_existing_sessions_are_untouched(oa: conftest.LiveServer, client: httpx.Client) -> None:
    r = client.post("/v1/sessions")
    assert r.status_code == 201
    sid = r.json()["session_id"]
    complete(client, prompt="side by side", max_tokens=3)
    assert list(oa.manager.sessions) == [sid]

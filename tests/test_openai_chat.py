"""``POST /v1/chat/completions`` against a real manager HTTP server on loopback with the
tiny seeded engine embedded (its tokenizer carries a ChatML Jinja template), the chat
template renderer on its own, and the official ``openai`` client against the server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

import tests.conftest as conftest
from parrot.protocol.chat_template import ChatMessage, render_chat
from parrot.protocol.errors import BadRequest
from parrot.protocol.tokenizer import ChatFormat, TextTokenizer

WAIT = 30.0


@pytest.fixture
def client(live: conftest.LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=WAIT) as c:
        yield c


def chat(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={"model": "tiny", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def events(client: httpx.Client, **body: Any) -> list[Any]:
    body = {"model": "tiny", "temperature": 0, "stream": True, **body}
    out: list[Any] = []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: "), line
                data = line[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def no_sessions_soon(live: conftest.LiveServer) -> None:
    deadline = time.monotonic() + WAIT
    while live.manager.sessions:
        assert time.monotonic() < deadline, f"sessions left behind: {list(live.manager.sessions)}"
        time.sleep(0.02)


HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
HELLO_PROMPT = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
)


# ------------------------------------------------------------------ rendering


def test_the_model_template_renders_the_conversation() -> None:
    tiny = TextTokenizer.byte_level_tiny()
    messages = [ChatMessage(m["role"], m["content"]) for m in HELLO]
    assert render_chat(tiny, messages) == HELLO_PROMPT
    turns = [*messages, ChatMessage("assistant", "Hello."), ChatMessage("user", "Bye")]
    rendered = render_chat(tiny, turns)
    assert rendered.startswith(HELLO_PROMPT[: -len("<|im_start|>assistant\n")])
    assert rendered.endswith(
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not render_chat(tiny, messages, add_generation_prompt=False).endswith("assistant\n")


def test_without_a_template_the_chat_format_marks_the_turns() -> None:
    tiny = TextTokenizer.byte_level_tiny()
    tiny.chat_template = None
    assert render_chat(tiny, [ChatMessage("user", "Hi there")]) == (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    tiny.chat = ChatFormat.chatml("You help.")  # a default system turn when none is given
    assert render_chat(tiny, [ChatMessage("user", "Q")]).startswith(
        "<|im_start|>system\nYou help.<|im_end|>\n"
    )
    tiny.chat = None
    with pytest.raises(BadRequest, match="no chat format") as info:
        render_chat(tiny, [ChatMessage("user", "Q")])
    assert info.value.code == "no_chat_format"


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{{ messages.__class__.__mro__ }}", "failed"),  # the sandbox refuses Python internals
        ("{{ messages.append(1) }}", "failed"),  # and changing what it is given
        ("{% for %}", "failed"),
    ],
)
def test_template_errors_are_the_clients_400(template: str, needle: str) -> None:
    tiny = TextTokenizer.byte_level_tiny()
    tiny.chat_template = template
    with pytest.raises(BadRequest, match=needle) as info:
        render_chat(tiny, [ChatMessage("user", "Hi")])
    assert info.value.status == 400 and info.value.code == "invalid_messages"


def test_a_bos_the_template_writes_is_not_doubled() -> None:
    tiny = TextTokenizer.byte_level_tiny()
    tiny.bos_token_id, tiny.add_bos = 257, True  # <|im_start|> as BOS, for the test
    tiny.chat_template = "{{ bos_token }}{{ messages[0]['content'] }}"
    assert render_chat(tiny, [ChatMessage("user", "Hi")]) == "Hi"
    tiny.add_bos = False
    assert render_chat(tiny, [ChatMessage("user", "Hi")]) == "<|im_start|>Hi"


# ----------------------------------------------------------------- the route


def test_chat_answers_what_a_completion_of_the_rendered_prompt_answers(
    live: conftest.LiveServer, client: httpx.Client
) -> None:
    body = chat(client, messages=HELLO, max_tokens=8, ignore_eos=True)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    completion = client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": HELLO_PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    ).json()
    assert choice["message"]["content"] == completion["choices"][0]["text"]
    assert body["usage"] == completion["usage"]
    assert body["usage"]["prompt_tokens"] == len(TextTokenizer.byte_level_tiny().encode(HELLO_PROMPT))
    no_sessions_soon(live)


def test_streamed_chat_gives_the_role_the_pieces_the_end_and_the_usage(
    live: conftest.LiveServer, client: httpx.Client
) -> None:
    whole = chat(client, messages=HELLO, max_tokens=12, ignore_eos=True)
    got = events(
        client, messages=HELLO, max_tokens=12, ignore_eos=True, stream_options={"include_usage": True}
    )
    assert got[-1] == "[DONE]"
    chunks = got[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finished = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finished] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    no_sessions_soon(live)


def test_text_parts_and_max_completion_tokens(client: httpx.Client) -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}
    ]
    a = chat(client, messages=parts, max_completion_tokens=5, ignore_eos=True)
    b = chat(client, messages=[{"role": "user", "content": "Hi there"}], max_tokens=5, ignore_eos=True)
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"messages": []}, 400, "invalid_request"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_messages"),
        ({"messages": HELLO, "n": 17}, 400, "invalid_request"),
        ({"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_request"),
        ({"messages": HELLO, "top_logprobs": 1}, 400, "invalid_request"),
        ({"messages": HELLO, "tools": [{"type": "function"}]}, 400, "unsupported_parameter"),
        ({"messages": HELLO, "response_format": {"type": "xml"}}, 400, "invalid_constraint"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "unsupported_parameter"),
        ({"messages": HELLO, "max_tokens": 3, "max_completion_tokens": 4}, 400, "invalid_request"),
        ({"messages": HELLO, "surprise": 1}, 400, "invalid_request"),
        ({"messages": HELLO, "model": "gpt-9"}, 503, "no_engine"),
    ],
)
def test_bad_requests_are_refused_and_leave_nothing_behind(
    live: conftest.LiveServer, client: httpx.Client, body: dict[str, Any], status: int, code: str
) -> None:
    r = client.post("/v1/chat/completions", json={"model": "tiny", **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert live.manager.sessions == {}
    assert chat(client, messages=HELLO, max_tokens=2)["usage"]["completion_tokens"] <= 2  # still serving


# ------------------------------------------------------- the official client


def test_the_official_openai_client_chats_and_streams(live: conftest.LiveServer) -> None:
    api = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=WAIT)
    reply = api.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert reply.choices[0].message.role == "assistant"
    assert isinstance(reply.choices[0].message.content, str)
    assert reply.usage is not None and reply.usage.completion_tokens <= 6
    pieces = api.chat.completions.create(
        model="tiny",
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in pieces:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == reply.choices[0].message.content and usage == reply.usage
    done = api.completions.create(model="tiny", prompt=HELLO_PROMPT, max_tokens=6, temperature=0)
    assert done.choices[0].text == reply.choices[0].message.content
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])  # type: ignore[misc, list-item]
    no_sessions_soon(live)

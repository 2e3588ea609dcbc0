"""``/v1/completions`` with several prompts, token-id prompts, ``n`` samples and penalties
(and chat with ``n``), driven by the official ``openai`` client against a real manager HTTP server on
loopback with the tiny seeded engine embedded.

The ``n`` samples of a prompt are forks of one filled context, so each request also checks
what the engine computed: one fill per prompt, however many samples."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

import tests.conftest as conftest
from parrot.engine.local import LocalEngine
from parrot.protocol.schemas import EngineStats
from tests.slow_engine import slow_each_step

WAIT = 30.0
PROMPTS = ["The quick brown fox", "Once upon a time", "Hello"]


@pytest.fixture
def api(live: conftest.LiveServer) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=WAIT)
    yield client
    client.close()


def stats(live: conftest.LiveServer, engine: LocalEngine) -> EngineStats:
    return live.run_on_loop(engine.stats())


def settled(live: conftest.LiveServer, engine: LocalEngine, contexts: int) -> float | None:
    """No session left behind, and the engine back to ``contexts`` contexts; returns when
    (``time.monotonic()``) the last session was seen closed while contexts remained, else None."""
    deadline = time.monotonic() + WAIT
    closed = None
    while live.manager.sessions or stats(live, engine).num_contexts > contexts:
        if closed is None and not live.manager.sessions:
            closed = time.monotonic()
        assert time.monotonic() < deadline, "a session or an engine context was left behind"
        time.sleep(0.02)
    return closed


def greedy(api: openai.OpenAI, prompt: str | list[int], max_tokens: int = 6) -> str:
    """The greedy answer to ``prompt`` alone, ``max_tokens`` long."""
    out = api.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def prompt_tokens(engine: LocalEngine, prompts: list[str]) -> int:
    tok = engine.tokenizer
    return sum(len(tok.encode(p)) + int(tok.add_bos) for p in prompts)


def test_a_list_of_prompts_answers_each_at_its_index(
    live: conftest.LiveServer, api: openai.OpenAI, tiny_engine: LocalEngine
) -> None:
    out = api.completions.create(
        model="tiny", prompt=PROMPTS, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [greedy(api, p) for p in PROMPTS]
    assert all(c.text and c.finish_reason == "length" for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens == 18
    assert out.usage.prompt_tokens == prompt_tokens(tiny_engine, PROMPTS)
    settled(live, tiny_engine, 0)


def test_token_id_prompts_read_like_their_text(
    live: conftest.LiveServer, api: openai.OpenAI, tiny_engine: LocalEngine
) -> None:
    tok = tiny_engine.tokenizer
    ids = [([tok.bos_token_id] if tok.add_bos else []) + tok.encode(p) for p in PROMPTS[:2]]
    one = api.completions.create(model="tiny", prompt=ids[0], max_tokens=6, temperature=0)
    assert one.choices[0].text == greedy(api, PROMPTS[0])
    assert one.usage is not None and one.usage.prompt_tokens == len(ids[0])
    many = api.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in many.choices] == [greedy(api, p) for p in PROMPTS[:2]]
    settled(live, tiny_engine, 0)


def test_bad_token_ids_are_400_and_disturb_nothing(
    live: conftest.LiveServer, api: openai.OpenAI, tiny_engine: LocalEngine
) -> None:
    vocab = tiny_engine.tokenizer.vocab_size
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="tiny", prompt=[[1, 2], [3, vocab]], max_tokens=2)
    assert info.value.status_code == 400 and f"token id {vocab}" in str(info.value)
    with pytest.raises(openai.BadRequestError, match="context"):
        api.completions.create(model="tiny", prompt=[5] * tiny_engine.max_seq_len, max_tokens=2)
    assert live.manager.sessions == {}
    assert greedy(api, [1, 2, 3], max_tokens=2) == greedy(api, [1, 2, 3], max_tokens=2)


def test_a_refused_prompt_refuses_the_whole_request(
    live: conftest.LiveServer, api: openai.OpenAI, tiny_engine: LocalEngine
) -> None:
    with pytest.raises(openai.BadRequestError, match="context"):
        api.completions.create(model="tiny", prompt=["fine", "x" * 5000], max_tokens=2)
    assert live.manager.sessions == {}  # the first prompt's call went with its session
    settled(live, tiny_engine, 0)
    assert greedy(api, "fine", max_tokens=2)  # the server still answers


def test_n_samples_fork_one_filled_prompt(
    live: conftest.LiveServer, api: openai.OpenAI, tiny_engine: LocalEngine
) -> None:
    before = stats(live, tiny_engine)
    out = api.completions.create(
        model="tiny", prompt=PROMPTS[:2], n=3, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = stats(live, tiny_engine)
    assert after.fills - before.fills == 2  # one fill per prompt, not per sample
    assert after.filled_tokens - before.filled_tokens == prompt_tokens(tiny_engine, PROMPTS[:2])
    assert after.generates - before.generates == 6
    assert [c.index for c in out.choices] == list(range(6))
    # greedy samples agree; prompt p's samples are choices p*n .. p*n+n-1
    for p, prompt in enumerate(PROMPTS[:2]):
        texts = [c.text for c in out.choices[p * 3 : p * 3 + 3]]
        assert texts == [greedy(api, prompt, max_tokens=5)] * 3
    assert out.usage is not None and out.usage.completion_tokens == 30
    settled(live, tiny_engine, 0)


def test_seeded_samples_are_reproducible_and_sample_j_uses_seed_plus_j(
    live: conftest.LiveServer, api: openai.OpenAI, tiny_engine: LocalEngine
) -> None:
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0, "seed": 41}
    first = api.completions.create(n=4, extra_body={"ignore_eos": True}, **body)
    again = api.completions.create(n=4, extra_body={"ignore_eos": True}, **body)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) > 1  # the samples differ
    body["seed"] = 42
    single = api.completions.create(n=1, extra_body={"ignore_eos": True}, **body)
    assert single.choices[0].text == texts[1]
    settled(live, tiny_engine, 0)


def test_streamed_choices_interleave_by_index(
    live: conftest.LiveServer, api: openai.OpenAI, tiny_engine: LocalEngine
) -> None:
    body = {"model": "tiny", "prompt": PROMPTS[:2], "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 7}
    whole = api.completions.create(extra_body={"ignore_eos": True}, **body)
    texts = ["", "", "", ""]
    finished: list[int] = []
    chunks = list(
        api.completions.create(
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **body
        )
    )
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert choice.index not in finished  # nothing after a choice's end
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            assert choice.finish_reason == "length"
            finished.append(choice.index)
    assert sorted(finished) == [0, 1, 2, 3]
    assert texts == [c.text for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    settled(live, tiny_engine, 0)


def test_chat_with_n_samples(live: conftest.LiveServer, api: openai.OpenAI, tiny_engine: LocalEngine) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi there"}],
        "n": 3,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 3,
        "extra_body": {"ignore_eos": True},
    }
    out = api.chat.completions.create(**body)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens == 18
    streamed = ["", "", ""]
    roles = set()
    for chunk in api.chat.completions.create(stream=True, **body):
        (choice,) = chunk.choices
        if choice.delta.role:
            roles.add(choice.index)
        streamed[choice.index] += choice.delta.content or ""
    assert roles == {0, 1, 2}
    assert streamed == [c.message.content for c in out.choices]
    settled(live, tiny_engine, 0)


def test_an_abandoned_n_request_frees_every_fork(
    live: conftest.LiveServer,
    tiny_engine: LocalEngine,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # each engine step slowed by 10 ms: 1,500 steps take at least 15 s, far longer than the
    # client's patience (0.5 s) plus the server's disconnect poll, even on a loaded machine
    slow_each_step(monkeypatch, tiny_engine, 0.01)
    caplog.set_level(logging.INFO, logger="parrot.manager.openai.response")
    before = stats(live, tiny_engine).generated_tokens  # the engine is shared with earlier tests
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=0.5)
    started = time.monotonic()
    with client, pytest.raises(openai.APITimeoutError):
        client.completions.create(
            model="tiny", prompt="Go on", n=4, max_tokens=1500, extra_body={"ignore_eos": True}
        )
    gave_up = time.monotonic() - started
    closed_at = settled(live, tiny_engine, 0)  # when the manager had closed the request's session
    stopped = time.monotonic() - started
    generated = stats(live, tiny_engine).generated_tokens
    time.sleep(0.3)
    assert stats(live, tiny_engine).generated_tokens == generated  # nothing runs on
    # ... and it stopped before the forks' end; if not, say which layer missed it
    seen = "the client went away" in caplog.text
    timing = (
        f"client gave up after {gave_up:.2f} s; the manager saw it: {seen}; session closed after "
        f"{'-' if closed_at is None else f'{closed_at - started:.2f}'} s; engine idle after {stopped:.2f} s"
    )
    assert generated - before < 4 * 1500, timing
    assert seen, timing


def test_penalties_reach_the_engines_sampler(
    live: conftest.LiveServer, api: openai.OpenAI, tiny_engine: LocalEngine
) -> None:
    plain = greedy(api, PROMPTS[0], max_tokens=24)
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}
    penalised = api.completions.create(frequency_penalty=2.0, extra_body={"ignore_eos": True}, **body)
    assert penalised.choices[0].text != plain  # the tiny model's greedy text repeats itself
    again = api.completions.create(frequency_penalty=2.0, extra_body={"ignore_eos": True}, **body)
    assert again.choices[0].text == penalised.choices[0].text
    chat = api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        presence_penalty=1.0,
        frequency_penalty=-1.0,
        temperature=0,
    )
    assert chat.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        api.completions.create(presence_penalty=-2.5, **body)
    settled(live, tiny_engine, 0)

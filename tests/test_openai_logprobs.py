"""Logprobs: the engine's per-token logprobs (in-process and over the engine's HTTP API as
the manager reads it), and ``/v1/completions`` ``logprobs`` / chat ``logprobs`` +
``top_logprobs`` in OpenAI's shapes, parsed by the official ``openai`` client against a
real manager HTTP server on loopback with the tiny seeded engine embedded."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch

import tests.conftest as conftest
from parrot.engine.local import LocalEngine
from parrot.engine.sampler import logprobs_of, token_logprobs
from parrot.protocol.errors import InvalidSampling
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import GenerateChunk

WAIT = 30.0


@pytest.fixture
def api(live: conftest.LiveServer) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=WAIT)
    yield client
    client.close()


# ------------------------------------------------------------------ the sampler


def test_token_logprobs_are_the_log_softmax_and_its_top_k() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    got = token_logprobs(logits, [2, 3], [2, 0])
    logp = torch.log_softmax(logits, dim=-1)
    assert got[0].token_id == 2 and math.isclose(got[0].logprob, float(logp[0, 2]), rel_tol=1e-6)
    assert [t for t, _ in got[0].top] == [1, 2]
    assert [lp for _, lp in got[0].top] == pytest.approx([float(logp[0, 1]), float(logp[0, 2])])
    assert got[1].top == [] and math.isclose(got[1].logprob, float(logp[1, 3]), rel_tol=1e-6)
    mixed = logprobs_of(logits, [SamplingParams(), SamplingParams(logprobs=1)], [1, 2])
    assert mixed[0] is None and mixed[1] is not None and mixed[1].top[0][0] == 2


@pytest.mark.parametrize("value", [-1, 21, True, 1.5])
def test_logprobs_outside_0_to_20_are_invalid(value: object) -> None:
    with pytest.raises(InvalidSampling, match="logprobs"):
        SamplingParams(logprobs=value)  # type: ignore[arg-type]


def test_logprobs_stay_off_the_wire_unless_asked() -> None:
    assert "logprobs" not in SamplingParams().to_dict()
    assert SamplingParams(logprobs=0).to_dict()["logprobs"] == 0


# ------------------------------------------------------------------- the engine


async def _generate(engine: LocalEngine, sampling: SamplingParams) -> list[GenerateChunk]:
    ctx = 77_001
    await engine.fill(engine.tokenizer.encode("The quick brown fox"), ctx)
    try:
        return [c async for c in engine.generate(sampling, ctx)]
    finally:
        await engine.free_context(ctx)


def test_the_engine_reports_one_entry_per_token_and_greedy_picks_the_top(tiny_engine: LocalEngine) -> None:
    plain = asyncio.run(_generate(tiny_engine, SamplingParams(max_tokens=6, ignore_eos=True)))
    chunks = asyncio.run(_generate(tiny_engine, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3)))
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == [t for c in plain for t in c.token_ids]  # asking for logprobs changes no token
    assert all(c.logprobs is None for c in plain)
    entries = [e for c in chunks for e in c.logprobs or []]
    assert [e.token_id for e in entries] == ids
    for e in entries:
        assert len(e.top) == 3 and e.top[0] == (e.token_id, pytest.approx(e.logprob))  # greedy: the argmax
        assert e.logprob <= 0 and [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)


# -------------------------------------------------------------- the OpenAI API


def test_completion_logprobs_parse_and_match_the_text(live: conftest.LiveServer, api: openai.OpenAI) -> None:
    out = api.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token in top and top[token] == pytest.approx(logprob) and logprob == max(top.values())
    plain = api.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None
    assert live.manager.sessions == {}


def test_streamed_completion_logprobs_add_up_to_the_whole(api: openai.OpenAI) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    whole = api.completions.create(extra_body={"ignore_eos": True}, **body).choices[0].logprobs
    tokens: list[str] = []
    logprobs: list[float | None] = []
    offsets: list[int] = []
    for chunk in api.completions.create(stream=True, extra_body={"ignore_eos": True}, **body):
        lp = chunk.choices[0].logprobs
        assert lp is not None
        tokens += lp.tokens or []
        logprobs += lp.token_logprobs or []
        offsets += lp.text_offset or []
    assert whole is not None
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert logprobs == pytest.approx(whole.token_logprobs)


def test_chat_logprobs_and_top_logprobs(live: conftest.LiveServer, api: openai.OpenAI) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi there"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "extra_body": {"ignore_eos": True},
    }
    out = api.chat.completions.create(top_logprobs=3, **body)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 4
    assert "".join(t.token for t in lp.content) == out.choices[0].message.content
    for t in lp.content:
        assert t.bytes == list(t.token.encode("utf-8", "surrogatepass")) and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
    streamed = []
    for chunk in api.chat.completions.create(stream=True, **body):
        clp = chunk.choices[0].logprobs
        streamed += [t.token for t in clp.content or []] if clp is not None else []
    assert streamed == [t.token for t in lp.content]
    assert live.manager.sessions == {}


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("completions", {"prompt": "hi", "logprobs": 6}),
        ("completions", {"prompt": "hi", "logprobs": -1}),
        ("chat", {"logprobs": True, "top_logprobs": 21}),
        ("chat", {"top_logprobs": 2}),
    ],
)
def test_bad_logprobs_are_400(
    live: conftest.LiveServer, api: openai.OpenAI, route: str, body: dict[str, object]
) -> None:
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        if route == "completions":
            api.completions.create(model="tiny", max_tokens=2, **body)  # type: ignore[call-overload]
        else:
            api.chat.completions.create(
                model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}], **body
            )  # type: ignore[call-overload]
    assert live.manager.sessions == {}
    assert api.completions.create(model="tiny", prompt="hi", max_tokens=2, logprobs=0).choices[0].logprobs

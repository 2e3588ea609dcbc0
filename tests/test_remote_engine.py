"""Separate engine processes, end to end: real ``parrot serve --no-engine``
and ``parrot engine --manager URL --model tiny`` processes on loopback.

Registration and heartbeats, an application served through a remote engine
(same greedy outputs as the embedded engine), an engine killed or frozen
mid-generation (calls fail promptly, never hang; the engine is dropped; a
frozen engine re-registers when it resumes), and the engine's own HTTP API.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import parrot as P
from parrot.engine.loader import LoadedModel
from parrot.engine.local import LocalEngine
from parrot.manager.backends.pool import EngineHandle
from parrot.manager.backends.remote_engine import RemoteEngine
from parrot.protocol.schemas import TokenLogprob
from parrot.protocol.tokenizer import TextTokenizer
from tests.procs import OPERATOR, TEST_CLUSTER_SECRET, Proc, Procs, engine_by_url, engines, wait_until

# Short heartbeats for the failure tests: an engine is dropped ~2.5 s after it goes silent.
HB_INTERVAL, HB_TIMEOUT = 0.3, 2.5
PROMPT_TOKENS = 8

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    started = Procs(tmp_path)
    try:
        yield started
    finally:
        started.kill_all()
        for proc in started.started:  # shown by pytest only when the test failed
            print(proc.describe())


# ------------------------------------------------------------------ the app
@P.semantic_function
def idea(topic: P.Input, a: P.Output(max_tokens=PROMPT_TOKENS, ignore_eos=True)):
    """Topic: {{topic}}. Idea: {{a}}"""


@P.semantic_function
def plan(a: P.Input, b: P.Output(max_tokens=PROMPT_TOKENS, ignore_eos=True)):
    """Idea: {{a}}. Plan: {{b}}"""


@P.semantic_function
def verdict(a: P.Input, b: P.Input, c: P.Output(max_tokens=PROMPT_TOKENS, ignore_eos=True)):
    """Idea {{a}}, plan {{b}}, verdict: {{c}}"""


@P.semantic_function
def ramble(topic: P.Input, text: P.Output(max_tokens=1900, ignore_eos=True)):
    """Ramble on {{topic}}: {{text}}"""


@P.semantic_function
def summary(text: P.Input, s: P.Output(max_tokens=4)):
    """Summary of {{text}}: {{s}}"""


def call_of(session: P.Session, var: P.SemanticVariable) -> dict:
    """The manager's CallInfo of the call producing ``var``."""
    headers = {"Authorization": f"Bearer {session.token}"}
    base = f"{session.url}/v1/sessions/{session.session_id}"
    info = httpx.get(f"{base}/variables/{var.id}", headers=headers, timeout=10).json()
    resp = httpx.get(f"{base}/calls/{info['producer']}", headers=headers, timeout=10)
    resp.raise_for_status()
    return resp.json()


def run_chain(url: str) -> tuple[list[str], list[dict]]:
    with P.connect(url) as s:
        a = idea("parrots")
        b = plan(a)
        c = verdict(a, b)
        values = [v.get(timeout=60) for v in (a, b, c)]
        return values, [call_of(s, v) for v in (a, b, c)]


def start_rambling(s: P.Session) -> tuple[P.SemanticVariable, P.SemanticVariable]:
    """Submit a long generation and its consumer; return once tokens are streaming."""
    text = ramble("everything")
    down = summary(text)
    wait_until(
        lambda: call_of(s, text)["generated_tokens"] >= 20,
        30,
        lambda: f"the long generation never got going: {call_of(s, text)}",
    )
    return text, down


def expect_failure(var: P.SemanticVariable, within: float, wait: float = 20) -> tuple[P.ParrotError, float]:
    """``var.get()`` must raise a real failure (not the client's own timeout) within ``within`` s."""
    t0 = time.monotonic()
    with pytest.raises(P.ParrotError) as info:
        var.get(timeout=wait)
    elapsed = time.monotonic() - t0
    err = info.value
    assert not isinstance(err, P.Timeout), f"get() hung until its own timeout: {err!r}"
    assert isinstance(err, (P.EngineError, P.CallFailed, P.NoEngine)), repr(err)
    assert elapsed < within, f"failure took {elapsed:.2f}s (limit {within}s): {err!r}"
    return err, elapsed


# -------------------------------------------------------------------- tests
def test_engine_registers_heartbeats_and_serves_an_app_like_the_embedded_engine(
    procs: Procs, live, tiny_model: LoadedModel
):
    mgr = procs.manager(heartbeat_interval=0.3, heartbeat_timeout=5)
    eng = procs.engine(mgr)
    [info] = engines(mgr)
    assert info["url"] == eng.url
    assert info["model"] == tiny_model.name == "tiny"
    assert info["alive"] is True
    assert info["max_seq_len"] == tiny_model.config.max_seq_len
    assert info["stats"]["generates"] == 0
    engine_id = info["engine_id"]

    values, calls = run_chain(mgr.url)
    for call in calls:
        assert call["state"] == "done", call
        assert call["engine_id"] == engine_id, call
        assert call["generated_tokens"] == PROMPT_TOKENS, call
        assert call["error"] is None
        # the engine's fills said over HTTP how many prompt tokens its prefix cache gave
        assert isinstance(call["prefix_reused_tokens"], int) and call["prefix_reused_tokens"] >= 0, call
        assert call["prefix_reused_tokens"] + call["filled_tokens"] == call["prompt_tokens"], call
    assert all(values), values

    # The manager never polls a remote engine: only heartbeats can carry its stats.
    stats = wait_until(
        lambda: (s := engine_by_url(mgr, eng.url)["stats"])["generates"] >= 3 and s,
        5,
        lambda: f"heartbeats never reported the work: {engines(mgr)}\n{eng.describe()}",
    )
    assert stats["generated_tokens"] >= 3 * PROMPT_TOKENS
    assert stats["fills"] >= 3 and stats["filled_tokens"] > 0
    assert stats["num_running"] == 0

    # Same seeded model, greedy: the embedded engine must produce the very same texts.
    embedded_values, embedded_calls = run_chain(live.url)
    [embedded] = live.manager.pool
    assert embedded.url is None
    assert [c["engine_id"] for c in embedded_calls] == [embedded.engine_id] * 3
    assert values == embedded_values


def test_killed_engine_fails_its_calls_promptly_and_is_dropped(procs: Procs):
    mgr = procs.manager(heartbeat_interval=HB_INTERVAL, heartbeat_timeout=HB_TIMEOUT)
    eng = procs.engine(mgr)
    engine_id = engine_by_url(mgr, eng.url)["engine_id"]

    with P.connect(mgr.url) as s:
        for _ in range(3):
            text, down = start_rambling(s)
            eng.signal(signal.SIGSTOP)  # frozen: the ramble cannot finish while it is looked at
            if call_of(s, text)["state"] == "running":
                break
            eng.signal(signal.SIGCONT)  # it outran the poll (a loaded machine): another one
        else:
            pytest.fail(f"every ramble finished before the engine could be stopped: {call_of(s, text)}")
        eng.signal(signal.SIGKILL)
        killed_at = time.monotonic()

        # The generate stream breaks at once (not at the heartbeat timeout); with no
        # other engine to re-run it on within --engine-wait (1 s here), the call fails.
        err, _ = expect_failure(text, within=min(5.0, HB_TIMEOUT))
        assert isinstance(err, P.NoEngine) and "lost its engine" in err.message, repr(err)
        assert "dropped" not in err.message, (
            f"failed by the heartbeat timeout, not the broken stream: {err!r}"
        )
        down_err, _ = expect_failure(down, within=2.0)
        assert down_err.code == "no_engine", repr(down_err)
        assert down_err.detail.get("origin_call") == call_of(s, text)["call_id"]

        ramble_call, summary_call = call_of(s, text), call_of(s, down)
        assert ramble_call["state"] == "failed" and ramble_call["engine_id"] == engine_id
        assert ramble_call["error"]["code"] == "no_engine"
        assert 20 <= ramble_call["generated_tokens"] < 1900, ramble_call
        assert summary_call["state"] == "failed" and summary_call["engine_id"] is None

    wait_until(
        lambda: not engines(mgr),
        HB_TIMEOUT + 5,
        lambda: f"the dead engine is still listed: {engines(mgr)}\n{mgr.describe()}",
    )
    gone_after = time.monotonic() - killed_at
    assert gone_after >= HB_TIMEOUT / 2, f"dropped after only {gone_after:.2f}s"

    # No engine at all: a call fails with no_engine right away.
    with P.connect(mgr.url) as s:
        t0 = time.monotonic()
        with pytest.raises(P.NoEngine) as info:
            idea("nobody home").get(timeout=20)
        assert time.monotonic() - t0 < 3
    assert info.value.code == "no_engine"


def test_frozen_engine_is_dropped_then_reregisters_when_it_resumes(procs: Procs):
    mgr = procs.manager(heartbeat_interval=HB_INTERVAL, heartbeat_timeout=HB_TIMEOUT)
    eng = procs.engine(mgr)
    first_id = engine_by_url(mgr, eng.url)["engine_id"]

    with P.connect(mgr.url) as s:
        text, _ = start_rambling(s)
        eng.signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        # The engine holds the connection open but says nothing: only the
        # heartbeat timeout can end the call, and then it must.
        err, elapsed = expect_failure(text, within=HB_TIMEOUT + 5)
        assert elapsed >= HB_TIMEOUT / 2, f"failed after only {elapsed:.2f}s: {err!r}"
        assert isinstance(err, P.NoEngine) and "dropped" in err.message, repr(err)
        assert call_of(s, text)["state"] == "failed"

    assert engine_by_url(mgr, eng.url) is None, engines(mgr)
    assert time.monotonic() - stopped_at >= HB_TIMEOUT / 2

    eng.signal(signal.SIGCONT)
    again = wait_until(
        lambda: engine_by_url(mgr, eng.url),
        10,
        lambda: f"the resumed engine never re-registered\n{eng.describe()}\n{mgr.describe()}",
    )
    assert again["engine_id"] != first_id and again["alive"] is True
    assert len(engines(mgr)) == 1

    # The resumed engine stops the orphaned generation (its manager hung up) and
    # frees the context the manager gave up on when it dropped the engine.
    def engine_stats() -> dict:
        return httpx.get(f"{eng.url}/stats", timeout=10, headers=OPERATOR).json()

    stats = wait_until(
        lambda: (st := engine_stats())["num_running"] == 0 and st["num_contexts"] == 0 and st,
        10,
        lambda: f"orphaned work left on the engine: {engine_stats()}\n{eng.describe()}",
    )
    assert stats["kv_tokens_used"] == 0, stats
    assert stats["generated_tokens"] < 1000, f"the orphaned generation was not cut short: {stats}"
    # ... and serves again, under its new id.
    values, calls = run_chain(mgr.url)
    assert all(values)
    assert [c["engine_id"] for c in calls] == [again["engine_id"]] * 3
    assert [c["state"] for c in calls] == ["done"] * 3


# ------------------------------------------------------- engine HTTP API
def _post(eng: Proc, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{eng.url}{path}", json=body, timeout=30, headers=OPERATOR)


def _generate(eng: Proc, body: dict) -> tuple[httpx.Response, list[dict]]:
    resp = _post(eng, "/generate", body)
    lines = [json.loads(line) for line in resp.text.splitlines() if line.strip()]
    return resp, lines


def _error_code(resp: httpx.Response, lines: list[dict]) -> str:
    """The error of a generate that must fail: a 4xx JSON body, or one final error line."""
    if resp.status_code != 200:
        assert 400 <= resp.status_code < 500, resp.text
        return resp.json()["error"]["code"]
    assert resp.headers["content-type"].startswith("application/x-ndjson")
    assert len(lines) == 1 and lines[0]["done"] is True and lines[0]["token_ids"] == [], lines
    assert lines[0]["error"] is not None, lines
    return lines[0]["error"]["code"]


async def _local_tokens(
    engine: LocalEngine, tokens: list[int], steps: list[int], sampling: P.SamplingParams | None = None
) -> list[list[int]]:
    """What the in-process tiny engine generates: fill ``tokens`` then generate ``steps`` in
    turn (greedily, or with ``sampling`` but for its ``max_tokens``)."""
    cid = EngineHandle.new_context_id()
    await engine.fill(tokens, cid)
    out = []
    for n in steps:
        ids: list[int] = []
        sp = P.SamplingParams(max_tokens=n, ignore_eos=True)
        if sampling is not None:
            sp = dataclasses.replace(sampling, max_tokens=n)
        async for chunk in engine.generate(sp, cid):
            ids += chunk.token_ids
        out.append(ids)
    await engine.free_context(cid)
    return out


def test_engine_http_api(procs: Procs, tiny_model: LoadedModel, tiny_engine: LocalEngine):
    mgr = procs.manager()
    eng = procs.engine(mgr)

    health = httpx.get(f"{eng.url}/healthz", timeout=10).json()
    assert health == {"ok": True, "model": tiny_model.name}
    tok = httpx.get(f"{eng.url}/tokenizer", timeout=10, headers=OPERATOR).json()
    assert tok["model"] == tiny_model.name and tok["max_seq_len"] == tiny_model.config.max_seq_len
    tokenizer = TextTokenizer.from_dict(tok["tokenizer"])
    assert tokenizer.encode("Hello, parrot!") == tiny_model.tokenizer.encode("Hello, parrot!")

    prompt = tokenizer.encode("Once upon a time")
    extra = tokenizer.encode(", far away")
    a, b = 10_001, 10_002
    assert _post(eng, "/fill", {"tokens": prompt, "context_id": a}).json() == {"ok": True, "cached_tokens": 0}
    # b forks a's current KV (the prompt) and appends more tokens
    resp = _post(eng, "/fill", {"tokens": extra, "context_id": b, "parent_context_id": a})
    assert resp.status_code == 200, resp.text

    greedy = P.SamplingParams(max_tokens=6, ignore_eos=True).to_dict()
    resp, lines = _generate(eng, {"sampling": greedy, "context_id": a})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/x-ndjson")
    assert [ln["done"] for ln in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["finish_reason"] == "length" and all(ln["error"] is None for ln in lines)
    from_a = [t for ln in lines for t in ln["token_ids"]]
    from_b = [t for ln in _generate(eng, {"sampling": greedy, "context_id": b})[1] for t in ln["token_ids"]]

    [local_a] = asyncio.run(_local_tokens(tiny_engine, prompt, [6]))
    local_b, local_b_more = asyncio.run(_local_tokens(tiny_engine, prompt + extra, [6, 3]))
    assert from_a == local_a and len(from_a) == 6
    assert from_b == local_b

    stats = httpx.get(f"{eng.url}/stats", timeout=10, headers=OPERATOR).json()
    assert stats["num_contexts"] == 2 and stats["num_running"] == 0
    assert stats["fills"] == 2 and stats["filled_tokens"] == len(prompt) + len(extra)
    assert stats["generates"] == 2 and stats["generated_tokens"] == 12

    # ---- bad input: exact statuses and codes, and nothing changes
    resp = _post(eng, "/fill", {"tokens": [1], "context_id": 10_003, "parent_context_id": 99_999})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "context_not_found", resp.text
    vocab = tiny_model.config.vocab_size
    for bad in ([vocab], [-1], [1, 2, vocab + 1000]):
        resp = _post(eng, "/fill", {"tokens": bad, "context_id": a})
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_tokens", resp.text
    resp = _post(eng, "/fill", {"tokens": [1], "context_id": a, "surprise": True})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request", resp.text
    resp = _post(eng, "/generate", {"sampling": {"max_tokens": 0}, "context_id": a})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_sampling", resp.text
    code = _error_code(*_generate(eng, {"sampling": greedy, "context_id": 10_004}))
    assert code in ("context_not_found", "bad_request")
    code = _error_code(
        *_generate(eng, {"sampling": greedy, "context_id": 10_005, "parent_context_id": 99_999})
    )
    assert code == "context_not_found"
    resp = _post(eng, "/free_context", {"context_id": 99_999})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "context_not_found", resp.text
    after = httpx.get(f"{eng.url}/stats", timeout=10, headers=OPERATOR).json()
    assert after["fills"] == stats["fills"] and after["filled_tokens"] == stats["filled_tokens"]

    for bad in ({"token_capacity": "many"}, {"token_capacity": 1.5}, {}, {"token_capacity": 8, "x": 1}):
        resp = _post(eng, "/token_capacity", bad)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request", resp.text
    resp = _post(eng, "/token_capacity", {"token_capacity": 4096})
    assert resp.status_code == 200 and resp.json()["token_capacity"] == 4096, resp.text

    # ---- free: a is gone for new forks, but its child b keeps reading the shared prefix
    assert _post(eng, "/free_context", {"context_id": a}).json() == {"ok": True}
    resp = _post(eng, "/fill", {"tokens": [1], "context_id": 10_006, "parent_context_id": a})
    assert resp.status_code == 404, resp.text
    more = _generate(
        eng, {"sampling": P.SamplingParams(max_tokens=3, ignore_eos=True).to_dict(), "context_id": b}
    )
    assert [t for ln in more[1] for t in ln["token_ids"]] == local_b_more
    assert _post(eng, "/free_context", {"context_id": b}).status_code == 200

    # ---- a fill says how many of its tokens came from the prefix cache: whole blocks,
    # never the last token
    long = tokenizer.encode("the lamp in the lighthouse turns all night " * 12)
    block = stats["kv_block_size"]
    first = _post(eng, "/fill", {"tokens": long, "context_id": 10_007}).json()
    again = _post(eng, "/fill", {"tokens": long, "context_id": 10_008}).json()
    assert first == {"ok": True, "cached_tokens": 0}
    assert again == {"ok": True, "cached_tokens": (len(long) - 1) // block * block} and len(long) > 2 * block
    for ctx in (10_007, 10_008):
        assert _post(eng, "/free_context", {"context_id": ctx}).status_code == 200

    # ---- the manager's client for this API rebuilds the engine's errors
    async def through_remote_engine() -> None:
        remote = await RemoteEngine.connect(str(eng.url), cluster_secret=TEST_CLUSTER_SECRET)
        try:
            assert remote.model_name == tiny_model.name
            with pytest.raises(P.NotFound) as info:
                await remote.fill([1, 2], 10_007, parent_context_id=99_999)
            assert info.value.code == "context_not_found"
            with pytest.raises(P.BadRequest) as info:
                await remote.fill([vocab], 10_007)
            assert info.value.code == "invalid_tokens"
            with pytest.raises(P.ParrotError) as info:
                async for _ in remote.generate(P.SamplingParams(max_tokens=2), 10_008, 99_999):
                    pass
            assert info.value.code == "context_not_found"
            # token capacity: switched at run time; bad values rejected, the old one kept
            await remote.set_token_capacity(300)
            assert (await remote.stats()).token_capacity == 300
            for bad in (0, -5):
                with pytest.raises(P.BadRequest) as info:
                    await remote.set_token_capacity(bad)
                assert info.value.code == "invalid_capacity"
            assert (await remote.stats()).token_capacity == 300
            # a fill's cache salt travels: only contexts of the same salt share cached blocks
            long = [3 + i % (vocab - 3) for i in range(40)]
            hits = []
            for context_id, salt in ((10_010, "alice"), (10_011, "bob"), (10_012, "alice")):
                before = (await remote.stats()).cached_tokens
                await remote.fill(long, context_id, cache_salt=salt)
                async for _ in remote.generate(P.SamplingParams(max_tokens=1), context_id):
                    pass
                hits.append((await remote.stats()).cached_tokens - before)
                await remote.free_context(context_id)
            assert hits == [0, 0, 32]
            # penalties travel too, and sample as in the in-process engine
            await remote.fill(prompt, 10_013)
            got = [t async for c in remote.generate(penalised, 10_013) for t in c.token_ids]
            assert got == local_penalised and got != local_plain
            await remote.free_context(10_013)
            # and so do logprobs: one entry per token, as the in-process engine gives them
            await remote.fill(prompt, 10_014)
            chunks = [c async for c in remote.generate(with_logprobs, 10_014)]
            await remote.free_context(10_014)
            entries = [e for c in chunks for e in c.logprobs or []]
            assert (
                [e.token_id for e in entries] == [t for c in chunks for t in c.token_ids] == local_plain[:4]
            )
            assert [(e.logprob, e.top) for e in entries] == [(e.logprob, e.top) for e in local_entries]
        finally:
            await remote.close()

    penalised = P.SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=0.5)
    [local_penalised] = asyncio.run(_local_tokens(tiny_engine, prompt, [24], penalised))
    [local_plain] = asyncio.run(_local_tokens(tiny_engine, prompt, [24]))
    with_logprobs = P.SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)

    async def local_logprobs() -> list[TokenLogprob]:
        cid = EngineHandle.new_context_id()
        await tiny_engine.fill(prompt, cid)
        out = [e async for c in tiny_engine.generate(with_logprobs, cid) for e in c.logprobs or []]
        await tiny_engine.free_context(cid)
        return out

    local_entries = asyncio.run(local_logprobs())
    resp = _post(eng, "/generate", {"sampling": {"max_tokens": 2, "presence_penalty": 2.5}, "context_id": b})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_sampling", resp.text
    asyncio.run(through_remote_engine())


def test_engine_cli_sets_capacity_and_kv_pool(procs: Procs):
    mgr = procs.manager()
    eng = procs.engine(mgr, "--token-capacity", "1234", "--kv-cache-tokens", "4096")
    stats = httpx.get(f"{eng.url}/stats", timeout=10, headers=OPERATOR).json()
    assert stats["token_capacity"] == 1234
    assert stats["kv_tokens_total"] == 4096 and stats["kv_blocks_total"] == 4096 // stats["kv_block_size"]


def test_engine_reports_its_latency_cap_and_the_manager_learns_it_at_once(procs: Procs):
    mgr = procs.manager(heartbeat_interval=5, heartbeat_timeout=30)  # no second heartbeat in time
    fixed = procs.engine(mgr, "--latency-cap", "2222")
    # one thread: two OpenMP threads on 2 busy cores stall at every barrier, flat in load
    measured = procs.engine(mgr, "--latency-factor", "1.5", "--threads", "1")
    stats = httpx.get(f"{fixed.url}/stats", timeout=10, headers=OPERATOR).json()
    assert (stats["latency_cap_tokens"], stats["latency_cap_source"]) == (2222, "fixed")
    stats = httpx.get(
        f"{measured.url}/stats", timeout=10, headers=OPERATOR
    ).json()  # answered after its probe
    assert stats["latency_cap_source"] == "measured" and stats["latency_cap_tokens"] > 0
    assert stats["decode_ms_target"] == pytest.approx(1.5 * stats["decode_ms_base"], rel=1e-3)
    # the first heartbeat follows registration at once: the manager knows both caps now
    for eng, cap in ((fixed, 2222), (measured, stats["latency_cap_tokens"])):
        seen = wait_until(
            lambda eng=eng: (engine_by_url(mgr, eng.url) or {}).get("stats", {}).get("latency_cap_tokens"),
            3,
            lambda: f"no heartbeat with the cap yet: {engines(mgr)}",
        )
        assert seen == cap  # (an idle engine does not refit)


@pytest.mark.timing
def test_servers_answer_a_keep_alive_client_without_nagles_delay(procs: Procs):
    """``parrot serve`` and ``parrot engine`` set TCP_NODELAY on their connections: on a
    reused connection a small answer comes in about a millisecond.  With Nagle's algorithm
    on (a listening socket made with protocol 0) every one waited ~40 ms for the client's
    delayed ACK.  So the fastest of 15 answers tells them apart: a loaded machine only ever
    adds time (a median under 20 ms did not always hold on a busy 2-core machine)."""
    mgr = procs.manager()
    eng = procs.engine(mgr)
    for url in (mgr.url, eng.url):
        with httpx.Client(base_url=str(url), timeout=10) as http:
            took = []
            for _ in range(15):
                started = time.perf_counter()
                assert http.get("/healthz").status_code == 200
                took.append(time.perf_counter() - started)
        assert min(took) < 0.02, (url, took)

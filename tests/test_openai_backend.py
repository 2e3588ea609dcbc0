"""External OpenAI-compatible engines (:mod:`parrot.manager.backends.openai_backend`).

The backend is a real Parrot server on loopback (its ``/v1/completions`` takes text
prompts only, so the adapter runs in ``openai`` text mode): a chained application run
through a second manager over it gives the same greedy outputs as a request-level
client calling the backend directly.  Failures come from a scripted server on
loopback (:mod:`tests.misbehaving_backend`): refused connections, 5xx, slowness past
the timeout and malformed streams each re-run the call on another engine or fail it
with an error naming the backend, and the manager keeps serving.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import parrot as P
from parrot.manager.backends.connect import BackendSetupError, connect_backend
from parrot.manager.backends.openai_backend import BackendOptions, OpenAIBackend
from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol.tokenizer import TextTokenizer
from tests.conftest import LiveServer, start_server
from tests.misbehaving_backend import Script, start_misbehaving
from tests.procs import OPERATOR, TEST_CLUSTER_SECRET, Proc, free_port, parrot_command

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
two_ways = importlib.import_module("_two_ways")

TINY = TextTokenizer.byte_level_tiny()
FAST = ManagerConfig(heartbeat_interval_s=0.2, engine_wait_s=3.0)


def backend_engine(url: str, **opts) -> OpenAIBackend:
    return connect_backend(url, BackendOptions(kind="openai", **opts), TINY)


def front(*backends: OpenAIBackend, config: ManagerConfig = FAST) -> LiveServer:
    """A manager whose only engines are ``backends`` (registered as ``parrot serve --backend`` does)."""
    manager = Manager(config)
    for i, b in enumerate(backends):
        manager.pool.register(b, name=f"backend-{i}", url=b.url, polled=True)
    return start_server(manager)


@pytest.fixture
def fronts() -> Iterator[list[LiveServer]]:
    started: list[LiveServer] = []
    yield started
    for server in started:
        server.stop()


def chain(way):
    """Three calls, each reading the one before: what the front manager runs server-side."""
    first = P.template_function(
        "Topic {{input:t}}: {{output:a}}", a=P.Output(max_tokens=12, ignore_eos=True, temperature=0.0)
    )
    then = P.template_function(
        "Go on from <{{input:prev}}>, {{output:b}}",
        b=P.Output(max_tokens=10, ignore_eos=True, temperature=0.0),
    )
    a = way(first)("parrots")
    b = way(then)(a)
    return way(then)(b)


def one_call(text: str = "hello"):
    fn = P.template_function("Say {{input:x}} {{output:y}}", y=P.Output(max_tokens=6, ignore_eos=True))
    return fn(text)


def direct(backend_url: str, prompt: str, max_tokens: int = 6) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    resp = httpx.post(f"{backend_url}/v1/completions", json=body, timeout=60)
    resp.raise_for_status()
    return resp.json()["choices"][0]["text"]


# ------------------------------------------------------------ against a real Parrot backend
def test_chain_through_an_external_parrot_backend_equals_calling_it_directly(live, fronts):
    engine = backend_engine(live.url)
    assert (engine.model_name, engine.max_seq_len) == (
        "tiny",
        live.manager.pool.longest_context("tiny").max_seq_len,
    )
    fronts.append(over := front(engine))
    parrot = two_ways.run_parrot(chain, over.url, 0.0)
    request_level = two_ways.run_request_level(chain, live.url, 0.0, two_ways.chat_format_of(over.url))
    assert parrot.value == request_level.value and len(parrot.value) > 0
    # the front sent the backend one completion per call, streamed
    assert [r for r in live.requests if r == ("POST", "/v1/completions")].__len__() >= 3 + 3
    stats = over.run_on_loop(engine.stats())
    assert stats.generates == 3 and stats.num_running == 0 and stats.num_contexts == 0
    assert stats.generated_tokens >= 12 + 10 + 10 and stats.token_load == 0


def test_streamed_partial_text_reaches_the_variable_token_by_token(live, fronts):
    fronts.append(over := front(backend_engine(live.url)))
    with P.connect(over.url):
        out = one_call("stream")
        pieces = list(out.stream(timeout=60))
    assert len(pieces) > 1 and "".join(pieces) == direct(live.url, "Say stream ")


def test_a_second_replica_takes_over_when_one_is_down(live, fronts):
    closed = start_misbehaving(Script(mode="ok-models-only"))
    dead = backend_engine(closed.url)  # answers /v1/models at set-up, then goes away
    closed.stop()
    fronts.append(over := front(dead, backend_engine(live.url)))
    with P.connect(over.url):
        outs = [one_call(f"n{i}") for i in range(4)]
        got = [o.get(timeout=60) for o in outs]
    assert got == [direct(live.url, f"Say n{i} ") for i in range(4)]


# ------------------------------------------------------------ failures of a backend
FAILURES = {
    "500": "answered 500",
    "slow": "sent nothing for 0.5s (timeout)",
    "bad-json": "malformed answer: a stream event that is not JSON",
    "no-text": "malformed answer: a choice without a string 'text'",
    "wrong-ids": "malformed answer: token_ids that are not ids of the model's vocabulary",
    "no-done": "closed the stream before data: [DONE]",
    "abort": "ended the generation with finish_reason 'abort'",
}


@pytest.mark.parametrize("mode", sorted(FAILURES))
def test_a_failing_backend_fails_the_call_naming_it_and_the_manager_keeps_serving(mode, live, fronts):
    bad = start_misbehaving(Script(mode=mode))
    try:
        engine = backend_engine(bad.url, timeout_s=0.5)
        fronts.append(
            over := front(engine, config=ManagerConfig(heartbeat_interval_s=0.2, engine_wait_s=1.0))
        )
        start = time.monotonic()
        with P.connect(over.url):
            out = one_call()
            with pytest.raises(P.ParrotError) as err:
                out.get(timeout=60)
        assert time.monotonic() - start < 30  # nothing hangs
        assert bad.url in str(err.value) and FAILURES[mode] in str(err.value)
        # re-run on it once it answered its poll again, until the attempts ran out or no
        # engine came back within engine_wait_s
        assert 1 <= bad.script.completions <= ManagerConfig().max_attempts
        assert httpx.get(f"{over.url}/healthz", timeout=5).status_code == 200
        assert over.run_on_loop(engine.stats()).num_running == 0
    finally:
        bad.stop()


@pytest.mark.parametrize("mode", ["500", "slow", "bad-json", "wrong-ids"])
def test_a_call_failing_on_one_backend_reruns_on_another(mode, live, fronts):
    bad = start_misbehaving(Script(mode=mode))
    try:
        fronts.append(over := front(backend_engine(bad.url, timeout_s=0.5), backend_engine(live.url)))
        with P.connect(over.url):
            outs = [one_call(f"r{i}") for i in range(4)]
            got = [o.get(timeout=60) for o in outs]
        assert got == [direct(live.url, f"Say r{i} ") for i in range(4)]
        assert bad.script.completions >= 1  # it was tried, and its calls ran elsewhere
    finally:
        bad.stop()


def test_a_refused_request_fails_the_call_at_once_with_the_backends_message(fronts):
    bad = start_misbehaving(Script(mode="400"))
    try:
        fronts.append(over := front(backend_engine(bad.url)))
        with P.connect(over.url), pytest.raises(P.ParrotError) as err:
            one_call().get(timeout=60)
        assert f"backend {bad.url} answered 400" in str(err.value) and "no such sampling" in str(err.value)
        assert bad.script.completions == 1  # another replica would refuse it alike: not re-run
    finally:
        bad.stop()


def test_a_refused_connection_fails_the_call_naming_the_backend(fronts):
    gone = start_misbehaving(Script(mode="ok-models-only"))
    engine = backend_engine(gone.url)
    gone.stop()
    fronts.append(over := front(engine, config=ManagerConfig(heartbeat_interval_s=0.2, engine_wait_s=1.0)))
    with P.connect(over.url), pytest.raises(P.ParrotError) as err:
        one_call().get(timeout=60)
    assert gone.url in str(err.value)
    listed = httpx.get(f"{over.url}/v1/engines", timeout=5).json()
    assert [e["alive"] for e in listed] == [False]  # suspected while it does not answer


# ------------------------------------------------------------ set-up
def test_setup_errors_name_the_backend():
    with pytest.raises(BackendSetupError, match=r"http://127\.0\.0\.1:1 cannot be reached"):
        backend_engine("http://127.0.0.1:1")
    with pytest.raises(BackendSetupError, match="must start with http"):
        backend_engine("ftp://x")
    bad = start_misbehaving(Script(mode="ok", tokenize=[1, 2, 3]))
    try:
        with pytest.raises(BackendSetupError, match=rf"backend {bad.url} tokenizes .* --backend-tokenizer"):
            connect_backend(bad.url, BackendOptions(kind="vllm"), TINY)
        with pytest.raises(BackendSetupError, match=r"does not serve 'other'; it serves \['tiny'\]"):
            backend_engine(bad.url, model="other")
    finally:
        bad.stop()


def test_request_bodies_follow_the_backend_kind(live):
    ctx_ids = TINY.encode("abc")
    sampling = P.SamplingParams(max_tokens=5, top_k=3, stop=("x",), ignore_eos=True)
    vllm = OpenAIBackend(live.url, BackendOptions(kind="vllm", model="m"), "m", 100, TINY)
    plain = OpenAIBackend(live.url, BackendOptions(kind="openai", model="m"), "m", 100, TINY)
    from parrot.manager.backends.openai_backend import _Context

    v = vllm._body(_Context(ctx_ids, "salt"), sampling, 5, stream=True)
    assert v["prompt"] == ctx_ids and v["cache_salt"] == "salt" and v["return_token_ids"] is True
    assert (v["top_k"], v["stop"], v["ignore_eos"], v["max_tokens"]) == (3, ["x"], True, 5)
    o = plain._body(_Context(ctx_ids, "salt"), P.SamplingParams(max_tokens=5), 5, stream=True)
    assert o["prompt"] == "abc" and not {"cache_salt", "return_token_ids", "top_k", "ignore_eos"} & set(o)


# ------------------------------------------------------------ the command line
def test_parrot_serve_with_backends_runs_calls_on_them(live, tmp_path):
    port = free_port()
    two_replicas = ["--backend-url", live.url] * 2  # one backend twice: two engines
    args = ["serve", "--port", str(port), "--backend", "openai", *two_replicas, "--backend-tokenizer", "tiny"]
    proc = Proc("serve-backend", args, tmp_path)
    try:
        proc.wait_for_log(r"manager ready at .*\(2 openai backend\(s\) serving tiny\)", 60)
        url = f"http://127.0.0.1:{port}"
        listed = httpx.get(f"{url}/v1/engines", timeout=10, headers=OPERATOR).json()
        assert [(e["model"], e["url"]) for e in listed] == [("tiny", live.url)] * 2
        with P.connect(url):
            got = one_call("cli").get(timeout=60)
        assert got == direct(live.url, "Say cli ")
    finally:
        proc.kill()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "vllm"], "--backend needs at least one --backend-url"),
        (
            ["--backend", "openai", "--backend-url", "http://127.0.0.1:1"],
            "http://127.0.0.1:1 cannot be reached",
        ),
        (
            ["--backend", "openai", "--backend-url", "x", "--backend-api-key-env", "NO_SUCH_VAR_X"],
            "$NO_SUCH_VAR_X",
        ),
        (
            ["--backend", "sglang", "--backend-url", "http://127.0.0.1:1", "--backend-priority"],
            "request priorities are vLLM's",
        ),
    ],
)
def test_parrot_serve_refuses_backends_it_cannot_drive(args, message):
    run = subprocess.run(
        [*parrot_command(), "serve", "--port", "0", "--backend-tokenizer", "tiny", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NO_SUCH_VAR_X": ""},
    )
    assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]


# ------------------------------------------------------------ the adapter's own state
def test_contexts_fork_grow_by_the_answer_and_are_freed():
    for mode, appended in (("ok", TINY.encode("hello")), ("ok-ids", [7, 8, 9])):
        bad = start_misbehaving(Script(mode=mode))
        try:
            engine = backend_engine(bad.url)

            async def run(engine=engine) -> list:
                await engine.fill(TINY.encode("ab"), 1)
                await engine.fill(TINY.encode("c"), 2, parent_context_id=1)  # a fork: "abc"
                chunks = [c async for c in engine.generate(P.SamplingParams(max_tokens=4), 2)]
                ids = list(engine._contexts[2].ids)
                parent = list(engine._contexts[1].ids)
                await engine.free_context(2)
                contexts = (await engine.stats()).num_contexts
                await engine.close()
                return [chunks, ids, parent, contexts]

            chunks, ids, parent, contexts = asyncio.run(run())
            assert bad.script.bodies[0]["prompt"] == "abc" and bad.script.bodies[0]["max_tokens"] == 4
            assert "".join(c.text for c in chunks) == "hello" and chunks[-1].done
            assert ids == TINY.encode("abc") + appended and parent == TINY.encode("ab") and contexts == 1
        finally:
            bad.stop()


def test_at_most_max_inflight_requests_reach_a_backend():
    bad = start_misbehaving(Script(mode="slow-ok"))
    try:
        engine = backend_engine(bad.url, max_inflight=1, timeout_s=10)

        async def run() -> tuple:
            for cid in (1, 2):
                await engine.fill(TINY.encode("x"), cid)

            async def gen(cid: int) -> str:
                return "".join([c.text async for c in engine.generate(P.SamplingParams(max_tokens=4), cid)])

            both = asyncio.gather(gen(1), gen(2))
            await asyncio.sleep(0.5)
            during = await engine.stats()
            texts = await both
            after = await engine.stats()
            await engine.close()
            return during, texts, after

        during, texts, after = asyncio.run(run())
        assert (during.num_running, during.num_waiting, during.token_load) == (1, 1, 1)
        assert texts == ["late", "late"] and bad.script.completions == 2
        assert (after.num_running, after.num_waiting, after.token_load, after.generates) == (0, 0, 0, 2)
    finally:
        bad.stop()


def test_warming_sends_a_long_prefix_with_max_tokens_1_only_when_asked():
    bad = start_misbehaving(Script(mode="ok"))
    try:
        long, short = TINY.encode("p" * 80), TINY.encode("q" * 10)
        for warm in (False, True):
            engine = backend_engine(bad.url, warm_prefix=warm, warm_min_tokens=64)

            async def fill(engine=engine) -> None:
                await engine.fill(long, 1)
                await engine.fill(short, 2)
                await engine.close()

            asyncio.run(fill())
        warmed = [b for b in bad.script.bodies if b["max_tokens"] == 1]
        assert [(b["prompt"], b["stream"]) for b in warmed] == [("p" * 80, False)]
    finally:
        bad.stop()


def test_the_tokenizer_check_passes_when_the_backend_agrees():
    from parrot.manager.backends.connect import PROBE_TEXTS

    agree = start_misbehaving(Script(mode="ok"))
    try:
        agree.script.tokenize = TINY.encode(PROBE_TEXTS[0])
        # the second probe differs: the check reads every probe, so this fails on it
        with pytest.raises(BackendSetupError, match="tokenizes '  spaces"):
            connect_backend(agree.url, BackendOptions(kind="vllm"), TINY)
    finally:
        agree.stop()


def test_constraints_reach_a_vllm_backend_as_structured_outputs_and_other_backends_refuse_them(fronts):
    server = start_misbehaving(Script(mode="ok-ids"))
    try:
        vllm = OpenAIBackend(server.url, BackendOptions(kind="vllm", model="tiny"), "tiny", 512, TINY)
        fronts.append(over_vllm := front(vllm))
        fronts.append(over_plain := front(backend_engine(server.url)))
        pick = P.template_function(
            "Pick {{input:q}}: {{output:x}}", x=P.Output(max_tokens=5, choices=["he", "x"])
        )
        with P.connect(over_vllm.url):
            assert pick("a").get(timeout=60) == "hello"  # what the scripted server answers
        sent_body = server.script.bodies[-1]  # vLLM 0.32 ignores the older guided_* fields
        assert sent_body["structured_outputs"] == {"choice": ["he", "x"]} and "guided_choice" not in sent_body
        sent = server.script.completions
        with P.connect(over_plain.url), pytest.raises(P.ParrotError) as err:
            pick("a").get(timeout=60)
        assert f"backend {server.url} (kind 'openai') cannot enforce a choices constraint" in str(err.value)
        assert server.script.completions == sent  # refused before anything was sent
    finally:
        server.stop()


@pytest.mark.timing
def test_a_backends_latency_cap_is_measured_from_the_gaps_between_its_tokens():
    """A server whose step takes 40 ms plus 5 us per token in flight: after answers at
    three loads (one, four and eight prompts of 400 tokens) the adapter reports the fit and
    the cap where a step takes 1.25 times an unloaded one (0.25 * 40 ms / 5 us = 2,000)."""
    paced = start_misbehaving(Script(mode="paced"))
    try:
        engine = connect_backend(paced.url, BackendOptions(kind="vllm", timeout_s=10), TINY)

        async def run() -> tuple:
            before = await engine.stats()
            cid = 0
            for answers in (1, 4, 8):
                for i in range(answers):
                    await engine.fill([5 + i] * 400, cid + i)
                await asyncio.gather(
                    *(
                        _drain(engine.generate(P.SamplingParams(max_tokens=10), cid + i))
                        for i in range(answers)
                    )
                )
                for i in range(answers):
                    await engine.free_context(cid + i)
                cid += answers
            after = await engine.stats()
            await engine.close()
            return before, after

        before, after = asyncio.run(run())
        assert (before.latency_cap_source, before.latency_cap_tokens) == ("none", 0)
        assert after.latency_cap_source == "measured", after
        assert 35 <= after.decode_ms_base <= 80 and 2.5 <= after.decode_ms_per_1k_tokens <= 12, after
        assert 1024 <= after.latency_cap_tokens <= 5000, after
        assert after.token_load == 0 and after.generates == 13
    finally:
        paced.stop()


async def _drain(chunks) -> None:
    async for _ in chunks:
        pass


def test_priorities_reach_a_vllm_backend_only_when_asked_and_then_lift_its_latency_cap():
    """With ``send_priority`` every completion request carries the generation's priority and
    the adapter reports its whole capacity as the latency cap (source "priority"); without
    it no request has the field.  Only vLLM has it: other kinds refuse the option."""
    from parrot.manager.backends.openai_backend import NO_CAPACITY_CAP

    bad = start_misbehaving(Script(mode="ok"))
    try:
        stats = {}
        for send in (False, True):
            engine = connect_backend(bad.url, BackendOptions(kind="vllm", send_priority=send), TINY)

            async def run(engine=engine) -> object:
                await engine.fill(TINY.encode("x"), 1)
                await _drain(engine.generate(P.SamplingParams(max_tokens=4), 1, priority=2**40 + 3))
                got = await engine.stats()
                await engine.close()
                return got

            stats[send] = asyncio.run(run())
        plain, prioritised = (b for b in bad.script.bodies if b["max_tokens"] == 4)
        assert "priority" not in plain and prioritised["priority"] == 2**40 + 3
        assert stats[False].latency_cap_source == "none"
        assert (stats[True].latency_cap_source, stats[True].latency_cap_tokens) == (
            "priority",
            NO_CAPACITY_CAP,
        )
    finally:
        bad.stop()
    with pytest.raises(ValueError, match="vLLM"):
        BackendOptions(kind="openai", send_priority=True)


# ------------------------------------------------------------ registering a backend at run time
def _register(url: str, body: dict, headers: dict | None = OPERATOR) -> httpx.Response:
    return httpx.post(f"{url}/v1/engines", json=body, headers=headers, timeout=30)


def test_an_operator_registers_a_backend_while_the_manager_runs_and_calls_run_on_it(live, fronts):
    """A manager with no engine takes a backend through POST /v1/engines (the tokenizer
    from --backend-tokenizer), then runs an application on it as on a backend given at
    start; the registration is refused without the cluster secret."""
    config = ManagerConfig(
        heartbeat_interval_s=0.2,
        engine_wait_s=10.0,
        cluster_secret=TEST_CLUSTER_SECRET,
        backend_tokenizer="tiny",
    )
    fronts.append(over := start_server(Manager(config)))
    body = {"kind": "openai", "url": live.url, "model": "tiny", "name": "late"}
    assert _register(over.url, body, headers=None).status_code == 401
    assert len(over.manager.pool) == 0
    resp = _register(over.url, body)
    assert resp.status_code == 201, resp.text
    [info] = httpx.get(f"{over.url}/v1/engines", headers=OPERATOR, timeout=10).json()
    assert (info["engine_id"], info["name"], info["model"], info["url"]) == (
        resp.json()["engine_id"],
        "late",
        "tiny",
        live.url,
    )
    assert info["max_seq_len"] == live.manager.pool.longest_context("tiny").max_seq_len  # as reported
    with P.connect(over.url):
        got = one_call("late").get(timeout=60)
    assert got == direct(live.url, "Say late ")


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        ({"kind": "openai", "model": "tiny"}, "engine_unreachable", "cannot be reached"),
        ({"kind": "openai", "model": "other"}, "engine_unreachable", "does not serve 'other'"),
        (
            {"kind": "openai", "model": "tiny", "priority": True},
            "bad_request",
            "request priorities are vLLM's",
        ),
        ({"kind": "carrier-pigeon", "model": "tiny"}, None, "kind"),
        ({"kind": "parrot", "model": "tiny"}, None, "max_seq_len"),
        ({"kind": "openai", "model": "tiny", "max_inflight": 0}, None, "max_inflight"),
    ],
)
def test_a_backend_that_cannot_be_driven_is_refused_with_the_reason(live, fronts, body, code, message):
    config = ManagerConfig(cluster_secret=TEST_CLUSTER_SECRET, backend_tokenizer="tiny")
    fronts.append(over := start_server(Manager(config)))
    unreachable = code == "engine_unreachable" and body["model"] == "tiny"
    url = f"http://127.0.0.1:{free_port()}" if unreachable else live.url
    resp = _register(over.url, {"url": url, **body})
    assert resp.status_code in (400, 422), resp.text
    error = resp.json()["error"]
    assert message in error["message"]
    if code is not None:
        assert error["code"] == code
    assert len(over.manager.pool) == 0  # nothing registered


def test_a_backend_of_a_model_no_engine_serves_needs_the_managers_tokenizer(live, fronts):
    fronts.append(over := start_server(Manager(ManagerConfig(cluster_secret=TEST_CLUSTER_SECRET))))
    resp = _register(over.url, {"kind": "openai", "url": live.url, "model": "tiny"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "no_tokenizer"
    assert "--backend-tokenizer" in resp.json()["error"]["message"]
    bad = ManagerConfig(cluster_secret=TEST_CLUSTER_SECRET, backend_tokenizer="/nonexistent")
    fronts.append(other := start_server(Manager(bad)))
    resp = _register(other.url, {"kind": "openai", "url": live.url, "model": "tiny"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "no_tokenizer"


def test_the_clis_backend_max_inflight_default_is_the_registrations() -> None:
    """The CLI keeps the figure import-free; it must stay the protocol's default."""
    import argparse

    from parrot.cli_backend import add_backend_args
    from parrot.protocol.schemas import DEFAULT_BACKEND_MAX_INFLIGHT

    parser = argparse.ArgumentParser()
    add_backend_args(parser)
    assert parser.parse_args([]).backend_max_inflight == DEFAULT_BACKEND_MAX_INFLIGHT
    assert BackendOptions().max_inflight == DEFAULT_BACKEND_MAX_INFLIGHT

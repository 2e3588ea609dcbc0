"""Large values never stall the manager (issue 14, "a manager no request can freeze").

A value or prompt too long for any context is rejected from its byte length
alone, without being tokenized (``TextTokenizer.min_tokens``); long text that may
fit is tokenized in a worker thread that releases the GIL, before the request
answers (submit, set, batch, completions) or before a scheduling round renders
the call.  Checked here: multi-megabyte values get their 4xx while ``/healthz``
keeps answering and a bystander's call gives the value it gives alone; the
longest value that fits runs with exactly the tokens of its rendered string, as
it does when everything is tokenized on the loop; the byte bound rejects without
tokenizing just over it, and tokenizes just under it.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from parrot.engine.local import LocalEngine
from parrot.manager.api.batch import apply_batch
from parrot.manager.dag.tokens import INLINE_PASS_BYTES, TokenSource
from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol.errors import ContextTooLong, NotFound
from parrot.protocol.schemas import BatchRequest, SubmitCall
from parrot.protocol.tokenizer import TextTokenizer
from tests.api_client import STALL_LIMIT_S, WAIT, expect_error, healthz_stalls, inp, out
from tests.conftest import LiveServer, start_server
from tests.fake_engine import GatedEngine

BIG = 6 * 1024 * 1024  # a value of several MB, under the 8 MiB body limit
LOW_INLINE = 256  # a threshold low enough that a value near the tiny context goes off the loop
TEMPLATE = "Q {{input:q}} {{output:y}}"  # fills "Q " + value + " ": len(value) + 3 tokens (tiny)


# ------------------------------------------------------------------ helpers
class RecordingEngine:
    """An engine that records the tokens of every fill it is sent (else the wrapped one)."""

    def __init__(self, engine: LocalEngine) -> None:
        self._engine = engine
        self.fills: list[list[int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def fill(
        self,
        tokens: Sequence[int],
        context_id: int,
        parent: int | None = None,
        cache_salt: str = "",
        *,
        priority: int = 0,
        retain: bool = False,
    ) -> None:
        self.fills.append(list(tokens))
        await self._engine.fill(
            tokens, context_id, parent, cache_salt=cache_salt, priority=priority, retain=retain
        )


class CountingTokenizer(TextTokenizer):
    """A tokenizer recording the length of every text it tokenizes (``encoded``), and
    of those it tokenized outside the worker threads (``on_loop``)."""

    encoded: list[int]
    on_loop: list[int]

    def _record(self, text: str) -> None:
        self.encoded.append(len(text))
        if not threading.current_thread().name.startswith("parrot-tokenize"):
            self.on_loop.append(len(text))

    def encode(self, text: str) -> list[int]:
        self._record(text)
        return super().encode(text)

    def encode_unlocked(self, text: str, keep_ids: int | None = None) -> tuple[int, list[int] | None]:
        self._record(text)
        return super().encode_unlocked(text, keep_ids)


def counting_tiny() -> CountingTokenizer:
    tok = CountingTokenizer.from_dict(TextTokenizer.byte_level_tiny().to_dict())
    assert isinstance(tok, CountingTokenizer)
    tok.encoded, tok.on_loop = [], []
    return tok


def unbounded_tiny() -> TextTokenizer:
    """The tiny tokenizer behind a (no-op on ASCII) normalizer: no byte bound for it."""
    spec = json.loads(TextTokenizer.byte_level_tiny().to_dict()["tokenizer_json"])
    spec["normalizer"] = {"type": "NFC"}
    tok = TextTokenizer.from_dict(
        {**TextTokenizer.byte_level_tiny().to_dict(), "tokenizer_json": json.dumps(spec)}
    )
    assert tok.max_token_bytes is None
    return tok


class Client:
    """A raw session on a live server."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=60)
        created = self.http.post("/v1/sessions").json()
        self.auth = {"Authorization": f"Bearer {created['token']}"}
        self.path = f"/v1/sessions/{created['session_id']}"

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(f"{self.path}{path}", json=body, headers=self.auth)

    def put(self, var_id: str, value: str) -> httpx.Response:
        return self.http.put(f"{self.path}/variables/{var_id}", json={"value": value}, headers=self.auth)

    def submit(self, template: str, *bindings: dict[str, Any]) -> httpx.Response:
        return self.post("/calls", {"template": template, "placeholders": list(bindings)})

    def value(self, var_id: str) -> str:
        info = self.http.get(
            f"{self.path}/variables/{var_id}", params={"wait": WAIT}, headers=self.auth
        ).json()
        assert info["state"] == "ready", info
        return info["value"]

    def graph(self) -> dict[str, Any]:
        return self.http.get(f"{self.path}/graph", headers=self.auth).json()

    def close(self) -> None:
        self.http.close()


def bystander_value(url: str) -> str:
    """A greedy 8-token call of a session of its own, from submit to its value."""
    client = Client(url)
    try:
        resp = client.submit(
            "Bystander: {{input:x}} ->{{output:y}}",
            inp("x", value="parrots"),
            out("y", sampling={"max_tokens": 8}),
        )
        assert resp.status_code == 201, resp.text
        return client.value(resp.json()["outputs"]["y"])
    finally:
        client.close()


def words(n_bytes: int, seed: int = 0) -> str:
    """ASCII prose of exactly ``n_bytes`` bytes (tiny model: as many tokens)."""
    rng = random.Random(seed)
    vocab = ["parrot", "feather", "perch", "squawk", "seed", "wing", "the", "a", "of", "green", "loud"]
    text = ""
    while len(text) < n_bytes:
        text += rng.choice(vocab) + rng.choice([" ", " ", ", ", ". ", "\n"])
    return text[:n_bytes]


# --------------------------------------------------- (1) several MB, no stall
@pytest.mark.timing
def test_multi_megabyte_values_are_refused_while_everyone_else_carries_on(live: LiveServer) -> None:
    """Each way in for a 6 MB value answers 400 ``context_too_long`` (413 past the body
    limit), /healthz never waits over half a second, and a bystander's greedy call,
    run meanwhile, gives the value it gives alone; the attacker's session is unchanged."""
    alone = bystander_value(live.url)
    attacker = Client(live.url)
    try:
        _attack(live, attacker, alone)
    finally:
        attacker.close()


def _attack(live: LiveServer, attacker: Client, alone: str) -> None:
    pending = attacker.post("/variables", {}).json()["var_id"]
    before = attacker.graph()
    big, accented = "a" * BIG, "é" * (BIG // 2)
    attacks: list[tuple[str, Callable[[], httpx.Response], int, str]] = [
        ("create", lambda: attacker.post("/variables", {"value": big}), 400, "context_too_long"),
        (
            "create é",
            lambda: attacker.post("/variables", {"value": accented}),
            400,
            "context_too_long",
        ),
        ("set", lambda: attacker.put(pending, big), 400, "context_too_long"),
        ("submit", lambda: attacker.submit(TEMPLATE, inp("q", value=big), out("y")), 400, "context_too_long"),
        (
            "batch",
            lambda: attacker.post(
                "/batch",
                {"ops": [{"op": "create_variable", "value": "ok"}, {"op": "create_variable", "value": big}]},
            ),
            400,
            "context_too_long",
        ),
        (
            "completions",
            lambda: attacker.http.post("/v1/completions", json={"prompt": big, "max_tokens": 1}),
            400,
            "context_too_long",
        ),
        (
            "over the body limit",
            lambda: attacker.post("/variables", {"value": "a" * (8 * 1024 * 1024)}),
            413,
            "payload_too_large",
        ),
    ]
    results: dict[str, str] = {}
    with healthz_stalls(live.url, every_s=0.01) as stalls:
        bystander = threading.Thread(target=lambda: results.update(during=bystander_value(live.url)))
        bystander.start()
        for name, attack, status, code in attacks:
            started = time.monotonic()
            err = expect_error(attack(), status, code)
            assert time.monotonic() - started < 5, name
            if name == "batch":
                assert err["detail"]["op"] == 1
        bystander.join()
    assert stalls and max(stalls) < STALL_LIMIT_S, (max(stalls), len(stalls))
    assert results["during"] == alone
    assert attacker.graph() == before


@pytest.mark.timing
def test_a_value_without_a_byte_bound_is_tokenized_off_the_loop() -> None:
    """A tokenizer the byte bound does not cover tokenizes a 1 MiB value in a worker
    thread: the exact count is reported, and /healthz keeps answering meanwhile."""
    live = start_server(Manager(ManagerConfig()))
    live.manager.pool.register(GatedEngine(unbounded_tiny(), max_seq_len=2048), name="unbounded")
    client = Client(live.url)
    try:
        with healthz_stalls(live.url, every_s=0.01) as stalls:
            err = expect_error(client.post("/variables", {"value": "b" * (1 << 20)}), 400, "context_too_long")
            time.sleep(0.1)
        assert err["detail"] == {"tokens": 1 << 20, "max_seq_len": 2048}
        assert stalls and max(stalls) < STALL_LIMIT_S, (max(stalls), len(stalls))
        assert client.graph() == {"calls": [], "variables": []}
    finally:
        client.close()
        live.stop()


# ------------------------------------------ (2) the longest value that fits
@contextmanager
def recording_server(engine: LocalEngine, inline: int | None) -> Iterator[tuple[LiveServer, RecordingEngine]]:
    recording = RecordingEngine(engine)
    manager = Manager(ManagerConfig(inline_tokenize_bytes=inline))
    manager.pool.register(recording, name="tiny")
    live = start_server(manager)
    try:
        yield live, recording
    finally:
        live.stop()


Outcome = tuple[str, str, list[list[int]]]
"""(the rendered prompt, the call's output, the fills the engine was sent)"""


def run_fitting_values(live: LiveServer, engine: RecordingEngine) -> dict[str, Outcome]:
    """Each way a long value reaches a prompt, with the longest value that fits (and
    shorter ones generating more), by name; and the value one token too long."""
    client = Client(live.url)
    try:
        return _fitting_values(client, engine)
    finally:
        client.close()


def _fitting_values(client: Client, engine: RecordingEngine) -> dict[str, Outcome]:
    max_seq_len = engine.max_seq_len
    longest = words(max_seq_len - 4, seed=1)  # "Q " + value + " ": max_seq_len - 1 tokens
    results: dict[str, Outcome] = {}

    def record(name: str, prompt: str, var_id: str) -> None:
        value = client.value(var_id)
        results[name] = (prompt, value, list(engine.fills))
        engine.fills.clear()

    long_out = out("y", sampling={"max_tokens": 4})
    resp = client.submit(TEMPLATE, inp("q", value=longest), long_out)
    assert resp.status_code == 201, resp.text
    record("submit", f"Q {longest} ", resp.json()["outputs"]["y"])

    medium = words(1500, seed=2)
    resp = client.submit(TEMPLATE, inp("q", value=medium), out("y", sampling={"max_tokens": 12}))
    record("submit, 12 tokens", f"Q {medium} ", resp.json()["outputs"]["y"])

    x = client.post("/variables", {}).json()["var_id"]  # set later: rendered by a scheduling round
    resp = client.submit(TEMPLATE, inp("q", var_id=x), long_out)
    assert client.put(x, longest).status_code == 200
    record("set", f"Q {longest} ", resp.json()["outputs"]["y"])

    system = words(1000, seed=4)  # a long leading constant text: counted off the loop too
    y = client.post("/variables", {}).json()["var_id"]
    resp = client.submit(system + "\nQ {{input:q}} {{output:y}}", inp("q", var_id=y), long_out)
    question = words(600, seed=5)
    assert client.put(y, question).status_code == 200
    record("system prompt", f"{system}\nQ {question} ", resp.json()["outputs"]["y"])

    ops = [
        {"op": "create_variable", "ref": "a", "value": longest},
        {"op": "submit_call", "template": TEMPLATE, "placeholders": [{**inp("q"), "ref": "a"}, long_out]},
    ]
    resp = client.post("/batch", {"ops": ops})
    assert resp.status_code == 200, resp.text
    record("batch", f"Q {longest} ", resp.json()["results"][1]["outputs"]["y"])

    prompt = words(max_seq_len - 1, seed=3)
    resp = client.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200, resp.text
    results["completions"] = (prompt, resp.json()["choices"][0]["text"], list(engine.fills))
    engine.fills.clear()

    over = longest + "!"  # one token more: the rendered prompt fills the context
    err = expect_error(client.submit(TEMPLATE, inp("q", value=over), long_out), 400, "context_too_long")
    assert err["detail"] == {"prompt_tokens": max_seq_len, "max_seq_len": max_seq_len}
    return results


def test_the_longest_value_that_fits_runs_with_the_tokens_of_its_rendered_string(
    tiny_engine: LocalEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokenized off the loop (threshold lowered to 256 bytes so that values near the
    tiny context take that path) or all on it, every way in gives the engine exactly
    ``encode(rendered string)`` and the same greedy output; off the loop, nothing
    longer than the threshold was tokenized on the event loop."""
    on_loop: list[int] = []
    off_loop: list[int] = []
    encode, encode_unlocked = TextTokenizer.encode, TextTokenizer.encode_unlocked

    def spy_encode(self: TextTokenizer, text: str) -> list[int]:
        if threading.current_thread().name.startswith("parrot-tokenize"):
            off_loop.append(len(text))
        else:
            on_loop.append(len(text))
        return encode(self, text)

    def spy_unlocked(self: TextTokenizer, text: str, keep_ids: int | None = None) -> tuple[int, Any]:
        assert threading.current_thread().name.startswith("parrot-tokenize")
        off_loop.append(len(text))
        return encode_unlocked(self, text, keep_ids)

    monkeypatch.setattr(TextTokenizer, "encode", spy_encode)
    monkeypatch.setattr(TextTokenizer, "encode_unlocked", spy_unlocked)
    with recording_server(tiny_engine, inline=LOW_INLINE) as (live, engine):
        threaded = run_fitting_values(live, engine)
    assert off_loop and max(on_loop, default=0) <= LOW_INLINE, (sorted(on_loop)[-3:], len(off_loop))
    on_loop.clear()
    off_loop.clear()
    with recording_server(tiny_engine, inline=None) as (live, engine):
        inline = run_fitting_values(live, engine)
    assert not off_loop

    tokenizer = tiny_engine.tokenizer
    assert threaded.keys() == inline.keys()
    for name, (prompt, output, fills) in threaded.items():
        assert fills == [encode(tokenizer, prompt)], name
        assert (prompt, output, fills) == inline[name], name
        assert output, name
    assert len(threaded["submit"][2][0]) == tiny_engine.max_seq_len - 1


# ------------------------------------------------------ (3) the byte bound
@pytest.fixture
def bounded() -> tuple[Manager, CountingTokenizer]:
    """A manager whose one engine has a 100-token context and a counting tiny tokenizer
    (longest token 13 bytes: <|endoftext|>), so values over 1,300 bytes cannot fit."""
    tok = counting_tiny()
    assert tok.max_token_bytes == 13
    manager = Manager(ManagerConfig(inline_tokenize_bytes=64))
    manager.pool.register(GatedEngine(tok, max_seq_len=100), name="fake")
    return manager, tok


def test_a_value_just_over_the_byte_bound_is_rejected_without_tokenizing(bounded) -> None:
    manager, tok = bounded
    session, _ = manager.create_session()
    with pytest.raises(ContextTooLong) as over:
        manager.create_variable(session, None, "a" * 1301)
    assert tok.encoded == []
    assert over.value.detail == {"min_tokens": 101, "bytes": 1301, "max_seq_len": 100}
    with pytest.raises(ContextTooLong) as under:
        manager.create_variable(session, None, "a" * 1300)
    assert tok.encoded == [1300]  # tokenized: its exact count is the error's
    assert under.value.detail == {"tokens": 1300, "max_seq_len": 100}
    tok.encoded.clear()
    manager.create_variable(session, None, "<|endoftext|>" * 100)  # 1,300 bytes, 100 tokens: fits
    assert tok.encoded == [1300]
    tok.encoded.clear()
    manager.create_variable(session, None, "a" * 100)  # no more bytes than the context: not even counted
    assert tok.encoded == []
    assert len(session.variables) == 2


def test_a_rendered_prompt_over_the_byte_bound_is_rejected_without_tokenizing(bounded) -> None:
    """Two values that fit alone (50 tokens each) make a prompt of 1,302 bytes: at least
    101 tokens, more than the context; rejected at submit before any tokenizing."""
    manager, tok = bounded
    session, _ = manager.create_session()
    a, b = (manager.create_variable(session, None, "<|endoftext|>" * 50) for _ in range(2))
    tok.encoded.clear()
    req = SubmitCall(
        template="Q {{input:a}}{{input:b}}{{output:y}}",
        placeholders=[inp("a", var_id=a.var_id), inp("b", var_id=b.var_id), out("y")],
    )
    with pytest.raises(ContextTooLong, match="at least 101 tokens") as err:
        manager.submit_call(session, req)
    assert tok.encoded == []
    assert err.value.detail == {"min_prompt_tokens": 101, "prompt_bytes": 1302, "max_seq_len": 100}
    assert session.calls == {}


def test_long_text_is_tokenized_off_the_loop_and_the_batch_reports_its_first_error(bounded) -> None:
    """Through run_tokenized, text over the 64-byte threshold is tokenized in a worker
    thread (the check put off, then the batch validated again); the error reported is
    the first failing op's, as if everything had been tokenized at once, and a
    rejected batch applies nothing."""
    manager, tok = bounded
    session, _ = manager.create_session()

    def create(value: str) -> dict[str, Any]:
        return {"op": "create_variable", "value": value}

    def run(*ops: dict[str, Any]) -> Any:
        batch = BatchRequest.model_validate({"ops": list(ops)})
        return asyncio.run(manager.run_tokenized(lambda: apply_batch(manager, session, batch)))

    fits = "<|endoftext|>" * 8  # 104 bytes, over the context's 100 and the threshold: counted
    too_long, bad = "z" * 200, {"op": "set_variable", "value": "v", "var_id": "v-nope"}
    with pytest.raises(ContextTooLong, match=r"op 1 .*200 tokens"):
        run(create(fits), create(too_long), bad)
    assert session.variables == {}
    with pytest.raises(NotFound, match=r"op 1 .*v-nope"):
        run(create(fits), bad)
    assert session.variables == {}
    result = run(create(fits))
    assert [v.value for v in session.variables.values()] == [fits]
    assert result.results[0].var_id in session.variables
    assert sorted(tok.encoded) == [104, 104, 104, 200]  # once per request
    assert tok.on_loop == []


def test_token_source_defers_long_text_and_resolves_it_off_the_loop() -> None:
    tok = counting_tiny()
    source = TokenSource(inline_bytes=8)
    assert source.get(tok, "short", keep_ids=10) is not None and tok.encoded == [5]
    assert source.get(tok, "a long text", keep_ids=10) is None and source.pending
    assert source.get(tok, "a long text", keep_ids=100) is None  # recorded once, keeping the most ids
    asyncio.run(source.resolve())
    assert not source.pending and tok.encoded == [5, 11]
    got = source.get(tok, "a long text", keep_ids=100)
    assert got is not None and got.count == 11 and got.ids == tok.encode("a long text")
    assert TokenSource(None).get(tok, "x" * 1000, keep_ids=0) is not None  # never defers


def test_a_pass_tokenizes_at_most_its_budget_of_short_texts_on_the_loop() -> None:
    """Many short texts (a batch of thousands of calls) cost a pass at most
    INLINE_PASS_BYTES of tokenizing on the loop; the rest is deferred like long text,
    and the next pass, its budget whole again, finds every text's tokens."""
    tok = counting_tiny()
    source = TokenSource()
    texts = [f"{i:04d}" + "x" * 1020 for i in range(100)]  # 1 KiB each, all different
    source.start_pass()
    got = [source.get(tok, t, keep_ids=2048) for t in texts]
    inline = sum(g is not None for g in got)
    assert inline == INLINE_PASS_BYTES // 1024 and sum(tok.on_loop) <= INLINE_PASS_BYTES
    assert source.pending
    asyncio.run(source.resolve())
    assert not source.pending
    tok.on_loop.clear()
    source.start_pass()
    again = [source.get(tok, t, keep_ids=2048) for t in texts]
    assert all(g is not None for g in again) and sum(tok.on_loop) <= INLINE_PASS_BYTES
    assert [g.ids for g in again] == [tok.encode(t) for t in texts]


# -------------------------------------------------- the tokenizer's bound
def test_min_tokens_never_exceeds_the_token_count() -> None:
    """On the tiny tokenizer, and on a byte-level BPE whose vocabulary lacks some byte
    symbols (as SmolLM2's does: it drops those bytes) and has merged tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from parrot.protocol.tokenizer import _bytes_to_unicode

    symbols = _bytes_to_unicode()
    vocab = {symbols[b]: b for b in range(256) if b not in (4, 0xC3, 0xFF)}
    merges = [("a", "b"), ("ab", "ab"), ("abab", "abab")]
    for pair in merges:
        vocab["".join(pair)] = len(vocab) + 300
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    gappy = TextTokenizer(bpe.to_str())
    assert gappy.max_token_bytes == 8
    rng = random.Random(0)
    alphabet = ["ab", "a", "b", " ", "\x04", "é", "ÿ", "\n", "<|im_start|>", "\U00040000", "7"]
    for tok in (TextTokenizer.byte_level_tiny(), gappy):
        for _ in range(500):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
            assert tok.min_tokens(text) <= len(tok.encode(text)), text
            assert tok.encode_unlocked(text) == (len(tok.encode(text)), tok.encode(text))
    assert gappy.min_tokens("\x04" * 1000) == 0  # dropped: no tokens at all
    assert gappy.min_tokens("abababab" * 10) == 10 == len(gappy.encode("abababab" * 10))


def test_no_byte_bound_for_tokenizers_that_may_shrink_or_swallow_text() -> None:
    tiny = TextTokenizer.byte_level_tiny().to_dict()
    spec = json.loads(tiny["tokenizer_json"])
    assert unbounded_tiny().min_tokens("a" * 100) == 0
    swallowing = json.loads(json.dumps(spec))
    swallowing["added_tokens"][0]["lstrip"] = True
    assert TextTokenizer.from_dict({**tiny, "tokenizer_json": json.dumps(swallowing)}).max_token_bytes is None
    whitespace = {**spec, "pre_tokenizer": {"type": "WhitespaceSplit"}}
    assert TextTokenizer.from_dict({**tiny, "tokenizer_json": json.dumps(whitespace)}).max_token_bytes is None
    assert TextTokenizer.from_dict(tiny).max_token_bytes == 13


@pytest.mark.timing
def test_the_tokenizer_releases_the_gil_off_the_loop() -> None:
    """``encode_unlocked`` in a thread lets the event loop run (``encode`` would hold
    the GIL, and the loop, for the whole tokenization)."""
    tok = TextTokenizer.byte_level_tiny()
    text = "parrots squawk " * (100_000)

    async def main() -> tuple[float, float]:
        gaps: list[float] = []
        started = last = time.monotonic()
        work = asyncio.get_running_loop().run_in_executor(None, tok.encode_unlocked, text, 0)
        while not work.done():
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
        count, ids = await work
        assert count == len(text) and ids is None
        return time.monotonic() - started, max(gaps)

    took, gap = asyncio.run(main())
    assert gap < max(0.25, took / 3), (took, gap)

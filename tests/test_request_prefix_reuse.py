"""Request-level prompts that share a long start (one system prompt, different
questions, sent as plain completions): inner chunk keys (parrot.manager.dag.prefix),
the start counted once per engine (parrot.manager.dag.shared_start), and the effect on
placement under a binding latency cap, through the real OpenAI endpoint."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from parrot.manager.dag.graph import Call
from parrot.manager.dag.prefix import (
    CHUNK_CHARS,
    CHUNK_IDS,
    MAX_CHUNK_KEYS,
    PrefixIndex,
    key_shares,
    prefix_keys,
)
from parrot.manager.dag.shared_start import SharedStarts
from parrot.manager.openai.response import COMPLETION_TEMPLATE
from parrot.manager.service import Manager, ManagerConfig
from tests.conftest import start_server
from tests.fake_engine import GatedEngine, GatedServer
from tests.test_prefix_sharing import make_call

SYSTEM = "You are a careful lighthouse keeper who answers in one word. " * 18  # 1,116 characters


def request(prompt: str, salt: str = "") -> Call:
    call = make_call(COMPLETION_TEMPLATE, prompt=prompt)
    call.cache_salt = salt
    return call


def ids_request(ids: list[int]) -> Call:
    call = make_call(COMPLETION_TEMPLATE, prompt="")
    call.prompt_ids = tuple(ids)
    return call


# ------------------------------------------------------------------ keys
def test_prompts_sharing_a_long_start_share_the_keys_of_every_chunk_inside_it():
    a, b = request(SYSTEM + "Why?"), request(SYSTEM + "How come?")
    ka, kb = prefix_keys(a), prefix_keys(b)
    inner = len(SYSTEM) // CHUNK_CHARS  # chunk ends inside the system prompt: 512, 1024
    assert inner == 2 and ka[:inner] == kb[:inner]
    assert ka[-1] != kb[-1]  # the whole prompts differ
    other = request("Another system prompt. " + SYSTEM)
    assert not set(prefix_keys(other)) & set(ka)
    salted = request(SYSTEM + "Why?", salt="tenant-b")  # another tenant's cache: other keys
    assert not set(prefix_keys(salted)) & set(ka)
    shares = key_shares(a)
    assert [k for k, _ in shares] == ka  # every key, the whole prompt's last
    assert [round(s, 4) for _, s in shares] == [
        round(n * CHUNK_CHARS / len(SYSTEM + "Why?"), 4) for n in range(1, inner + 1)
    ] + [1.0]


def test_short_values_keep_one_key_and_token_id_prompts_get_inner_keys():
    assert len(prefix_keys(request("short prompt"))) == 1
    ids = list(range(3, 3 + 3 * CHUNK_IDS + 5))
    a, b = ids_request(ids), ids_request(ids[: 2 * CHUNK_IDS] + [9] * 40)
    ka, kb = prefix_keys(a), prefix_keys(b)
    assert len(ka) == 4 and ka[:2] == kb[:2] and ka[2] != kb[2]
    shares = key_shares(a)
    assert [k for k, _ in shares] == ka
    assert [round(s * len(ids)) for _, s in shares] == [CHUNK_IDS, 2 * CHUNK_IDS, 3 * CHUNK_IDS, len(ids)]


@pytest.mark.timing
def test_a_huge_value_gets_a_bounded_number_of_inner_keys():
    huge = "x" * (CHUNK_CHARS * (MAX_CHUNK_KEYS + 50))
    keys = prefix_keys(request(huge))
    assert len(keys) == MAX_CHUNK_KEYS + 1  # the inner keys, then the whole prompt's
    big = request("y" * (8 << 20))  # 8 MiB: hashed in one piece past the bound

    def took() -> float:
        t0 = time.perf_counter()
        prefix_keys(big)
        return time.perf_counter() - t0

    # the fastest of three (a loaded machine only adds time, and one run measured its noise)
    assert min(took() for _ in range(3)) < 0.1


def test_the_index_knows_whether_any_engine_holds_a_key():
    index = PrefixIndex(keys_per_engine=2)
    index.record("e1", ["a", "b"])
    index.record("e2", ["a"])
    assert index.held_anywhere("a") and index.held_anywhere("b")
    index.record("e1", ["c"])  # e1 drops a (its least recent); e2 still holds it
    index.record("e1", ["d"])  # and then b
    assert index.held_anywhere("a") and not index.held_anywhere("b")
    index.forget_engine("e2")
    assert not index.held_anywhere("a") and index.held_anywhere("c")


def test_the_shared_start_is_the_longest_boundary_another_call_or_an_engine_has():
    starts = SharedStarts(PrefixIndex(), min_tokens=32)
    q1 = request(SYSTEM + "Why?" + "z" * 600)  # its last inner key is past the system prompt
    c1 = starts.chunks(q1)
    assert len(c1) == 4  # three inner keys, then the whole prompt's
    alone = starts.prefix(c1, prompt_tokens=1720)
    assert alone == (c1[-2][0], round(1720 * c1[-2][1]))  # alone: all but its last chunk
    c2 = starts.chunks(request(SYSTEM + "How come?"))
    shared = starts.prefix(c2, prompt_tokens=1125)
    assert shared is not None and shared[0] == c1[1][0] == c2[1][0]  # 1,024 characters in
    assert starts.prefix(starts.chunks(request(SYSTEM)), prompt_tokens=20) is None  # under min_tokens
    index = PrefixIndex()
    later = SharedStarts(index, min_tokens=32)
    index.record("e1", [k for k, _ in c1[:1]])  # an engine holds the first 512 characters
    assert later.prefix(later.chunks(request(SYSTEM + "!")), 1120)[0] == c1[0][0]


# ------------------------------------------------------------------ end to end
CAP = 1500


def _gated(policy: str) -> Iterator[GatedServer]:
    """A manager whose latency cap (1,500 tokens, the paper's rule) binds, over an engine
    whose generations wait at a gate; the tiny byte-level tokenizer: a token a character."""
    config = ManagerConfig(
        policy=policy, latency_cap_tokens=CAP, latency_cap_scope="all", saturation_batching=False
    )
    manager = Manager(config)
    engine = GatedEngine()
    manager.pool.register(engine, name="gated")
    live = start_server(manager, record=False)
    server = GatedServer(live, engine)
    yield server
    server.set_gate(True)
    live.stop()


@pytest.fixture
def gated() -> Iterator[GatedServer]:
    yield from _gated("parrot")


@pytest.fixture
def gated_baseline() -> Iterator[GatedServer]:
    yield from _gated("baseline-latency")


def _running_after_burst(gated: GatedServer, prompts: list[str]) -> int:
    """Send the prompts as concurrent completions with the gate closed; how many were placed
    (began on the engine) before it opened: all of them, or as many as the cap let through
    once every one had been ranked by a scheduling round and three more rounds had passed
    (a call that fits is placed in the round after it is ranked, or after its shared prefix
    arrived; rounds run every TICK_S while calls wait).  Then every answer must come back."""
    gated.set_gate(False)
    url, body = f"{gated.live.url}/v1/completions", {"model": "fake", "max_tokens": 1}

    def placed(m: Manager) -> int:
        return len(m.executor._placed)

    def ranked(m: Manager) -> bool:
        queued = [t for t in m.executor._queue.values() if t.queued is not None]
        return placed(m) + len(queued) == len(prompts)

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(httpx.post, url, json={**body, "prompt": p}, timeout=30) for p in prompts]
        deadline = time.monotonic() + 30
        while not gated.state(ranked):
            assert time.monotonic() < deadline, "the completions never all reached a scheduling round"
            time.sleep(0.01)
        last = gated.state(lambda m: m.executor.rounds) + 3
        while gated.state(placed) < len(prompts) and gated.state(lambda m: m.executor.rounds) < last:
            assert time.monotonic() < deadline, "no scheduling round ran"
            time.sleep(0.01)
        running = gated.state(placed)
        gated.set_gate(True)
        answers = [f.result() for f in futures]
    assert [a.status_code for a in answers] == [200] * len(prompts)
    return running


def test_completions_sharing_a_system_prompt_count_it_once_against_the_cap(gated):
    """Four requests of ~1,120 tokens each, 1,024 of them a shared start: counted once,
    the four (1,024 + 4 x ~100 tokens) fit the 1,500-token cap at once; counted per
    request (4 x 1,120) they would run one at a time."""
    questions = ["Why?", "How come?", "When?", "Who?"]
    assert _running_after_burst(gated, [SYSTEM + q for q in questions]) == 4


def test_completions_without_a_shared_start_still_respect_the_cap(gated):
    prompts = [f"{i}: " + SYSTEM for i in range(4)]  # each starts differently: nothing shared
    assert _running_after_burst(gated, prompts) == 1


def test_the_request_level_baseline_counts_every_request_whole(gated_baseline):
    """Under a request-level policy (the paper's baselines, engines without prefix
    sharing) each request holds its own copy of the system prompt: one at a time."""
    prompts = [SYSTEM + q for q in ("Why?", "How come?", "When?", "Who?")]
    assert _running_after_burst(gated_baseline, prompts) == 1

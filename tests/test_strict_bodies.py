"""Request bodies are taken as sent: no coercion of types, no invalid Unicode, a bounded
number of stop token ids.  Each refusal is a 400 naming the problem; the session's
earlier work and a bystander's chain are untouched."""

from __future__ import annotations

import gc
import json
import time
import weakref

import httpx
import pytest
from fastapi import HTTPException

from parrot.engine.local import LocalEngine  # noqa: F401  (the engine's objects, as in a server)
from parrot.manager.api.app import create_app  # noqa: F401
from parrot.protocol.asgi import (
    MAX_JSON_ITEMS,
    collector_paused,
    json_items_bound,
    parse_json_body,
    startup_objects_frozen,
)
from parrot.protocol.sampling import MAX_STOP_TOKEN_IDS
from tests.api_client import STALL_LIMIT_S, Bystander, Raw, healthz_stalls, inp, out

SURROGATE = "\ud800"  # json.dumps sends it as the escape "\\ud800"


def assert_400(resp: httpx.Response, *words: str) -> None:
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    for word in words:
        assert word in message, message


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"chat": "yes"}, ("chat",)),
        ({"chat": 1}, ("chat",)),
        ({"model": 7}, ("model",)),
    ],
    ids=["chat-yes", "chat-1", "model-number"],
)
def test_values_are_not_coerced(raw: Raw, bystander: Bystander, extra: dict, words: tuple[str, ...]) -> None:
    before = raw.baseline()
    resp = raw.submit("Say {{input:seed}} {{output:x}}", [inp("seed", raw.seed), out("x")], **extra)
    assert_400(resp, *words)
    raw.assert_intact(before)
    bystander.finish()


def test_sampling_numbers_are_not_strings(raw: Raw, bystander: Bystander) -> None:
    before = raw.baseline()
    binding = out("x", sampling={"max_tokens": "3"})
    assert_400(raw.submit("Say {{input:seed}} {{output:x}}", [inp("seed", raw.seed), binding]), "max_tokens")
    raw.assert_intact(before)
    bystander.finish()


def send(raw: Raw, method: str, path: str, body: dict | bytes) -> httpx.Response:
    """``body`` as JSON with every non-ASCII character escaped (``\\ud800`` stays an escape:
    httpx's own encoder would refuse to send a lone surrogate at all); bytes are sent as they are."""
    headers = {**raw.auth, "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return raw.http.request(method, path, content=content, headers=headers)


def test_lone_surrogates_are_refused_everywhere(raw: Raw, bystander: Bystander) -> None:
    before = raw.baseline()
    calls = f"{raw.path}/calls"
    body = {"template": f"Say {SURROGATE} {{{{output:x}}}}", "placeholders": [out("x")]}
    assert_400(send(raw, "POST", calls, body), "invalid Unicode")
    body = {"template": "Say {{input:v}} {{output:x}}", "placeholders": [inp("v", value=SURROGATE), out("x")]}
    assert_400(send(raw, "POST", calls, body), "invalid Unicode")
    assert_400(send(raw, "POST", f"{raw.path}/variables", {"value": f"ok {SURROGATE}"}), "invalid Unicode")
    assert_400(send(raw, "PUT", f"{raw.path}/variables/{raw.later}", {"value": SURROGATE}), "invalid Unicode")
    resp = send(raw, "POST", "/v1/completions", {"prompt": f"hi {SURROGATE}", "max_tokens": 2})
    assert_400(resp, "invalid Unicode")
    # a valid pair (an emoji, sent as two escapes) is text
    emoji = send(raw, "POST", "/v1/completions", {"prompt": "hi \U0001f99c", "max_tokens": 2})
    assert emoji.status_code == 200, emoji.text
    raw.assert_intact(before)
    bystander.finish()


def test_stop_token_ids_are_bounded(raw: Raw, bystander: Bystander) -> None:
    ids = list(range(MAX_STOP_TOKEN_IDS + 1))
    resp = raw.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop_token_ids": ids})
    assert_400(resp, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
    ok = raw.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop_token_ids": ids[:-1]})
    assert ok.status_code == 200, ok.text
    bystander.finish()


@pytest.mark.timing
def test_a_large_body_is_parsed_and_checked_off_the_event_loop(raw: Raw, bystander: Bystander) -> None:
    """A 1.5 MB body (200,000 stop token ids next to an emoji's surrogate pair, which
    makes the body's strings worth checking) is refused while /healthz keeps answering at
    once; the same body with a lone surrogate too is refused for that."""
    before = raw.baseline()
    ids = list(range(MAX_JSON_ITEMS - 100_000))
    sampling = {"max_tokens": 2, "stop_token_ids": ids}
    body = {"template": "Say \U0001f99c {{output:x}}", "placeholders": [out("x", sampling=sampling)]}
    emoji = json.dumps(body).encode()
    body["template"] = f"Say {SURROGATE} {{{{output:x}}}}"
    lone = json.dumps(body).encode()
    # encoded before the stalls are timed: this test's client shares the server's process
    with healthz_stalls(str(raw.http.base_url)) as stalls:
        too_many = f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids"
        assert_400(send(raw, "POST", f"{raw.path}/calls", emoji), too_many)
        assert_400(send(raw, "POST", f"{raw.path}/calls", lone), "invalid Unicode")
    assert stalls and max(stalls) < STALL_LIMIT_S, max(stalls)
    raw.assert_intact(before)
    bystander.finish()


@pytest.mark.parametrize("where", ["calls", "completions", "batch"])
def test_a_body_of_too_many_json_items_is_refused_before_it_is_decoded(
    raw: Raw, bystander: Bystander, where: str
) -> None:
    """More items than MAX_JSON_ITEMS (here as many commas inside one string, which the
    bound counts too) is a 413 naming the limit, on every JSON endpoint; the session and a
    bystander are untouched, and the same request with fewer items is served."""
    before = raw.baseline()
    path, body = {
        "calls": (f"{raw.path}/calls", {"template": "Say {{output:x}}", "placeholders": [out("x")]}),
        "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        "batch": (f"{raw.path}/batch", {"ops": []}),
    }[where]
    resp = send(raw, "POST", path, {**body, "user": "," * (MAX_JSON_ITEMS + 1)})
    assert resp.status_code == 413, resp.text
    error = resp.json()["error"]
    assert error["code"] == "payload_too_large"
    assert f"more than {MAX_JSON_ITEMS} JSON items" in error["message"]
    raw.assert_intact(before)
    if where == "completions":  # the same request without the commas is served
        ok = send(raw, "POST", path, body)
        assert ok.status_code == 200, ok.text
    bystander.finish()


@pytest.mark.timing
@pytest.mark.parametrize("item", [b'{"a":0}', b"[0]", b"[]"], ids=["objects", "lists", "empty-lists"])
def test_decoding_the_costliest_bodies_under_the_item_limit_is_short(item: bytes) -> None:
    """The item bound exists so that decoding (which holds the GIL, worker thread or not)
    stays under the ~100 ms a request may hold the event loop: a body of small containers,
    the costliest items per comma (each is two items: its bracket and its comma), just
    under the limit decodes in well under that, in this process that has the manager and
    the engine imported (the garbage collector, paused while decoding, would otherwise
    traverse all their objects several times over).  The best of three, so that a busy
    machine does not decide it; one more container is a 413."""
    count = MAX_JSON_ITEMS // 2 - 1
    body = b"[" + b",".join([item] * count) + b"]"
    assert json_items_bound(body) <= MAX_JSON_ITEMS
    took = []
    for _ in range(3):
        started = time.perf_counter()
        assert len(parse_json_body(body)) == count
        took.append(time.perf_counter() - started)
    assert min(took) < 0.1, took
    assert gc.isenabled()
    with pytest.raises(HTTPException) as info:
        parse_json_body(b"[" + b",".join([item] * (count + 2)) + b"]")
    assert info.value.status_code == 413


def test_the_collector_pause_restores_the_collector_however_decoding_ends() -> None:
    """Overlapping pauses (two threads decoding at once) turn the collector back on once,
    when the last ends, and only if it was on; a body that is not JSON leaves it on too."""
    assert gc.isenabled()
    with collector_paused():
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # it was off: left off
    finally:
        gc.enable()
    with pytest.raises(json.JSONDecodeError):
        parse_json_body(b"[" + b"0," * 40_000 + b"]")  # over OFFLOOP_JSON_BYTES, so decoded paused
    assert gc.isenabled()


def test_serving_freezes_the_start_up_objects_after_collecting_their_garbage() -> None:
    """``parrot serve`` and ``parrot engine`` serve inside ``startup_objects_frozen``: the
    objects alive at start-up leave the collector's reach (a full collection then walks only
    what serving created), garbage cycles of start-up are collected first rather than frozen
    for ever, and leaving unfreezes them."""

    class Node:
        pass

    cycle = Node()
    cycle.self = cycle  # garbage only a collection can free
    gone = weakref.ref(cycle)
    del cycle
    kept = Node()
    assert gone() is not None and gc.get_freeze_count() == 0
    with startup_objects_frozen():
        assert gone() is None  # collected, not frozen
        assert gc.get_freeze_count() > 0
        assert all(o is not kept for o in gc.get_objects())  # out of the collector's lists
    assert gc.get_freeze_count() == 0
    assert any(o is kept for o in gc.get_objects())

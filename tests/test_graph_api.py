"""The session graph's JSON (``/v1/sessions/{id}/graph``): per-call prefix figures, the
variables' text, consistency with reads; the client's ``graph()`` and ``ui_url``; the
session page's files and what its data requests get without the right token."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import unquote, urlsplit

import httpx
import pytest

import parrot as P
from parrot.manager.views import MAX_GRAPH_VALUE_CHARS

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 6


@P.semantic_function
def ask(question: P.Input, answer: P.Output(max_tokens=4, temperature=0.0, ignore_eos=True)):
    """{{question}} Answer: {{answer}}"""


@P.semantic_function
def with_system(q: P.Input, a: P.Output(max_tokens=2, temperature=0.0, ignore_eos=True)):
    """You are a careful assistant who answers in one short sentence. You are a careful assistant who answers in one short sentence. You are a careful assistant who answers in one short sentence. You are a careful assistant who answers in one short sentence. Q: {{q}} A: {{a}}"""  # noqa: E501


def test_prefix_figures_count_the_cached_prompt_tokens(live):
    """The second call sharing a long leading text takes it from the engine's prefix
    cache: its reused tokens are whole blocks, and reused + filled is its prompt."""
    with P.connect(live.url) as s:
        first = with_system("one")
        first.get(timeout=60)
        second = with_system("two")
        second.get(timeout=60)
        calls = {c["outputs"]["a"]: c for c in s.graph()["calls"]}
    a, b = calls[first.id], calls[second.id]
    assert a["prefix_reused_tokens"] == 0
    assert a["filled_tokens"] == a["prompt_tokens"] > 200
    block = live.manager.pool.get(b["engine_id"]).api.runner.pool.block_size
    assert b["prefix_reused_tokens"] >= 200 // block * block - block
    assert b["prefix_reused_tokens"] % block == 0
    assert b["prefix_reused_tokens"] + b["filled_tokens"] == b["prompt_tokens"]


def test_graph_is_done_once_the_value_is_read(live):
    """Right after ``get()`` returns, the graph shows the producer done (never running)."""
    with P.connect(live.url) as s:
        for i in range(10):
            out = ask(f"question {i}")
            out.get(timeout=60)
            call = next(c for c in s.graph()["calls"] if c["outputs"]["answer"] == out.id)
            assert call["state"] == "done", call
            var = next(v for v in s.graph()["variables"] if v["var_id"] == out.id)
            assert var["state"] == "ready"


def test_graph_carries_variable_text_only_when_asked(live):
    with P.connect(live.url) as s:
        given = s.variable(value="x" * 50, name="given")
        out = ask(given)
        value = out.get(timeout=60)
        plain = {v["var_id"]: v for v in s.graph()["variables"]}
        cut = {v["var_id"]: v for v in s.graph(value_chars=10)["variables"]}
        whole = {v["var_id"]: v for v in s.graph(value_chars=1000)["variables"]}
    assert "text" not in plain[given.id] and "value" not in plain[given.id]
    assert cut[given.id]["text"] == "x" * 10 and cut[given.id]["text_truncated"] is True
    assert whole[given.id]["text"] == "x" * 50 and whole[given.id]["text_truncated"] is False
    assert whole[out.id]["text"] == value


@pytest.mark.parametrize("bad", [-1, MAX_GRAPH_VALUE_CHARS + 1, "many"])
def test_value_chars_out_of_range_is_a_400_naming_it(live, bad):
    with P.connect(live.url) as s:
        r = httpx.get(
            f"{live.url}/v1/sessions/{s.session_id}/graph",
            params={"value_chars": bad},
            headers={"Authorization": f"Bearer {s.token}"},
        )
        assert r.status_code == 400, r.text
        assert "query.value_chars" in r.json()["error"]["message"]
        assert s.graph() == {"calls": [], "variables": []}  # the session is untouched


def test_client_rejects_a_bad_value_chars_before_sending(live):
    with P.connect(live.url) as s:
        before = len(live.requests)
        with pytest.raises(P.BadRequest, match="value_chars"):
            s.graph(value_chars=-3)
        assert len(live.requests) == before


def test_ui_url_opens_this_session_with_its_token_in_the_fragment(live):
    with P.connect(live.url) as s:
        url = urlsplit(s.ui_url)
        assert f"{url.scheme}://{url.netloc}" == live.url
        assert url.path == f"/ui/sessions/{s.session_id}"
        assert url.query == ""
        assert unquote(url.fragment) == f"token={s.token}"
    with pytest.raises(P.NoSession):
        P.Session(live.url).ui_url  # noqa: B018  # not opened: no page


def test_async_session_graph_and_ui_url(live):
    async def main() -> tuple[dict, str, str]:
        async with P.aconnect(live.url) as s:
            out = ask("async")
            await out.aget(timeout=60)
            return await s.graph(value_chars=100), s.ui_url, s.session_id

    graph, url, sid = asyncio.run(main())
    assert [c["state"] for c in graph["calls"]] == ["done"]
    assert url.startswith(f"{live.url}/ui/sessions/{sid}#token=")


def test_page_and_its_files_need_no_token_and_forbid_foreign_code(live):
    """The page is the same static file for every session (it reveals nothing); its
    policy lets it run only this origin's script and style and talk only to it."""
    with httpx.Client(base_url=live.url) as http:
        page = http.get("/ui/sessions/anything")
        script = http.get("/ui/static/dag.js")
        style = http.get("/ui/static/dag.css")
    assert page.status_code == script.status_code == style.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert script.headers["content-type"].startswith("text/javascript")
    assert style.headers["content-type"].startswith("text/css")
    assert "anything" not in page.text  # the path is not echoed into the HTML
    assert "http" not in page.text.replace("http://www.w3.org/2000/svg", "")  # no CDN
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy
    assert "frame-ancestors 'none'" in policy
    assert page.headers["referrer-policy"] == "no-referrer"


def test_page_data_requests_without_the_right_token_are_refused(live):
    """What the page's script asks for, with a missing, wrong or other session's token,
    or for a session that does not exist: the API's 401, 403 and 404, and the session
    is not disturbed."""
    with P.connect(live.url) as s, P.connect(live.url) as other:
        out = s.call(ask, "secret")  # not the innermost session's
        out.get(timeout=60)
        graph = f"{live.url}/v1/sessions/{s.session_id}/graph"
        missing = httpx.get(graph, params={"value_chars": 2000})
        wrong = httpx.get(graph, headers={"Authorization": "Bearer not-the-token"})
        foreign = httpx.get(graph, headers={"Authorization": f"Bearer {other.token}"})
        absent = httpx.get(
            f"{live.url}/v1/sessions/no-such-session/graph", headers={"Authorization": f"Bearer {s.token}"}
        )
        assert (missing.status_code, wrong.status_code, foreign.status_code) == (401, 403, 403)
        assert absent.status_code == 404
        assert "missing session token" in missing.json()["error"]["message"]
        assert "does not open session" in wrong.json()["error"]["message"]
        assert "does not exist" in absent.json()["error"]["message"]
        for r in (missing, wrong, foreign, absent):
            assert "secret" not in r.text and out.id not in r.text
        assert [c["state"] for c in s.graph()["calls"]] == ["done"]


def test_prefix_figures_are_unknown_when_the_engine_does_not_say():
    """An engine whose fill answers nothing about its prefix cache (here a fake one):
    the call's figures are None, not a guess."""
    from parrot.manager.service import Manager
    from tests.conftest import start_server
    from tests.fake_engine import GatedEngine

    manager = Manager()
    manager.pool.register(GatedEngine(), name="gated")
    live = start_server(manager)
    f = P.template_function("x {{input:a}} {{output:b}}", b=P.Output(max_tokens=2))
    try:
        with P.connect(live.url) as s:
            assert s.call(f, a="1").get(timeout=30) == "A"
            [call] = s.graph()["calls"]
        assert call["state"] == "done" and call["prompt_tokens"] > 0
        assert call["prefix_reused_tokens"] is None and call["filled_tokens"] is None
    finally:
        live.stop()


def test_graph_text_is_capped_for_the_whole_answer(live, monkeypatch):
    """Past the answer's budget of text, later variables' text is cut (and says so)."""
    monkeypatch.setattr("parrot.manager.api.sessions.MAX_GRAPH_TEXT_CHARS", 25)
    with P.connect(live.url) as s:
        made = [s.variable(value=c * 10) for c in "abc"]
        texts = {v["var_id"]: (v["text"], v["text_truncated"]) for v in s.graph(value_chars=100)["variables"]}
    assert [texts[v.id] for v in made] == [("a" * 10, False), ("b" * 10, False), ("c" * 5, True)]


def test_the_graph_carries_the_managers_time_on_the_scale_of_its_stamps(live):
    """``X-Parrot-Time`` is the manager's clock as it answered: after every stamp in the
    answer, and (the clock being this process's) within moments of ``time.time()``."""
    with P.connect(live.url) as s:
        out = ask("time")
        out.get(timeout=60)
        before = time.time()
        resp = httpx.get(
            f"{live.url}/v1/sessions/{s.session_id}/graph", headers={"Authorization": f"Bearer {s.token}"}
        )
    now = float(resp.headers["X-Parrot-Time"])
    [call] = resp.json()["calls"]
    assert call["submitted_at"] <= call["started_at"] <= call["finished_at"] <= now
    assert before - 1.0 <= now <= time.time() + 1.0

"""The session page (``/ui/sessions/{id}``) in a real headless Chromium, driven by
Selenium against a real manager on loopback: it draws a known app's DAG with the
right nodes and edges, shows each call's figures, updates as a call finishes, and
shows the API's refusal when its token is wrong or missing.

Chromium and ChromeDriver come from the system's packages (``scripts/test.sh``
installs them with apt-get when missing; ``PARROT_CHROMIUM`` and
``PARROT_CHROMEDRIVER`` name others); the tests skip, saying so, only where they are
not installed.  The browser reaches nothing but the loopback server."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

import parrot as P

CHROMIUM = os.environ.get("PARROT_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = (
    os.environ.get("PARROT_CHROMEDRIVER") or shutil.which("chromedriver") or "/usr/bin/chromedriver"
)
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)

NODES_JS = """return [...document.querySelectorAll('#dag g.node')].map(
    g => [g.dataset.id, g.classList.contains('call') ? 'call' : 'var', g.dataset.state])"""
EDGES_JS = """return [...document.querySelectorAll('#dag path.edge')].map(
    e => [e.dataset.from, e.dataset.to])"""


def tok(n: int = 4) -> P.Output:
    return P.Output(max_tokens=n, temperature=0.0, ignore_eos=True)


@P.semantic_function
def draft(topic: P.Input, text: tok()):
    """Write about {{topic}}: {{text}}"""


@P.semantic_function
def improve(text: P.Input, better: tok()):
    """Improve this: {{text}} -> {{better}}"""


@P.semantic_function
def describe(item: P.Input, line: tok()):
    """Describe {{item}} in a line: {{line}}"""


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip(
            f"no browser: {CHROMIUM} or {CHROMEDRIVER} is missing and could not be installed "
            "(scripts/test.sh runs apt-get install chromium chromium-driver)"
        )
    profile = tempfile.mkdtemp(prefix="parrot-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for(driver: webdriver.Chrome, what, timeout: float = 30):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: what(d))


def node_states(driver: webdriver.Chrome) -> dict[str, tuple[str, str]]:
    return {i: (kind, state) for i, kind, state in driver.execute_script(NODES_JS)}


def test_page_draws_the_dag_and_updates_when_a_call_finishes(live, browser):
    """A 2-step chain and a 2-way map whose second call waits for a variable set only
    once the page has drawn it waiting."""
    with P.connect(live.url) as s:
        topic = s.variable(value="lighthouses", name="topic")
        apples = s.variable(value="apples", name="apples")
        gate = s.variable(name="gate")
        text = draft(topic)
        better = improve(text)
        line1, line2 = describe(apples), describe(gate)
        better.get(timeout=60)
        line1.get(timeout=60)

        browser.get(s.ui_url)
        wait_for(browser, lambda d: len(node_states(d)) == 11)
        graph = s.graph()
        calls = {c["call_id"]: c for c in graph["calls"]}
        want_nodes = {c: ("call", calls[c]["state"]) for c in calls} | {
            v["var_id"]: ("var", v["state"]) for v in graph["variables"]
        }
        want_edges = {(v, c["call_id"]) for c in graph["calls"] for v in c["inputs"].values()} | {
            (c["call_id"], v) for c in graph["calls"] for v in c["outputs"].values()
        }
        assert len(calls) == 4 and len(graph["variables"]) == 7 and len(want_edges) == 8
        assert node_states(browser) == want_nodes
        assert {tuple(e) for e in browser.execute_script(EDGES_JS)} == want_edges
        gated = next(c for c in calls.values() if c["inputs"].get("item") == gate.id)
        assert want_nodes[gated["call_id"]] == ("call", "waiting")
        assert want_nodes[line2.id] == ("var", "pending")

        # the calls' figures, as the table shows them
        rows = browser.execute_script(
            """return Object.fromEntries([...document.querySelectorAll('#calls tbody tr')].map(
                tr => [tr.dataset.id, [...tr.cells].map(td => td.textContent)]))"""
        )
        first = calls[next(i for i, c in calls.items() if c["outputs"].get("text") == text.id)]
        row = rows[first["call_id"]]
        assert row[1] == "done" and row[2] == first["objective"] and row[4] == first["engine_id"]
        assert row[5] == first["placement"] and row[5]
        assert row[7] == str(first["prefix_reused_tokens"]) and row[8] == str(first["filled_tokens"])
        values = browser.execute_script(
            """return Object.fromEntries([...document.querySelectorAll('#variables tbody tr')].map(
                tr => [tr.dataset.id, tr.querySelector('td.value').textContent]))"""
        )
        assert values[better.id] == better.get() and values[topic.id] == "lighthouses"

        gate.set("pears")
        value = line2.get(timeout=60)
        wait_for(browser, lambda d: node_states(d)[gated["call_id"]] == ("call", "done"))
        assert node_states(browser)[line2.id] == ("var", "ready")
        wait_for(
            browser,
            lambda d: (
                d.execute_script(
                    "return document.querySelector(`#variables tr[data-id='${arguments[0]}'] td.value`)"
                    ".textContent",
                    line2.id,
                )
                == value
            ),
        )
        assert "4 calls, 0 not finished" in browser.find_element("id", "status").text


def test_page_shows_the_refusal_of_a_wrong_token(live, browser):
    with P.connect(live.url) as s:
        describe("secret")
        url = s.ui_url
        bad = url.split("#", 1)[0] + "#token=not-the-token"
        browser.get(bad)
        status = wait_for(browser, lambda d: d.find_element("css selector", "#status[data-state='error']"))
        assert "403" in status.text and "does not open session" in status.text
        assert browser.execute_script(NODES_JS) == []

        browser.get(url.split("#", 1)[0])
        status = wait_for(browser, lambda d: d.find_element("css selector", "#status[data-state='error']"))
        assert "no session token" in status.text
        assert browser.execute_script(NODES_JS) == []


def test_page_of_a_closed_session_says_it_is_gone(live, browser):
    with P.connect(live.url) as s:
        url = s.ui_url
    browser.get(url)
    status = wait_for(browser, lambda d: d.find_element("css selector", "#status[data-state='error']"))
    assert "404" in status.text and "does not exist" in status.text

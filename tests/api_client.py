"""Helpers for tests that drive the manager's HTTP API with raw requests: bindings,
error-body checks, a raw session, and a *bystander* session whose 2-call chain must
complete after the bad requests of a test (nothing else lost or disturbed)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx

import parrot as P
from parrot.protocol.asgi import startup_objects_frozen

WAIT = 10.0  # seconds: the most any single wait of these tests may take


def out(name: str, **settings: Any) -> dict[str, Any]:
    """An output binding: greedy, 4 tokens, EOS ignored (so the value is never empty)."""
    sampling = {"max_tokens": 4, "ignore_eos": True, **settings.pop("sampling", {})}
    return {"name": name, "direction": "output", "sampling": sampling, **settings}


def inp(name: str, var_id: str | None = None, value: str | None = None) -> dict[str, Any]:
    binding: dict[str, Any] = {"name": name, "direction": "input"}
    if var_id is not None:
        binding["var_id"] = var_id
    if value is not None:
        binding["value"] = value
    return binding


def expect_error(resp: httpx.Response, status: int, code: str, *fragments: str) -> dict[str, Any]:
    """Assert the status, the exact error-body shape, the code and message fragments."""
    assert resp.status_code == status, f"wanted {status} {code}, got {resp.status_code}: {resp.text}"
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"code", "message"} <= set(err) <= {"code", "message", "detail"}, err
    assert err["code"] == code, err
    assert isinstance(err["message"], str) and err["message"], err
    for fragment in fragments:
        assert fragment in err["message"], f"{fragment!r} not in {err['message']!r}"
    return err


def engine_of(live):
    (handle,) = list(live.manager.pool)
    return handle


def engine_work(live) -> tuple[int, int]:
    """(fills, generates) the engine has done so far."""
    stats = live.run_on_loop(engine_of(live).api.stats())
    return stats.fills, stats.generates


def engine_contexts(live) -> set[int]:
    return set(live.run_on_loop(engine_of(live).api.context_ids()))


def assert_contexts_released(live, before: set[int]) -> None:
    """Every engine context opened since ``before`` is freed (within WAIT)."""
    deadline = time.monotonic() + WAIT
    while (extra := engine_contexts(live) - before) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not extra, f"engine contexts leaked: {sorted(extra)}"


class Raw:
    """A session driven with raw HTTP (httpx), to see statuses and bodies as sent."""

    def __init__(self, live, api_key: str | None = None):
        self.http = httpx.Client(base_url=live.url, timeout=WAIT)
        opening = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        created = self.http.post("/v1/sessions", headers=opening)
        assert created.status_code == 201, created.text
        self.sid: str = created.json()["session_id"]
        self.token: str = created.json()["token"]
        self.auth = {"Authorization": f"Bearer {self.token}"}
        self.path = f"/v1/sessions/{self.sid}"

    def close(self) -> None:
        self.http.close()

    # requests (responses returned as they are)
    def submit(self, template: Any, placeholders: list[dict[str, Any]], **extra: Any) -> httpx.Response:
        body = {"template": template, "placeholders": placeholders, **extra}
        return self.http.post(f"{self.path}/calls", json=body, headers=self.auth)

    def create(self, value: str | None = None, name: str | None = None) -> httpx.Response:
        body = {k: v for k, v in (("value", value), ("name", name)) if v is not None}
        return self.http.post(f"{self.path}/variables", json=body, headers=self.auth)

    def put(self, var_id: str, value: str) -> httpx.Response:
        return self.http.put(f"{self.path}/variables/{var_id}", json={"value": value}, headers=self.auth)

    def get(self, var_id: str, wait: float = 0) -> httpx.Response:
        return self.http.get(f"{self.path}/variables/{var_id}", params={"wait": wait}, headers=self.auth)

    # helpers that must succeed
    def var(self, value: str | None = None, name: str | None = None) -> str:
        resp = self.create(value, name)
        assert resp.status_code == 201, resp.text
        return resp.json()["var_id"]

    def call(self, template: str, placeholders: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        resp = self.submit(template, placeholders, **extra)
        assert resp.status_code == 201, resp.text
        return resp.json()

    def set(self, var_id: str, value: str) -> None:
        resp = self.put(var_id, value)
        assert resp.status_code == 200, resp.text

    def settled(self, var_id: str) -> dict[str, Any]:
        """The variable once it left ``pending`` (fails the test after WAIT)."""
        resp = self.get(var_id, wait=WAIT)
        assert resp.status_code == 200, resp.text
        info = resp.json()
        assert info["state"] != "pending", f"variable {var_id} still pending after {WAIT}s"
        return info

    def value(self, var_id: str) -> str:
        info = self.settled(var_id)
        assert info["state"] == "ready", info
        assert isinstance(info["value"], str)
        return info["value"]

    def graph(self) -> dict[str, Any]:
        resp = self.http.get(f"{self.path}/graph", headers=self.auth)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def baseline(self) -> dict[str, Any]:
        """Earlier work of this session: a ready variable consumed by a finished
        call, and a pending variable.  Returns the settled graph."""
        self.seed = self.var("hello parrot", name="seed")
        self.later = self.var(name="later")
        done = self.call("Say {{input:seed}}: {{output:reply}}", [inp("seed", self.seed), out("reply")])
        self.reply = done["outputs"]["reply"]
        self.reply_value = self.value(self.reply)
        return self.graph()

    def assert_intact(self, before: dict[str, Any]) -> None:
        """Nothing was added, removed or changed; earlier values still read back."""
        assert self.graph() == before
        assert self.value(self.seed) == "hello parrot"
        assert self.value(self.reply) == self.reply_value
        assert self.get(self.later).json()["state"] == "pending"


class Bystander:
    """Another session, opened with the client library before the bad requests:
    a 2-call chain whose input is still pending.  :meth:`finish` sets the input
    and checks the chain completes with values on the engine."""

    FIRST = P.template_function(
        "Topic: {{input:topic}}\nIdea: {{output:idea}}", idea=P.Output(max_tokens=4, ignore_eos=True)
    )
    SECOND = P.template_function(
        "Idea: {{input:idea}}\nCritique: {{output:critique}}",
        critique=P.Output(max_tokens=4, ignore_eos=True),
    )

    def __init__(self, live, api_key: str | None = None):
        self.live = live
        self.session = P.connect(live.url, timeout=WAIT, api_key=api_key).open()
        self.topic = self.session.variable(name="topic")
        self.idea = self.session.call(self.FIRST, self.topic)
        self.critique = self.session.call(self.SECOND, self.idea)
        self.finished = False

    def finish(self) -> None:
        self.topic.set("parrots")
        idea = self.idea.get(timeout=WAIT)
        critique = self.critique.get(timeout=WAIT)
        assert isinstance(idea, str) and isinstance(critique, str)
        with httpx.Client(base_url=self.live.url, timeout=WAIT) as http:
            graph = http.get(
                f"/v1/sessions/{self.session.session_id}/graph",
                headers={"Authorization": f"Bearer {self.session.token}"},
            ).json()
        assert [(c["state"], c["generated_tokens"]) for c in graph["calls"]] == [("done", 4), ("done", 4)]
        assert [v["state"] for v in graph["variables"]] == ["ready"] * 3
        self.finished = True

    def close(self) -> None:
        self.session.close()


STALL_LIMIT_S = 1.0
"""The longest a ``/healthz`` answer may take while a test's heavy request runs
(:func:`healthz_stalls`).  Measured from another process, so the test process's own threads
(GIL hand-offs with the server's loop) add nothing, with the test process's heap frozen out
of the garbage collector as a served process's is (``startup_objects_frozen``: a full
collection of a heap holding the models and hypothesis's state stopped every thread, the
server's too, for 0.2-0.3 s on an idle 2-core machine); what is left is the machine's scheduling,
which on a loaded 2-core machine delays an answer by tens of milliseconds, rarely a few
hundred.  The stalls these tests guard against (parsing, scanning, tokenizing or compiling a
large body on the event loop) held it for seconds to a minute."""


_PROBER = r"""
import json, sys, threading, time, urllib.request
url, every = sys.argv[1], float(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
took = []
print("ready", flush=True)
while not stop.is_set():
    started = time.monotonic()
    with urllib.request.urlopen(url + "/healthz", timeout=60) as resp:
        resp.read()
        assert resp.status == 200, resp.status
    took.append(time.monotonic() - started)
    stop.wait(every)
print(json.dumps(took), flush=True)
"""


@contextlib.contextmanager
def healthz_stalls(url: str, every_s: float = 0.02) -> Iterator[list[float]]:
    """Poll ``url``'s ``/healthz`` from another process while the block runs (polling
    from a thread of this process measured its GIL hand-offs with the server's loop too);
    yields the list of answer times (seconds), complete once the block exits.  Compare
    them with :data:`STALL_LIMIT_S`."""
    took: list[float] = []
    with startup_objects_frozen():
        prober = subprocess.Popen(
            [sys.executable, "-c", _PROBER, url.rstrip("/"), str(every_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert prober.stdout is not None and prober.stdout.readline().strip() == "ready"
        try:
            yield took
        finally:
            out, _ = prober.communicate(input="", timeout=120)  # its stdin closes: it stops
            assert prober.returncode == 0, f"the /healthz prober failed ({prober.returncode})"
            took.extend(json.loads(out.strip().splitlines()[-1]))

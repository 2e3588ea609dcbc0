"""Tenants: API keys name who opens a session or sends a completion, quotas bound what
each holds (429 with Retry-After, nothing changed), the queue takes turns between
tenants, and one tenant's cached prompt prefixes are invisible to another's.

Every refused request is checked for the status and error code its client sees, and
for leaving the tenant's other work and a bystander tenant's work as they were."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

import parrot as P
from parrot.cli import _parser
from parrot.cli import manager_config as config_of_cli
from parrot.engine.local import LocalEngine
from parrot.manager.dag.graph import Call
from parrot.manager.dag.prefix import prefix_keys
from parrot.manager.service import Manager, ManagerConfig
from parrot.manager.tenants import ANONYMOUS, ApiKeys, Quotas, TenantBook, load_api_keys, parse_api_keys
from parrot.protocol.errors import QuotaExceeded, Unauthorized
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.template import parse_template
from tests.api_client import Bystander, Raw
from tests.conftest import LiveServer, start_server
from tests.fake_engine import GatedEngine, GatedServer

WAIT = 20.0
ALICE = "alice-key-0123456789abcdef"
BOB = "bob-key-0123456789abcdef00"
KEYS = {ALICE: "alice", BOB: "bob"}
PENDING = "Q: {{input:x}}\nA:{{output:y}}"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def out(name: str = "y", max_tokens: int = 3) -> dict:
    return {"name": name, "direction": "output", "sampling": {"max_tokens": max_tokens, "ignore_eos": True}}


# ------------------------------------------------------------------ API keys


def test_key_lines_name_tenants_and_bad_keys_are_refused_with_their_line(tmp_path):
    keys = parse_api_keys(["# ops", "", f"team-a:{ALICE}", BOB], "keys.txt")
    assert keys[ALICE] == "team-a"
    assert keys[BOB].startswith("key-") and BOB not in keys[BOB]  # a digest, never the key
    with pytest.raises(ValueError, match=r"keys\.txt, line 1: .*at least 16"):
        parse_api_keys(["short"], "keys.txt")
    with pytest.raises(ValueError, match="line 2: this API key is given twice"):
        parse_api_keys([ALICE, f"x:{ALICE}"], "keys.txt")
    with pytest.raises(ValueError, match="printable ASCII"):
        parse_api_keys(["name:" + "k" * 10 + "\u00e9" * 10], "keys.txt")
    path = tmp_path / "keys"
    path.write_text(f"bob:{BOB}\n")
    assert load_api_keys([f"alice:{ALICE}"], [path]) == KEYS
    with pytest.raises(ValueError, match="given twice"):
        load_api_keys([BOB], [path])


def test_without_keys_everyone_is_the_anonymous_tenant_and_with_keys_a_key_is_required():
    assert ApiKeys().tenant(None) == ApiKeys().tenant("anything") == ANONYMOUS
    keys = ApiKeys(KEYS)
    assert keys.tenant(ALICE) == "alice" and keys.tenant(BOB) == "bob"
    with pytest.raises(Unauthorized) as missing:
        keys.tenant(None)
    assert missing.value.code == "api_key_required"
    with pytest.raises(Unauthorized) as wrong:
        keys.tenant(ALICE + "x")
    assert wrong.value.code == "invalid_api_key"


def test_the_cli_reads_keys_quotas_and_prefix_sharing(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"bob:{BOB}\n")
    args = _parser().parse_args(
        [
            *("serve", "--api-key", f"alice:{ALICE}", "--api-key-file", str(path)),
            *("--max-calls-per-tenant", "7", "--max-sessions-per-tenant", "0", "--prefix-sharing", "global"),
        ]
    )
    config = config_of_cli(args)
    assert config.api_keys == KEYS
    assert config.quotas == Quotas(max_sessions=None, max_calls=7, max_value_bytes=Quotas().max_value_bytes)
    assert config.prefix_sharing == "global"
    for bad in (["--api-key", "short"], ["--max-calls-per-tenant", "-1"]):
        with pytest.raises(SystemExit, match="parrot serve"):
            config_of_cli(_parser().parse_args(["serve", *bad]))


@pytest.fixture
def manager_config() -> ManagerConfig:
    return ManagerConfig(api_keys=KEYS, quotas=Quotas(max_sessions=3, max_calls=3, max_value_bytes=2000))


def test_sessions_and_completions_need_a_valid_key_and_refusals_create_nothing(live: LiveServer):
    manager = live.manager
    with httpx.Client(base_url=live.url, timeout=WAIT) as http:
        for headers, code in (({}, "api_key_required"), (bearer("not-a-key-0123456789"), "invalid_api_key")):
            resp = http.post("/v1/sessions", headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == code
            resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == code
        assert manager.sessions == {}
        resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=bearer(ALICE))
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
    with pytest.raises(Unauthorized):
        P.connect(live.url, timeout=WAIT).open()
    with P.connect(live.url, timeout=WAIT, api_key=BOB) as s:
        assert manager.sessions[s.session_id].tenant == "bob"


def test_a_session_belongs_to_its_opener_another_tenants_key_does_not_open_it(live: LiveServer):
    alice = Raw(live, api_key=ALICE)
    try:
        var = alice.var("secret")
        with httpx.Client(base_url=live.url, timeout=WAIT) as http:
            resp = http.get(f"{alice.path}/variables/{var}", headers=bearer(BOB))
            assert resp.status_code == 403 and resp.json()["error"]["code"] == "forbidden"
            assert http.delete(alice.path, headers=bearer(BOB)).status_code == 403
        assert alice.get(var).json()["value"] == "secret"
    finally:
        alice.close()


def test_a_tenant_over_its_session_quota_gets_429_and_others_are_not_affected(live: LiveServer):
    manager = live.manager
    opened = [Raw(live, api_key=ALICE) for _ in range(3)]
    try:
        with httpx.Client(base_url=live.url, timeout=WAIT) as http:
            resp = http.post("/v1/sessions", headers=bearer(ALICE))
            assert resp.status_code == 429 and resp.headers["Retry-After"] == "10"
            err = resp.json()["error"]
            assert err["code"] == "quota_exceeded" and err["detail"]["quota"] == "sessions"
            # a completion is a session while it runs: refused too, nothing left behind
            resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=bearer(ALICE))
            assert resp.status_code == 429
            assert len(manager.sessions) == 3
            bob = Bystander(live, api_key=BOB)
            bob.finish()
            bob.close()
            assert http.delete(opened[0].path, headers=opened[0].auth).status_code == 204
            assert http.post("/v1/sessions", headers=bearer(ALICE)).status_code == 201
    finally:
        for raw in opened:
            raw.close()


def test_unfinished_calls_over_the_quota_get_429_and_a_refused_batch_changes_nothing(live: LiveServer):
    alice = Raw(live, api_key=ALICE)
    try:
        x = alice.var()  # pending: calls reading it stay unfinished
        for _ in range(2):
            alice.call(PENDING, [{"name": "x", "var_id": x}, out()])
        reads_x = [{"name": "x", "var_id": x}, out()]
        submit = {"op": "submit_call", "template": PENDING, "placeholders": reads_x}
        batch = {"ops": [{"op": "create_variable", "ref": "v", "value": "a"}, submit, submit]}
        before = dict(live.manager.sessions[alice.sid].variables)
        resp = alice.http.post(f"{alice.path}/batch", json=batch, headers=alice.auth)
        assert resp.status_code == 429 and resp.headers["Retry-After"] == "1"
        assert resp.json()["error"]["detail"]["quota"] == "calls"
        session = live.manager.sessions[alice.sid]
        assert len(session.calls) == 2 and session.variables == before
        assert len(live.manager.sessions[alice.sid].variables[x].consumers) == 2  # no edge left behind
        third = alice.call(PENDING, [{"name": "x", "var_id": x}, out()])
        resp = alice.submit(PENDING, [{"name": "x", "var_id": x}, out()])
        assert resp.status_code == 429
        # the calls finish once their input is set: the quota has room again
        assert alice.put(x, "go").status_code == 200
        assert alice.get(third["outputs"]["y"], wait=WAIT).json()["state"] == "ready"
        assert alice.submit(PENDING, [{"name": "x", "value": "z"}, out()]).status_code == 201
    finally:
        alice.close()


def test_value_bytes_over_the_quota_get_429_and_closing_a_session_gives_them_back(live: LiveServer):
    alice = Raw(live, api_key=ALICE)
    other = Raw(live, api_key=ALICE)
    try:
        alice.var("a" * 1200)
        resp = other.create("b" * 900)  # the quota is the tenant's, across its sessions
        assert resp.status_code == 429 and resp.json()["error"]["detail"]["quota"] == "value_bytes"
        pending = other.var()
        assert other.put(pending, "\u00e9" * 450).status_code == 429  # 900 bytes of UTF-8
        assert other.get(pending).json()["state"] == "pending"
        resp = other.submit(PENDING, [{"name": "x", "value": "c" * 900}, out()])
        assert resp.status_code == 429 and live.manager.sessions[other.sid].calls == {}
        bob = Raw(live, api_key=BOB)
        assert bob.create("d" * 1500).status_code == 201  # bob's own quota
        bob.close()
        assert alice.http.delete(alice.path, headers=alice.auth).status_code == 204
        assert other.create("b" * 900).status_code == 201
    finally:
        alice.close()
        other.close()


# ----------------------------------------------------------------- fairness


def fn(name: str) -> P.SemanticFunction:
    template = f"{name} {{{{input:x}}}} =>{{{{output:o}}}}"
    return P.template_function(template, name=name, o=P.Output(max_tokens=1))


def placement_order(keys: dict[str, str] | None) -> list[str]:
    """On an engine that runs one call at a time, alice's a1 runs (held) with a2..a6
    queued behind it; then bob submits b1.  The order calls were placed in."""
    manager = Manager(ManagerConfig(api_keys=keys, latency_cap_tokens=1, engine_token_capacity=1))
    engine = GatedEngine()
    manager.pool.register(engine, name="one-at-a-time")
    server = GatedServer(start_server(manager, record=False), engine)
    alice_key, bob_key = (ALICE, BOB) if keys else (None, None)
    try:
        server.set_gate(False)
        with (
            P.connect(server.live.url, timeout=WAIT, api_key=alice_key) as a,
            P.connect(server.live.url, timeout=WAIT, api_key=bob_key) as b,
        ):
            outs = [a.call(fn(f"a{i}"), x="go") for i in range(1, 7)]
            deadline = time.monotonic() + WAIT
            while server.state(lambda m: len(m.executor._queue)) != 5:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            outs.append(b.call(fn("b1"), x="go"))
            while server.state(lambda m: len(m.executor._queue)) != 6:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            server.set_gate(True)
            assert all(o.get(timeout=WAIT) == "A" for o in outs)
            sessions = (a.session_id, b.session_id)
            calls = server.state(lambda m: [c for sid in sessions for c in m.sessions[sid].calls.values()])
    finally:
        server.set_gate(True)
        server.live.stop()
    return [c.name for c in sorted(calls, key=lambda c: c.dispatched_at)]


def test_the_queue_takes_turns_between_tenants():
    # one tenant: app-FIFO keeps alice's application ahead of bob's
    assert placement_order(None) == ["a1", "a2", "a3", "a4", "a5", "a6", "b1"]
    # two tenants: alice already had a1 placed, so bob's single call goes next
    assert placement_order(KEYS) == ["a1", "b1", "a2", "a3", "a4", "a5", "a6"]


# ---------------------------------------------------------- prefix isolation

SYSTEM = "You are a careful assistant. " * 12


def call_of(manager: Manager, tenant: str) -> Call:
    session, _ = manager.create_session(tenant)
    from parrot.protocol.schemas import PlaceholderBinding, SubmitCall

    req = SubmitCall(
        template=SYSTEM + "{{input:q}} {{output:a}}",
        placeholders=[
            PlaceholderBinding(name="q", direction="input", value="why?"),
            PlaceholderBinding(name="a", direction="output", sampling={"max_tokens": 2}),
        ],
    )
    return manager.stage_call(session, req, manager.lookup_in(session)).call


def test_prefix_keys_are_per_tenant_unless_the_operator_shares_them():
    isolated = Manager(ManagerConfig(api_keys=KEYS))
    a, a2, b = call_of(isolated, "alice"), call_of(isolated, "alice"), call_of(isolated, "bob")
    assert prefix_keys(a) == prefix_keys(a2)
    assert not set(prefix_keys(a)) & set(prefix_keys(b))
    shared = Manager(ManagerConfig(api_keys=KEYS, prefix_sharing="global"))
    assert prefix_keys(call_of(shared, "alice")) == prefix_keys(call_of(shared, "bob"))
    with pytest.raises(ValueError, match="prefix_sharing"):
        Manager(ManagerConfig(prefix_sharing="everyone"))
    # the same template without a salt keys as before tenants existed
    plain = Call("c", "s", None, parse_template("x {{output:y}}"), {}, {})
    assert prefix_keys(plain) == prefix_keys(Call("d", "t", None, parse_template("x {{output:y}}"), {}, {}))


GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


async def complete(engine: LocalEngine, tokens: list[int], context_id: int, salt: str) -> list[int]:
    await engine.fill(tokens, context_id, cache_salt=salt)
    got: list[int] = []
    async for chunk in engine.generate(GREEDY, context_id):
        got.extend(chunk.token_ids)
    await engine.free_context(context_id)
    return got


@pytest.fixture
def cache_engine(tiny_model) -> Iterator[LocalEngine]:
    engine = LocalEngine(tiny_model, kv_cache_tokens=4096)
    yield engine
    engine.close()


def test_the_engine_reuses_cached_blocks_only_under_the_same_salt(cache_engine, tiny_model):
    tokens = [3 + (i * 7) % (tiny_model.config.vocab_size - 3) for i in range(100)]

    async def run() -> list[tuple[list[int], int]]:
        seen = []
        for context_id, salt in ((91_001, "alice"), (91_002, "bob"), (91_003, ""), (91_004, "alice")):
            before = (await cache_engine.stats()).cached_tokens
            got = await complete(cache_engine, tokens, context_id, salt)
            seen.append((got, (await cache_engine.stats()).cached_tokens - before))
        return seen

    (first, hit1), (bob, hit2), (unsalted, hit3), (again, hit4) = asyncio.run(run())
    assert first == bob == unsalted == again  # same tokens, same output: only the cache differs
    assert (hit1, hit2, hit3) == (0, 0, 0)  # bob and the unsalted prompt found nothing of alice's
    assert hit4 == 96  # alice's own second prompt reused its six whole blocks


def test_a_tenant_cannot_see_another_tenants_prefix_in_its_placement_or_the_engine(live: LiveServer):
    """Alice runs a prompt with a long system prompt; bob then runs the same prompt.
    Bob's call is not placed for a shared prefix and the engine reuses nothing for it."""
    manager = live.manager
    template = SYSTEM + "{{input:q}} =>{{output:y}}"
    binding = [{"name": "q", "value": "why?"}, out(max_tokens=2)]

    def run(raw: Raw) -> dict:
        ids = raw.call(template, binding)
        assert raw.get(ids["outputs"]["y"], wait=WAIT).json()["state"] == "ready"
        return raw.http.get(f"{raw.path}/calls/{ids['call_id']}", headers=raw.auth).json()

    engine = next(iter(manager.pool)).api
    cached = lambda: live.run_on_loop(engine.stats()).cached_tokens  # noqa: E731
    alice, bob = Raw(live, api_key=ALICE), Raw(live, api_key=BOB)
    try:
        run(alice)
        before = cached()
        bobs = run(bob)
        assert bobs["placement"] != "prefix-engine" and cached() == before
        alices = run(alice)
        assert alices["placement"] == "prefix-engine" and cached() > before
    finally:
        alice.close()
        bob.close()


def test_the_tenant_book_forgets_finished_calls_so_a_finished_flood_frees_the_quota():
    book = TenantBook(Quotas(max_calls=2))
    calls = [Call(f"c{i}", "s", None, parse_template("x {{output:y}}"), {}, {}) for i in range(2)]
    book.add_calls("t", calls)
    with pytest.raises(QuotaExceeded):
        book.check("t", calls=1)
    calls[0].state = "done"
    book.check("t", calls=1)
    assert book.usage("t").unfinished_calls() == 1


def test_a_tenant_idle_while_others_were_served_gains_no_credit():
    """Alice had five calls placed while bob was idle; bob's first call then ranks ahead
    of alice's next one but his second does not jump her queue: one call each in turn."""
    from parrot.manager.backends.pool import EnginePool
    from parrot.manager.executor import Executor

    executor = Executor(EnginePool())

    def call(tenant: str) -> Call:
        return Call("c", "s", None, parse_template("x {{output:y}}"), {}, {}, tenant=tenant)

    for _ in range(5):
        executor.order.served(call("alice"))
    now = executor.order.virtual_time
    assert executor.order.tenant_finish["alice"] == now + 1
    executor.order.served(call("bob"))  # bob starts at the current virtual time, not at 0
    assert executor.order.tenant_finish["bob"] == now + 1
    executor.order.served(call("alice"))
    assert executor.order.tenant_finish == {"alice": now + 2, "bob": now + 1}

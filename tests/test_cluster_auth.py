"""The cluster secret: only engines and operators that present it register, heartbeat,
reach an engine's API or see engine URLs and counters; everyone else gets 401 and
changes nothing, and a bystander's calls complete meanwhile."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import trustme

import parrot as P
from parrot import cli
from parrot.engine.http_app import create_engine_app
from parrot.engine.loader import LoadedModel
from parrot.engine.local import LocalEngine
from parrot.manager.backends.pool import EngineHandle
from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol.cluster import CLUSTER_SECRET_ENV, CLUSTER_SECRET_HEADER, resolve_secret
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import GenerateChunk
from tests.conftest import LiveServer, serve_asgi, start_server
from tests.fake_engine import GatedEngine
from tests.procs import free_port

SECRET = "cluster-secret-for-these-tests-01"
OPERATOR = {CLUSTER_SECRET_HEADER: SECRET}
WRONG = {CLUSTER_SECRET_HEADER: "not-the-cluster-secret-at-all-02"}


@pytest.fixture
def manager_config() -> ManagerConfig:
    """conftest's ``live`` server, with :data:`SECRET` as its cluster secret."""
    return ManagerConfig(cluster_secret=SECRET)


@pytest.fixture
def guarded(live: LiveServer) -> LiveServer:
    return live


@pytest.fixture
def engine_server(tiny_model: LoadedModel) -> Iterator[LiveServer]:
    """An engine process's app, guarded by :data:`SECRET`, on loopback."""
    engine = LocalEngine(tiny_model)
    live = serve_asgi(create_engine_app(engine, cluster_secret=SECRET), LiveServer(url="", manager=None))  # type: ignore[arg-type]
    yield live
    live.stop()
    engine.close()


def one_call(url: str) -> str:
    """A bystander's call, start to finish."""
    f = P.template_function("Say hi {{input:x}} {{output:y}}", y=P.Output(max_tokens=3, ignore_eos=True))
    with P.connect(url):
        return f(x="now").get(timeout=60)


def describe(url: str, model: str = "tiny") -> dict:
    return {"url": url, "model": model, "max_seq_len": 256}


def error_code(resp: httpx.Response) -> str:
    return resp.json()["error"]["code"]


def test_registering_an_engine_needs_the_cluster_secret(guarded: LiveServer) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    for headers in ({}, WRONG):
        resp = httpx.post(f"{guarded.url}/v1/engines", json=describe(closed), headers=headers, timeout=10)
        assert resp.status_code == 401 and error_code(resp) == "unauthorized"
        assert CLUSTER_SECRET_HEADER in resp.json()["error"]["message"]
    # with the secret: an unreachable engine, and a server that is not an engine, are 400s
    started = time.monotonic()
    resp = httpx.post(f"{guarded.url}/v1/engines", json=describe(closed), headers=OPERATOR, timeout=30)
    assert resp.status_code == 400 and error_code(resp) == "engine_unreachable"
    assert closed in resp.json()["error"]["message"] and time.monotonic() - started < 12
    resp = httpx.post(f"{guarded.url}/v1/engines", json=describe(guarded.url), headers=OPERATOR, timeout=30)
    assert resp.status_code == 400 and error_code(resp) == "engine_unreachable"
    assert len(guarded.manager.pool) == 1  # nothing registered
    assert one_call(guarded.url)


def test_a_manager_without_a_secret_takes_no_remote_engines(tiny_engine: LocalEngine) -> None:
    manager = Manager(ManagerConfig())
    manager.pool.register(tiny_engine, name="tiny")
    live = start_server(manager)
    try:
        resp = httpx.post(f"{live.url}/v1/engines", json=describe("http://127.0.0.1:1"), headers=OPERATOR)
        assert resp.status_code == 401 and "no remote engines" in resp.json()["error"]["message"]
        assert len(manager.pool) == 1
    finally:
        live.stop()


def test_heartbeats_need_the_secret_and_valid_stats(guarded: LiveServer) -> None:
    [handle] = list(guarded.manager.pool)
    url = f"{guarded.url}/v1/engines/{handle.engine_id}/heartbeat"
    capacity = httpx.get(f"{guarded.url}/v1/engines", timeout=10).json()[0]["stats"]["token_capacity"]
    for headers in ({}, WRONG):
        # the secret is checked before the body: an invalid body is a 401 too
        for stats in ({"token_capacity": 7}, {"token_capacity": -1}):
            resp = httpx.post(url, json={"stats": stats}, headers=headers, timeout=10)
            assert resp.status_code == 401, resp.text
    resp = httpx.post(url, json={"stats": {"token_capacity": 7}}, headers=OPERATOR, timeout=10)
    assert resp.status_code == 400 and "in-process" in resp.json()["error"]["message"]
    for bad in ({"token_capacity": -1}, {"decode_ms_base": "NaN"}, {"latency_cap_tokens": -5}):
        resp = httpx.post(url, json={"stats": bad}, headers=OPERATOR, timeout=10)
        assert resp.status_code == 400 and error_code(resp) == "invalid_request", bad
    resp = httpx.post(
        f"{guarded.url}/v1/engines/engine-nope/heartbeat", json={"stats": {}}, headers=OPERATOR, timeout=10
    )
    assert resp.status_code == 404
    # the scheduler never saw any of it
    assert httpx.get(f"{guarded.url}/v1/engines", timeout=10).json()[0]["stats"]["token_capacity"] == capacity
    assert one_call(guarded.url)


def test_engine_counters_are_for_the_operator_only(guarded: LiveServer) -> None:
    assert one_call(guarded.url)
    [public] = httpx.get(f"{guarded.url}/v1/engines", timeout=10).json()
    [private] = httpx.get(f"{guarded.url}/v1/engines", headers=OPERATOR, timeout=10).json()
    assert private["stats"]["fills"] >= 1 and private["stats"]["generated_tokens"] >= 3
    assert (
        public["stats"]["fills"] == public["stats"]["filled_tokens"] == public["stats"]["cached_tokens"] == 0
    )
    assert public["stats"]["token_capacity"] == private["stats"]["token_capacity"] > 0
    assert public["stats"]["latency_cap_tokens"] == private["stats"]["latency_cap_tokens"]


def test_an_engine_answers_only_with_the_cluster_secret(
    guarded: LiveServer, engine_server: LiveServer
) -> None:
    base = engine_server.url
    assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
    requests = [
        ("GET", "/tokenizer", None),
        ("GET", "/stats", None),
        ("POST", "/fill", {"tokens": [1, 2, 3], "context_id": 5}),
        ("POST", "/generate", {"sampling": SamplingParams(max_tokens=2).to_dict(), "context_id": 5}),
        ("POST", "/free_context", {"context_id": 5}),
        ("POST", "/token_capacity", {"token_capacity": 64}),
    ]
    before = httpx.get(f"{base}/stats", headers=OPERATOR, timeout=10).json()
    for method, path, body in requests:
        for headers in ({}, WRONG):
            resp = httpx.request(method, f"{base}{path}", json=body, headers=headers, timeout=10)
            assert resp.status_code == 401, (path, resp.text)
    after = httpx.get(f"{base}/stats", headers=OPERATOR, timeout=10).json()
    assert after == before  # nothing filled, generated, freed or resized
    # the manager (same secret) registers it; its URL is shown to the operator only
    model = httpx.get(f"{base}/tokenizer", headers=OPERATOR, timeout=10).json()["model"]
    resp = httpx.post(f"{guarded.url}/v1/engines", json=describe(base, model), headers=OPERATOR, timeout=30)
    assert resp.status_code == 201, resp.text
    engine_id = resp.json()["engine_id"]
    public = httpx.get(f"{guarded.url}/v1/engines/{engine_id}", timeout=10).json()
    private = httpx.get(f"{guarded.url}/v1/engines/{engine_id}", headers=OPERATOR, timeout=10).json()
    assert public["url"] is None and private["url"] == base


def test_a_manager_with_another_secret_cannot_drive_the_engine(
    tiny_engine: LocalEngine, engine_server: LiveServer
) -> None:
    manager = Manager(ManagerConfig(cluster_secret="some-other-cluster-secret-03"))
    live = start_server(manager)
    try:
        resp = httpx.post(
            f"{live.url}/v1/engines",
            json=describe(engine_server.url),
            headers={CLUSTER_SECRET_HEADER: "some-other-cluster-secret-03"},
            timeout=30,
        )
        assert resp.status_code == 400 and error_code(resp) == "engine_unreachable"
        assert "only its manager" in resp.json()["error"]["message"]
        assert len(manager.pool) == 0
    finally:
        live.stop()


class CancellingEngine(GatedEngine):
    """Streams one token, then the chunk an engine sends when someone else freed the context."""

    async def generate(
        self,
        sampling: SamplingParams,
        context_id: int,
        parent_context_id: int | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[GenerateChunk]:
        yield GenerateChunk(token_ids=[65], text="A")
        yield GenerateChunk(done=True, finish_reason="cancelled")


def test_a_generation_cancelled_from_outside_fails_its_call() -> None:
    manager = Manager(ManagerConfig())
    manager.pool.register(CancellingEngine(), name="cancelling")
    live = start_server(manager)
    try:
        f = P.template_function("x {{input:a}} {{output:b}}", b=P.Output(max_tokens=5))
        with P.connect(live.url):
            out = f(a="1")
            with pytest.raises(P.ParrotError) as info:
                out.get(timeout=30)
        assert "freed or cancelled from outside the manager" in str(info.value)
    finally:
        live.stop()


def test_context_ids_cannot_be_guessed() -> None:
    ids = [EngineHandle.new_context_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids) and all(0 <= i < 2**62 for i in ids)
    gaps = sorted(abs(b - a) for a, b in itertools.pairwise(ids))
    assert gaps[len(gaps) // 2] > 2**40  # neighbours are far apart, not a counter


def test_secrets_from_flag_or_environment_and_their_checks(monkeypatch, capsys) -> None:
    monkeypatch.delenv(CLUSTER_SECRET_ENV, raising=False)
    assert resolve_secret(None) is None
    with pytest.raises(ValueError, match="at least 16"):
        resolve_secret("short")
    with pytest.raises(ValueError, match="printable ASCII"):
        resolve_secret("a secret with spaces in it")
    with pytest.raises(SystemExit, match="at least 16"):
        cli.manager_config(cli._parser().parse_args(["serve", "--cluster-secret", "short"]))
    # serve without one: generated, printed only when engines must join (--no-engine)
    embedded = cli.manager_config(cli._parser().parse_args(["serve"])).cluster_secret
    assert embedded and embedded not in capsys.readouterr().err
    alone = cli.manager_config(cli._parser().parse_args(["serve", "--no-engine"])).cluster_secret
    assert alone and alone != embedded and f"{CLUSTER_SECRET_ENV}={alone}" in capsys.readouterr().err
    # from the environment: used, never printed
    monkeypatch.setenv(CLUSTER_SECRET_ENV, SECRET)
    assert cli.manager_config(cli._parser().parse_args(["serve", "--no-engine"])).cluster_secret == SECRET
    assert SECRET not in capsys.readouterr().err
    # an engine needs one before it loads anything
    monkeypatch.delenv(CLUSTER_SECRET_ENV)
    with pytest.raises(SystemExit, match="cluster secret"):
        cli.run_engine(cli._parser().parse_args(["engine", "--manager", "http://127.0.0.1:1"]))


def test_engines_over_tls_are_verified_with_the_given_ca(tiny_model: LoadedModel, tmp_path) -> None:
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "engine.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    engine = LocalEngine(tiny_model)
    pem = str(tmp_path / "engine.pem")
    app = create_engine_app(engine, cluster_secret=SECRET)
    tls_engine = serve_asgi(app, LiveServer(url="", manager=None), ssl_certfile=pem, ssl_keyfile=pem)  # type: ignore[arg-type]
    managers = []
    try:
        assert tls_engine.url.startswith("https://")
        for ca_file in (None, str(tmp_path / "ca.pem")):
            manager = Manager(ManagerConfig(cluster_secret=SECRET, tls_ca_file=ca_file))
            managers.append(start_server(manager))
            resp = httpx.post(
                f"{managers[-1].url}/v1/engines",
                json=describe(tls_engine.url, engine.model_name),
                headers=OPERATOR,
            )
            if ca_file is None:  # the system does not trust this CA
                assert (
                    resp.status_code == 400 and "CERTIFICATE_VERIFY_FAILED" in resp.json()["error"]["message"]
                )
                assert len(manager.pool) == 0
            else:
                assert resp.status_code == 201, resp.text
                assert [h.url for h in manager.pool] == [tls_engine.url]
    finally:
        for live in managers:
            live.stop()
        tls_engine.stop()
        engine.close()


def test_tls_options_are_checked_at_start(tmp_path) -> None:
    with pytest.raises(SystemExit, match="go together"):
        cli.manager_config(cli._parser().parse_args(["serve", "--ssl-certfile", "x.pem"]))
    with pytest.raises(SystemExit, match="ssl-ca-file"):
        cli.manager_config(
            cli._parser().parse_args(["serve", "--ssl-ca-file", str(tmp_path / "missing.pem")])
        )
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(SystemExit, match="ssl-ca-file"):
        cli.manager_config(cli._parser().parse_args(["serve", "--ssl-ca-file", str(tmp_path / "junk.pem")]))

"""Shared fixtures: a tiny seeded engine, and real manager HTTP servers on
loopback (uvicorn in a background thread, a fresh manager per test)."""

from __future__ import annotations

import os

# Triton reads this when it is first imported, and torch may import triton on
# its own (whenever it is installed) before any kernel test runs: set it first.
# No test uses a GPU, so every Triton kernel here runs in the CPU interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")

import asyncio
import gc
import itertools
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import uvicorn
from hypothesis import settings

from parrot.engine.core.latency_fit import MIN_LATENCY_CAP_TOKENS
from parrot.engine.loader import LoadedModel, load_model
from parrot.engine.local import LocalEngine
from parrot.manager.api.app import create_app
from parrot.manager.backends import pool as pool_module
from parrot.manager.service import Manager, ManagerConfig
from tests.api_client import Bystander, Raw

# the ``timing`` marker (such a test runs alone under xdist); the longest files first
pytest_plugins = ["tests.xdist_timing", "tests.xdist_order"]

# Property tests draw the same examples on every run (CI stays reproducible: a
# failure seen once is seen again); ``PARROT_HYPOTHESIS=explore`` draws new ones
# and prints the seed of any failure (``@reproduce_failure``) to replay it.
settings.register_profile("reproducible", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("PARROT_HYPOTHESIS", "reproducible"))


def pytest_unconfigure(config: pytest.Config) -> None:
    """Everything is reported by now: leave the objects the run made to the process's exit.
    Without this, the interpreter's last collections walked them all (models, servers'
    state, hypothesis' caches): 1-3 s per process, 7 s for a worker at the end of the suite."""
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def engine_ids_of_one_width() -> None:
    """In-process engines are named ``engine-<n>`` from one counter, and the scheduler breaks
    ties by that name: counting from 1,000, the names sort in the order the engines were
    registered for the whole session.  (From 1, a test whose engines straddled 9 and 10, as
    they did on an xdist worker, saw its later engine win the ties.)"""
    pool_module._engine_ids = itertools.count(1000)


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(scope="session")
def tiny_engine(tiny_model: LoadedModel) -> Iterator[LocalEngine]:
    """The tiny engine the session's tests share.  Its latency cap is pinned (to 1,024 tokens,
    the floor its probe's fit always gave): measured, it would be refitted from every test's
    traffic, and the scheduling in the live tests would depend on which ran before."""
    engine = LocalEngine(tiny_model, max_step_tokens=256, latency_cap=MIN_LATENCY_CAP_TOKENS)
    _shared_engines.append(engine)
    yield engine
    _shared_engines.remove(engine)
    engine.close()


_shared_engines: list[LocalEngine] = []


@pytest.fixture(scope="module", autouse=True)
def no_context_outlives_its_module() -> Iterator[None]:
    """After each test module, the shared tiny engine holds no context: what a module left
    (a session its server never closed, a fork it never freed) would otherwise reach the next
    module to use the engine, and tests that count its contexts would depend on the order of
    the modules (which pytest-xdist varies from run to run)."""
    yield
    for engine in _shared_engines:
        for context_id in asyncio.run(engine.context_ids()):
            asyncio.run(engine.free_context(context_id))


class RequestLog:
    """ASGI middleware recording (method, path) of every request a server receives."""

    def __init__(self, app, log: list[tuple[str, str]]):
        self.app = app
        self.log = log

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.log.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)


@dataclass
class LiveServer:
    url: str
    manager: Manager
    requests: list[tuple[str, str]] = field(default_factory=list)
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def run_on_loop(self, coro, timeout: float = 30):
        """Run a coroutine on the server's event loop (where the engine and manager live)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        assert self.server is not None and self.thread is not None
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(manager: Manager, *, record: bool = True) -> LiveServer:
    app = create_app(manager)
    live = LiveServer(url="", manager=manager)
    return serve_asgi(RequestLog(app, live.requests) if record else app, live)


def serve_asgi(asgi, live: LiveServer, *, nodelay: bool = True, **tls: str) -> LiveServer:
    """Serve ``asgi`` with uvicorn on a free loopback port, on a thread of its own (HTTPS
    with ``ssl_certfile`` and ``ssl_keyfile`` in ``tls``); fills in and returns ``live``
    (its ``url``, server, thread and loop).

    ``nodelay`` (the default): answer without Nagle's delay, as ``parrot serve`` and
    ``parrot engine`` do (:func:`parrot.cli._bind`: a listening socket made as IPPROTO_TCP,
    so asyncio sets TCP_NODELAY on each connection).  With ``nodelay=False`` the socket is
    made with protocol 0: a keep-alive client then waits ~40 ms for every small answer (the
    body waits for the client's delayed ACK of the headers), which cost the suite about a
    minute.  (The delay used to be the default because the stall tests polled /healthz from
    a thread of the test process; they poll from another process now: healthz_stalls.)"""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP if nodelay else 0)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    live.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    server = uvicorn.Server(uvicorn.Config(asgi, log_level="warning", lifespan="on", **tls))
    live.server = server

    def run() -> None:
        loop = asyncio.new_event_loop()
        live.loop = loop
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.serve(sockets=[sock]))
        loop.close()

    live.thread = threading.Thread(target=run, daemon=True)
    live.thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not live.thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.01)
    return live


@pytest.fixture
def manager_config() -> ManagerConfig:
    return ManagerConfig()


@pytest.fixture
def live(tiny_engine: LocalEngine, manager_config: ManagerConfig) -> Iterator[LiveServer]:
    """A real manager HTTP server on loopback with the tiny engine embedded."""
    manager = Manager(manager_config)
    manager.pool.register(tiny_engine, name="tiny")
    server = start_server(manager)
    yield server
    server.stop()


@pytest.fixture
def raw(live: LiveServer) -> Iterator[Raw]:
    session = Raw(live)
    yield session
    session.close()


@pytest.fixture
def bystander(live: LiveServer) -> Iterator[Bystander]:
    b = Bystander(live)
    yield b
    b.close()
    assert b.finished, "the test never checked its bystander"

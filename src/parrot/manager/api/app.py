"""The manager's HTTP application (FastAPI): its routers, middleware and background tasks.

The routes are thin (parse, authorize, delegate to :class:`Manager`, serialise)
and live in one router per resource: :mod:`parrot.manager.api.sessions`
(sessions, variables, calls), :mod:`parrot.manager.api.engines` (the engine
pool, behind the cluster secret), :mod:`parrot.manager.openai.completions`
(``/v1/completions``, ``/v1/models``), :mod:`parrot.manager.openai.chat`
(``/v1/chat/completions``), :mod:`parrot.manager.api.metrics` (``/metrics``,
Prometheus) and :mod:`parrot.manager.api.session_page` (the session page,
``/ui/sessions/{id}``).  OpenAPI schema at ``/openapi.json``, browsable at ``/docs``
(Swagger UI) and ``/redoc``, both served with their scripts from the
``fastapi-offline`` package, so they work without internet access.

With API keys (``ManagerConfig.api_keys``), opening a session and
``/v1/completions`` need one (``Authorization: Bearer <key>``; 401 without);
the session then belongs to that key's tenant (:mod:`parrot.manager.tenants`)
and is reached with its own token.

Background tasks, for the app's lifetime: in-process engines' stats polled on
the heartbeat interval (remote engines send theirs), engines whose heartbeats
stopped dropped, idle sessions expired."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from parrot.manager.api.engines import engines_router
from parrot.manager.api.metrics import RequestCounter, metrics_router
from parrot.manager.api.session_page import ui_router
from parrot.manager.api.sessions import sessions_router
from parrot.manager.backends.openai_backend import OpenAIBackend
from parrot.manager.backends.pool import EngineHandle
from parrot.manager.backends.remote_engine import RemoteEngine
from parrot.manager.openai.chat import chat_router
from parrot.manager.openai.completions import openai_router
from parrot.manager.service import Manager
from parrot.protocol.asgi import BodyLimitMiddleware, OffLoopJsonRoute, install_error_handlers

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def create_app(manager: Manager) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        monitor = asyncio.create_task(_watch_heartbeats(manager))
        poller = asyncio.create_task(_poll_engine_stats(manager))
        expirer = asyncio.create_task(_expire_sessions(manager))
        try:
            yield
        finally:
            monitor.cancel()
            poller.cancel()
            expirer.cancel()
            await manager.drain()
            for handle in manager.engines():  # network clients die with the server's loop
                if isinstance(handle.api, _NETWORK_ENGINES):
                    with contextlib.suppress(Exception):
                        await handle.api.close()

    app = FastAPIOffline(
        title="Parrot manager",
        version="0.1.0",
        lifespan=lifespan,
        description="Serve LLM applications as graphs of semantic functions and variables.",
    )
    app.router.route_class = OffLoopJsonRoute  # large bodies are parsed off the event loop
    install_error_handlers(app)
    manager.on_engine_drop(_close_remote_client)
    app.add_middleware(BodyLimitMiddleware, max_bytes=manager.config.max_body_bytes)
    app.add_middleware(RequestCounter, metrics=manager.metrics)  # outermost: counts 413s too
    app.state.manager = manager

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True, "engines": len(manager.engines()), "sessions": len(manager.sessions)}

    app.include_router(sessions_router(manager))
    app.include_router(engines_router(manager))
    app.include_router(openai_router(manager))
    app.include_router(chat_router(manager))
    app.include_router(metrics_router(manager, manager.metrics))
    app.include_router(ui_router())
    return app


# engines that talk to another process over HTTP: their clients are closed when they
# leave the pool and when the server stops (the in-process engine outlives the app)
_NETWORK_ENGINES = (RemoteEngine, OpenAIBackend)


def _close_remote_client(handle: EngineHandle, _reason: str) -> None:
    if isinstance(handle.api, _NETWORK_ENGINES):
        asyncio.get_running_loop().create_task(handle.api.close())


async def _poll_engine_stats(manager: Manager) -> None:
    """In-process engines' heartbeats: their stats at start-up, then every interval."""
    while True:
        try:
            await manager.poll_engine_stats()
        except Exception:
            log.exception("polling the in-process engines' stats failed")
        await asyncio.sleep(manager.config.heartbeat_interval_s)


async def _expire_sessions(manager: Manager) -> None:
    """Close idle sessions (``ManagerConfig.session_ttl_s``), checking a few times per TTL."""
    ttl = manager.config.session_ttl_s
    if ttl is None:
        return
    while True:
        await asyncio.sleep(min(max(ttl / 4, 0.05), 30.0))
        for session_id in manager.expire_idle_sessions():
            log.info("session %s expired: idle for over %.0f s", session_id, ttl)


async def _watch_heartbeats(manager: Manager) -> None:
    while True:
        await asyncio.sleep(max(manager.config.heartbeat_interval_s / 2, 0.05))
        for engine_id in manager.drop_stale_engines():
            log.warning("engine %s dropped: heartbeats stopped", engine_id)

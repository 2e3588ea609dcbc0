"""HTTP face of an engine process (``parrot engine``): the engine API as
endpoints, plus registration with a manager and heartbeats.

Every endpoint but ``/healthz`` needs the cluster secret
(:mod:`parrot.protocol.cluster`); without it the answer is 401 and nothing
changes.  The engine presents the same secret to its manager."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated

import httpx
from fastapi import APIRouter, Depends, FastAPI, Header
from fastapi.responses import StreamingResponse

from parrot.engine.local import LocalEngine
from parrot.protocol.asgi import BodyLimitMiddleware, OffLoopJsonRoute, install_error_handlers, ndjson_line
from parrot.protocol.cluster import CLUSTER_SECRET_HEADER, cluster_headers, secret_matches
from parrot.protocol.errors import ParrotError, Unauthorized
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import (
    EngineStats,
    ErrorInfo,
    FillRequest,
    FreeContextRequest,
    GenerateChunk,
    GenerateRequest,
    TokenCapacityRequest,
)

log = logging.getLogger(__name__)


def create_engine_app(
    engine: LocalEngine, *, cluster_secret: str | None, max_body_bytes: int = 64 * 1024 * 1024
) -> FastAPI:
    """The engine's app: ``/healthz`` open, every other route behind the cluster secret.
    ``cluster_secret`` None leaves the engine API open: only for an engine that nothing
    but its own process can reach (``parrot engine`` always has one)."""
    app = FastAPI(title="Parrot engine", version="0.1.0")
    app.router.route_class = OffLoopJsonRoute
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True, "model": engine.model_name}

    protected = APIRouter(dependencies=[Depends(_secret_check(cluster_secret))], route_class=OffLoopJsonRoute)
    _add_context_routes(protected, engine)
    _add_engine_routes(protected, engine)
    app.include_router(protected)
    return app


def _secret_check(cluster_secret: str | None) -> Callable[..., Awaitable[None]]:
    """The dependency that refuses (401) a request without ``cluster_secret`` (None: none needed)."""

    async def require_secret(
        presented: Annotated[str | None, Header(alias=CLUSTER_SECRET_HEADER)] = None,
    ) -> None:
        if cluster_secret is not None and not secret_matches(cluster_secret, presented):
            raise Unauthorized(
                f"this engine answers only its manager: {CLUSTER_SECRET_HEADER} missing or wrong"
            )

    return require_secret


def _add_context_routes(router: APIRouter, engine: LocalEngine) -> None:
    """The routes that work on contexts: ``/fill``, ``/generate`` (an NDJSON stream of
    chunks; a failure mid-stream is its last chunk) and ``/free_context``."""

    @router.post("/fill")
    async def fill(body: FillRequest) -> dict:
        reused = await engine.fill(
            body.tokens,
            body.context_id,
            body.parent_context_id,
            cache_salt=body.cache_salt,
            priority=body.priority,
            retain=body.retain,
        )
        return {"ok": True, "cached_tokens": reused}

    @router.post("/generate", response_class=StreamingResponse)
    async def generate(body: GenerateRequest) -> StreamingResponse:
        sampling = SamplingParams.from_dict(body.sampling)
        stream = engine.generate(sampling, body.context_id, body.parent_context_id, priority=body.priority)

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield ndjson_line(chunk.model_dump())
            except ParrotError as err:
                info = ErrorInfo(code=err.code, message=err.message, detail=err.detail)
                yield ndjson_line(GenerateChunk(done=True, error=info).model_dump())
            finally:
                await stream.aclose()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @router.post("/free_context")
    async def free_context(body: FreeContextRequest) -> dict:
        await engine.free_context(body.context_id)
        return {"ok": True}


def _add_engine_routes(router: APIRouter, engine: LocalEngine) -> None:
    """The routes about the engine as a whole: ``/tokenizer``, ``/token_capacity``, ``/stats``."""

    @router.get("/tokenizer")
    async def tokenizer() -> dict:
        return {
            "model": engine.model_name,
            "max_seq_len": engine.max_seq_len,
            "tokenizer": engine.tokenizer.to_dict(),
        }

    @router.post("/token_capacity", response_model=EngineStats)
    async def token_capacity(body: TokenCapacityRequest) -> EngineStats:
        """Switch the engine's token capacity at run time; answers with the new stats."""
        await engine.set_token_capacity(body.token_capacity)
        return await engine.stats()

    @router.get("/stats", response_model=EngineStats)
    async def stats() -> EngineStats:
        return await engine.stats()


async def register_and_heartbeat(
    engine: LocalEngine,
    manager_url: str,
    own_url: str,
    name: str | None,
    stop: asyncio.Event,
    cluster_secret: str | None = None,
    verify: ssl.SSLContext | bool = True,
) -> None:
    """Register with the manager, then heartbeat (the first one at once: the stats carry
    the engine's latency cap) until ``stop`` is set.
    Re-registers if the manager forgot us (e.g. it restarted, or dropped us
    after missed heartbeats).  A manager that forgot us has given up on every
    call it had here, so the contexts left from before are freed once the new
    registration succeeds (otherwise their KV would be held forever)."""
    headers = cluster_headers(cluster_secret)
    client = httpx.AsyncClient(base_url=manager_url.rstrip("/"), timeout=30, headers=headers, verify=verify)
    async with client:
        engine_id: str | None = None
        interval = 2.0
        while not stop.is_set():
            try:
                if engine_id is None:
                    orphans = await engine.context_ids()
                    resp = await client.post(
                        "/v1/engines",
                        json={
                            "url": own_url,
                            "model": engine.model_name,
                            "max_seq_len": engine.max_seq_len,
                            "name": name,
                        },
                    )
                    resp.raise_for_status()
                    reg = resp.json()
                    engine_id, interval = reg["engine_id"], float(reg["heartbeat_interval_s"])
                    log.info("registered with %s as %s", manager_url, engine_id)
                    for context_id in orphans:
                        with contextlib.suppress(ParrotError):
                            await engine.free_context(context_id)
                    if orphans:
                        log.warning("freed %d context(s) left from before registering", len(orphans))
                    continue  # heartbeat at once: the manager learns the stats (latency cap) now
                else:
                    stats = await engine.stats()
                    resp = await client.post(
                        f"/v1/engines/{engine_id}/heartbeat", json={"stats": stats.model_dump()}
                    )
                    if resp.status_code == 404:
                        engine_id = None
                        continue
                    resp.raise_for_status()
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:  # bad JSON too: keep trying
                log.warning("manager at %s: %r", manager_url, exc)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

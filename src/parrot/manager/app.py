"""The manager's HTTP API (FastAPI).  Thin: parse, authorize, delegate to
:class:`Manager`, serialise.  OpenAPI schema at ``/openapi.json``.

Engine traffic needs the cluster secret (``ManagerConfig.cluster_secret``, in
the ``X-Parrot-Cluster-Secret`` header): registering an engine and its
heartbeats answer 401 without it, and a manager without a secret takes no
remote engines.  ``GET /v1/engines`` answers anyone, but engine URLs and
activity counters only to a caller presenting the secret (the operator).

With API keys (``ManagerConfig.api_keys``), opening a session and
``/v1/completions`` need one (``Authorization: Bearer <key>``; 401 without);
the session then belongs to that key's tenant (:mod:`parrot.manager.tenants`)
and is reached with its own token.

Operations that may tokenize client text (creating, setting, submitting, batches)
run through :meth:`Manager.run_tokenized`, so long text is tokenized off the event
loop and no request stalls the others."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, FastAPI, Header, Query, Response
from fastapi.responses import StreamingResponse

from parrot.manager.batch import apply_batch
from parrot.manager.engines import EngineHandle
from parrot.manager.openai_api import openai_router
from parrot.manager.remote_engine import RemoteEngine
from parrot.manager.service import Manager, error_info
from parrot.protocol.asgi import (
    BodyLimitMiddleware,
    OffLoopJsonRoute,
    bearer_token,
    install_error_handlers,
    ndjson_line,
)
from parrot.protocol.cluster import CLUSTER_SECRET_HEADER, client_tls, secret_matches
from parrot.protocol.errors import BadRequest, NotFound, ParrotError, Unauthorized
from parrot.protocol.schemas import (
    BatchRequest,
    BatchResult,
    CallInfo,
    CallSubmitted,
    CreateSession,
    CreateVariable,
    Criteria,
    EngineDescription,
    EngineInfo,
    EngineRegistered,
    EngineStats,
    Heartbeat,
    SessionCreated,
    SetVariable,
    SubmitCall,
    VariableInfo,
)

log = logging.getLogger(__name__)

Auth = Annotated[str | None, Header(alias="Authorization", description="Bearer <session token>")]
ApiKey = Annotated[
    str | None, Header(alias="Authorization", description="Bearer <API key> (when the manager has keys)")
]
ClusterSecret = Annotated[
    str | None, Header(alias=CLUSTER_SECRET_HEADER, description="the cluster secret (engines, operators)")
]
REGISTER_TIMEOUT_S = 10.0
"""How long registering an engine waits for its description."""


_PUBLIC_STATS = {
    "token_capacity",
    "kv_tokens_total",
    "kv_blocks_total",
    "kv_block_size",
    "latency_cap_tokens",
    "latency_cap_source",
    "decode_ms_base",
    "decode_ms_per_1k_tokens",
    "decode_ms_target",
}
"""What anyone may see of an engine's stats: its size and latency fit, nothing of its activity
(which would tell one tenant about another's work)."""


def _public_stats(stats: EngineStats) -> EngineStats:
    return EngineStats(**stats.model_dump(include=_PUBLIC_STATS))


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
            await manager.executor.drain()

    app = FastAPI(
        title="Parrot manager",
        version="0.1.0",
        lifespan=lifespan,
        description="Serve LLM applications as graphs of semantic functions and variables.",
    )
    app.router.route_class = OffLoopJsonRoute  # large bodies are parsed off the event loop
    install_error_handlers(app)
    manager.pool.on_drop(_close_remote_client)
    app.add_middleware(BodyLimitMiddleware, max_bytes=manager.config.max_body_bytes)
    app.state.manager = manager

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True, "engines": len(manager.pool), "sessions": len(manager.sessions)}

    # ------------------------------------------------------------ sessions
    @app.post("/v1/sessions", status_code=201, response_model=SessionCreated)
    async def create_session(
        body: CreateSession | None = None, authorization: ApiKey = None
    ) -> SessionCreated:
        """A new session of the tenant whose API key is presented (when the manager has
        keys); with ``batch``, that batch applied to it too (all or none: a rejected
        batch leaves no session behind and answers the batch's error)."""
        session, token = manager.create_session(manager.api_keys.tenant(bearer_token(authorization)))
        result = None
        if body is not None and body.batch is not None:
            batch = body.batch
            try:
                result = await manager.run_tokenized(
                    lambda: apply_batch(manager, manager.authorize(session.session_id, token), batch)
                )
            except BaseException:
                manager.close_session(session)
                raise
        return SessionCreated(session_id=session.session_id, token=token, batch=result)

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    async def close_session(session_id: str, authorization: Auth = None) -> Response:
        manager.close_session(manager.authorize(session_id, bearer_token(authorization)))
        return Response(status_code=204)

    # ----------------------------------------------------------- variables
    @app.post("/v1/sessions/{session_id}/variables", status_code=201, response_model=VariableInfo)
    async def create_variable(
        session_id: str, body: CreateVariable, authorization: Auth = None
    ) -> VariableInfo:
        token = bearer_token(authorization)
        var = await manager.run_tokenized(
            lambda: manager.create_variable(manager.authorize(session_id, token), body.name, body.value)
        )
        return manager.var_info(var)

    @app.put("/v1/sessions/{session_id}/variables/{var_id}", response_model=VariableInfo)
    async def set_variable(
        session_id: str, var_id: str, body: SetVariable, authorization: Auth = None
    ) -> VariableInfo:
        token = bearer_token(authorization)
        var = await manager.run_tokenized(
            lambda: manager.set_variable(manager.authorize(session_id, token), var_id, body.value)
        )
        return manager.var_info(var)

    @app.get("/v1/sessions/{session_id}/variables/{var_id}", response_model=VariableInfo)
    async def get_variable(
        session_id: str,
        var_id: str,
        wait: Annotated[
            float, Query(ge=0, le=60, description="Long-poll: seconds to wait while pending.")
        ] = 0,
        criteria: Criteria | None = None,
        authorization: Auth = None,
    ) -> VariableInfo:
        session = manager.authorize(session_id, bearer_token(authorization))
        var = manager.variable(session, var_id)
        manager.read_with(session, var, criteria)
        await manager.wait_variable(var, wait)
        return manager.var_info(var)

    @app.get(
        "/v1/sessions/{session_id}/variables/{var_id}/stream",
        response_class=StreamingResponse,
        responses={
            200: {
                "content": {"application/x-ndjson": {}},
                "description": 'Lines {"text": delta}, then {"done": true, "state", "value", "error"}',
            }
        },
    )
    async def stream_variable(
        session_id: str, var_id: str, criteria: Criteria | None = None, authorization: Auth = None
    ) -> StreamingResponse:
        session = manager.authorize(session_id, bearer_token(authorization))
        var = manager.variable(session, var_id)
        manager.read_with(session, var, criteria)  # a stream is a read like any other

        async def lines() -> AsyncIterator[bytes]:
            sent = 0
            while True:
                if var.producer is not None:
                    if sent > len(var.partial):  # the producer is being re-run on another engine
                        yield ndjson_line({"restart": True})
                        sent = 0
                    while sent < len(var.partial):
                        yield ndjson_line({"text": var.partial[sent]})
                        sent += 1
                if var.state != "pending":
                    if var.producer is None and var.state == "ready":
                        yield ndjson_line({"text": var.value})
                    err = error_info(var.error)
                    yield ndjson_line(
                        {
                            "done": True,
                            "state": var.state,
                            "value": var.value,
                            "error": err.model_dump() if err else None,
                        }
                    )
                    return
                await var.wait_change(30.0)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    # --------------------------------------------------------------- calls
    @app.post("/v1/sessions/{session_id}/calls", status_code=201, response_model=CallSubmitted)
    async def submit_call(session_id: str, body: SubmitCall, authorization: Auth = None) -> CallSubmitted:
        token = bearer_token(authorization)
        call = await manager.run_tokenized(
            lambda: manager.submit_call(manager.authorize(session_id, token), body)
        )
        return CallSubmitted(call_id=call.call_id, outputs={n: o.var.var_id for n, o in call.outputs.items()})

    @app.post("/v1/sessions/{session_id}/batch", response_model=BatchResult)
    async def submit_batch(session_id: str, body: BatchRequest, authorization: Auth = None) -> BatchResult:
        """Create variables, submit calls and set variables in one request, all or none
        (see :mod:`parrot.manager.batch`)."""
        token = bearer_token(authorization)
        return await manager.run_tokenized(
            lambda: apply_batch(manager, manager.authorize(session_id, token), body)
        )

    @app.get("/v1/sessions/{session_id}/calls/{call_id}", response_model=CallInfo)
    async def get_call(session_id: str, call_id: str, authorization: Auth = None) -> CallInfo:
        session = manager.authorize(session_id, bearer_token(authorization))
        return manager.call_info(manager.call(session, call_id))

    @app.get("/v1/sessions/{session_id}/graph")
    async def get_graph(session_id: str, authorization: Auth = None) -> dict:
        session = manager.authorize(session_id, bearer_token(authorization))
        return {
            "calls": [manager.call_info(c).model_dump() for c in session.calls.values()],
            "variables": [
                manager.var_info(v).model_dump(exclude={"value"}) for v in session.variables.values()
            ],
        }

    # ------------------------------------------------------------- engines
    engine_tls = client_tls(manager.config.tls_ca_file)  # a bad CA file fails here, at start-up

    def is_operator(presented: str | None) -> bool:
        secret = manager.config.cluster_secret
        return secret is not None and secret_matches(secret, presented)

    def require_cluster(presented: str | None) -> None:
        if manager.config.cluster_secret is None:
            raise Unauthorized("this manager takes no remote engines: start it with a cluster secret")
        if not is_operator(presented):
            raise Unauthorized(f"engine traffic needs the cluster secret ({CLUSTER_SECRET_HEADER})")

    def cluster_only(secret: ClusterSecret = None) -> None:
        """Engine traffic's guard, run before the body is read: a caller without the secret
        learns nothing, not even whether its body would have been valid."""
        require_cluster(secret)

    @app.post(
        "/v1/engines",
        status_code=201,
        response_model=EngineRegistered,
        dependencies=[Depends(cluster_only)],
    )
    async def register_engine(body: EngineDescription) -> EngineRegistered:
        if not body.url.startswith(("http://", "https://")):
            raise BadRequest("engine url must start with http:// or https://")
        try:
            remote = await RemoteEngine.connect(
                body.url,
                cluster_secret=manager.config.cluster_secret,
                timeout_s=REGISTER_TIMEOUT_S,
                verify=engine_tls,
            )
        except ParrotError as exc:
            raise BadRequest(
                f"could not register the engine at {body.url}: {exc.message}", code="engine_unreachable"
            ) from exc
        if remote.model_name != body.model:
            await remote.close()
            raise BadRequest(f"engine at {body.url} serves {remote.model_name!r}, not {body.model!r}")
        # its tokenizer's byte bound (a pass over the vocabulary), computed here and off the loop
        await asyncio.to_thread(lambda: remote.tokenizer.max_token_bytes)
        handle = manager.pool.register(remote, name=body.name, url=body.url)
        manager.executor.kick()  # queued calls may fit now
        log.info("engine %s registered: %s at %s", handle.engine_id, body.model, body.url)
        return EngineRegistered(
            engine_id=handle.engine_id, heartbeat_interval_s=manager.config.heartbeat_interval_s
        )

    @app.post("/v1/engines/{engine_id}/heartbeat", dependencies=[Depends(cluster_only)])
    async def heartbeat(engine_id: str, body: Heartbeat) -> dict:
        if manager.pool.get(engine_id).url is None:
            raise BadRequest(f"engine {engine_id} is in-process: the manager reads its stats itself")
        manager.pool.heartbeat(engine_id, body.stats)
        manager.executor.kick()
        return {"ok": True}

    @app.get("/v1/engines", response_model=list[EngineInfo])
    async def list_engines(secret: ClusterSecret = None) -> list[EngineInfo]:
        """The pool; an in-process engine's stats are asked for now (a remote one's
        are those of its last heartbeat).  The scheduler does not depend on this:
        stats reach it on the heartbeat interval.  Without the cluster secret: no
        URLs, and only each engine's size and latency fit."""
        operator = is_operator(secret)
        out = []
        for h in manager.pool:
            stats = await manager.refresh_stats(h)
            out.append(
                EngineInfo(
                    engine_id=h.engine_id,
                    name=h.name,
                    model=h.model,
                    max_seq_len=h.max_seq_len,
                    url=h.url if operator else None,
                    alive=h.alive,
                    stats=stats if operator else _public_stats(stats),
                )
            )
        return out

    @app.get("/v1/engines/{engine_id}", response_model=EngineInfo)
    async def get_engine(engine_id: str, secret: ClusterSecret = None) -> EngineInfo:
        for info in await list_engines(secret):
            if info.engine_id == engine_id:
                return info
        raise NotFound(f"engine {engine_id} is not registered", code="engine_not_found")

    app.include_router(openai_router(manager))
    return app


def _close_remote_client(handle: EngineHandle, _reason: str) -> None:
    if isinstance(handle.api, RemoteEngine):
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
        for engine_id in manager.pool.drop_stale():
            log.warning("engine %s dropped: heartbeats stopped", engine_id)

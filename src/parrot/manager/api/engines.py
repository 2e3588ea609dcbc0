"""The HTTP routes of the engine pool (``/v1/engines...``).

Engine traffic needs the cluster secret (``ManagerConfig.cluster_secret``, in
the ``X-Parrot-Cluster-Secret`` header): registering an engine and its
heartbeats answer 401 without it, checked before the body is read, and a
manager without a secret takes no remote engines.  ``GET /v1/engines`` answers
anyone, but engine URLs and activity counters only to a caller presenting the
secret (the operator): others see each engine's size and latency fit.

``POST /v1/engines`` with ``kind`` ``vllm``, ``sglang`` or ``openai`` (the operator's
request) registers an external OpenAI-compatible server as an engine while the manager
runs, as ``parrot serve --backend KIND --backend-url URL`` does at start: its
tokenizer is that of the engines already serving its model, else the one the
manager was started with (``--backend-tokenizer``, else ``--model``)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Header

from parrot.manager.backends.connect import BackendSetupError, connect_backend_off_loop, load_tokenizer
from parrot.manager.backends.openai_backend import BackendOptions, OpenAIBackend
from parrot.manager.backends.remote_engine import RemoteEngine
from parrot.manager.service import Manager
from parrot.protocol.asgi import OffLoopJsonRoute
from parrot.protocol.cluster import CLUSTER_SECRET_HEADER, client_tls, secret_matches
from parrot.protocol.errors import BadRequest, NotFound, ParrotError, Unauthorized
from parrot.protocol.schemas import EngineDescription, EngineInfo, EngineRegistered, EngineStats, Heartbeat
from parrot.protocol.tokenizer import TextTokenizer

__all__ = ["REGISTER_TIMEOUT_S", "engines_router"]

log = logging.getLogger(__name__)

ClusterSecret = Annotated[
    str | None, Header(alias=CLUSTER_SECRET_HEADER, description="the cluster secret (engines, operators)")
]
REGISTER_TIMEOUT_S = 10.0
"""How long registering an engine waits for its description."""
Guard = Callable[..., None]
"""A route dependency that raises unless the caller may pass."""


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
    "prefill_tokens_per_decode_step",
    "decode_path",
}
"""What anyone may see of an engine's stats: its size and latency fit, nothing of its activity
(which would tell one tenant about another's work)."""


def _public_stats(stats: EngineStats) -> EngineStats:
    return EngineStats(**stats.model_dump(include=_PUBLIC_STATS))


def _tokenizer_of(manager: Manager, model: str) -> TextTokenizer | str:
    """The tokenizer of an engine already serving ``model``, else the manager's backend
    tokenizer spec (loaded off the loop by the caller); BadRequest when there is neither."""
    tokenizer = manager.tokenizer_serving(model)
    if tokenizer is not None:
        return tokenizer
    if manager.config.backend_tokenizer is None:
        raise BadRequest(
            f"no tokenizer for model {model!r}: no engine serves it, and the manager was started "
            "without --backend-tokenizer",
            code="no_tokenizer",
        )
    return manager.config.backend_tokenizer


def _is_operator(manager: Manager, presented: str | None) -> bool:
    """Whether ``presented`` is the cluster secret (never, on a manager without one)."""
    secret = manager.config.cluster_secret
    return secret is not None and secret_matches(secret, presented)


def _require_cluster(manager: Manager, presented: str | None) -> None:
    """Unauthorized unless ``presented`` is the cluster secret."""
    if manager.config.cluster_secret is None:
        raise Unauthorized("this manager takes no remote engines: start it with a cluster secret")
    if not _is_operator(manager, presented):
        raise Unauthorized(f"engine traffic needs the cluster secret ({CLUSTER_SECRET_HEADER})")


def engines_router(manager: Manager) -> APIRouter:
    """The routes, bound to ``manager``: registering engines, then the pool's heartbeats
    and listings.  Engine traffic is guarded by the cluster secret before its body is read."""
    router = APIRouter(route_class=OffLoopJsonRoute)
    engine_tls = client_tls(manager.config.tls_ca_file)  # a bad CA file fails here, at start-up

    def cluster_only(secret: ClusterSecret = None) -> None:
        """Engine traffic's guard, run before the body is read: a caller without the secret
        learns nothing, not even whether its body would have been valid."""
        _require_cluster(manager, secret)

    _registration_routes(router, manager, cluster_only, engine_tls)
    _pool_routes(router, manager, cluster_only)
    return router


def _registration_routes(
    router: APIRouter, manager: Manager, cluster_only: Guard, engine_tls: ssl.SSLContext | bool
) -> None:
    """``POST /v1/engines``: a Parrot engine, or an external backend (``kind``)."""
    guard = Depends(cluster_only)

    @router.post("/v1/engines", status_code=201, response_model=EngineRegistered, dependencies=[guard])
    async def register_engine(body: EngineDescription) -> EngineRegistered:
        if not body.url.startswith(("http://", "https://")):
            raise BadRequest("engine url must start with http:// or https://")
        if body.kind != "parrot":
            backend = await _connect_backend(manager, body)
            name = body.name or f"{body.kind}-{backend.url}"
            handle = manager.add_engine(backend, name=name, url=backend.url, polled=True)
            log.info("backend %s registered: %s %s at %s", handle.engine_id, body.kind, body.model, body.url)
        else:
            remote = await _connect_remote(manager, body, engine_tls)
            handle = manager.add_engine(remote, name=body.name, url=body.url)
            log.info("engine %s registered: %s at %s", handle.engine_id, body.model, body.url)
        return EngineRegistered(
            engine_id=handle.engine_id, heartbeat_interval_s=manager.config.heartbeat_interval_s
        )


async def _connect_remote(
    manager: Manager, body: EngineDescription, tls: ssl.SSLContext | bool
) -> RemoteEngine:
    """A Parrot engine at ``body.url``, checked to serve ``body.model``; BadRequest if it
    does not answer or serves another model."""
    try:
        remote = await RemoteEngine.connect(
            body.url, cluster_secret=manager.config.cluster_secret, timeout_s=REGISTER_TIMEOUT_S, verify=tls
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
    return remote


async def _connect_backend(manager: Manager, body: EngineDescription) -> OpenAIBackend:
    """An external backend at ``body.url`` (see the module docstring); BadRequest if no
    tokenizer is known for its model, its options are invalid or it does not answer."""
    tokenizer = _tokenizer_of(manager, body.model)
    if isinstance(tokenizer, str):
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer)
        except BackendSetupError as exc:
            raise BadRequest(f"no tokenizer for model {body.model!r}: {exc}", code="no_tokenizer") from exc
    try:
        options = BackendOptions(
            kind=body.kind,
            model=body.model,
            max_inflight=body.max_inflight,
            warm_prefix=body.warm_prefix,
            send_priority=body.priority,
        )
        return await connect_backend_off_loop(
            body.url, options, tokenizer, max_seq_len=body.max_seq_len, deadline_s=REGISTER_TIMEOUT_S
        )
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    except BackendSetupError as exc:
        raise BadRequest(
            f"could not register the backend at {body.url}: {exc}", code="engine_unreachable"
        ) from exc


def _pool_routes(router: APIRouter, manager: Manager, cluster_only: Guard) -> None:
    """Heartbeats (engines, with the secret) and the pool's listing (anyone; details to
    the operator only)."""
    guard = Depends(cluster_only)

    @router.post("/v1/engines/{engine_id}/heartbeat", dependencies=[guard])
    async def heartbeat(engine_id: str, body: Heartbeat) -> dict:
        manager.engine_heartbeat(engine_id, body.stats)
        return {"ok": True}

    @router.get("/v1/engines", response_model=list[EngineInfo])
    async def list_engines(secret: ClusterSecret = None) -> list[EngineInfo]:
        """The pool; an in-process engine's stats are asked for now (a remote one's
        are those of its last heartbeat).  The scheduler does not depend on this:
        stats reach it on the heartbeat interval.  Without the cluster secret: no
        URLs, and only each engine's size and latency fit."""
        operator = _is_operator(manager, secret)
        return [
            EngineInfo(
                engine_id=h.engine_id,
                name=h.name,
                model=h.model,
                max_seq_len=h.max_seq_len,
                url=h.url if operator else None,
                alive=h.alive,
                stats=stats if operator else _public_stats(stats),
            )
            for h, stats in await manager.engines_with_stats()
        ]

    @router.get("/v1/engines/{engine_id}", response_model=EngineInfo)
    async def get_engine(engine_id: str, secret: ClusterSecret = None) -> EngineInfo:
        for info in await list_engines(secret):
            if info.engine_id == engine_id:
                return info
        raise NotFound(f"engine {engine_id} is not registered", code="engine_not_found")

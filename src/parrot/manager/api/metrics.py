"""``GET /metrics`` (Prometheus text format) and the middleware that counts requests.

Who may scrape: on a manager without API keys (one tenant, the anonymous one)
anyone who can reach it, as vLLM's ``/metrics``; on a manager with API keys the
metrics would tell one tenant about the others' traffic, so a scrape must
present the cluster secret, either in ``X-Parrot-Cluster-Secret`` or as
``Authorization: Bearer <secret>`` (what Prometheus's ``authorization``
setting sends); 401 otherwise.  No metric carries a prompt, a value, or a
session, call, tenant or key (see :mod:`parrot.manager.metrics`).

In-process engines are asked for their stats at the scrape (off the loop, on
their worker), so their counters are current; a remote engine's are those of
its last heartbeat."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from parrot.manager.metrics import ManagerMetrics
from parrot.manager.service import Manager
from parrot.protocol.cluster import CLUSTER_SECRET_HEADER, secret_matches
from parrot.protocol.errors import Unauthorized

__all__ = ["RequestCounter", "metrics_router"]

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Methods labelled by name; any other (a client may send any token) is ``other``."""
UNMATCHED = "unmatched"
"""The endpoint label of a request no route matched (a 404, or refused before routing)."""


def metrics_router(manager: Manager, metrics: ManagerMetrics) -> APIRouter:
    router = APIRouter()

    def check_scraper(request: Request) -> None:
        if not manager.api_keys.required:
            return
        secret = manager.config.cluster_secret
        if secret is None:
            raise Unauthorized(
                "this manager has API keys: /metrics needs the cluster secret, and it was started without one"
            )
        presented = request.headers.get(CLUSTER_SECRET_HEADER)
        auth = request.headers.get("authorization", "")
        if presented is None and auth[:7].lower() == "bearer ":
            presented = auth[7:]
        if not secret_matches(secret, presented):
            raise Unauthorized(
                f"/metrics needs the cluster secret ({CLUSTER_SECRET_HEADER} or 'Authorization: Bearer')"
            )

    @router.get("/metrics", include_in_schema=True, response_class=Response)
    async def scrape(request: Request) -> Response:
        """Prometheus text exposition of the manager's metrics (see docs/metrics.md)."""
        check_scraper(request)
        await manager.poll_engine_stats()
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


class RequestCounter:
    """ASGI middleware: counts each HTTP request once its response starts, labelled by
    the matched route's template (never the raw path, which holds session ids)."""

    def __init__(self, app: ASGIApp, metrics: ManagerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        started = False

        def count(status: int) -> None:
            endpoint = getattr(scope.get("route"), "path", None) or UNMATCHED
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.request(endpoint, method, status)

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                count(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:  # the server's error middleware outside answers 500
                count(500)
            raise

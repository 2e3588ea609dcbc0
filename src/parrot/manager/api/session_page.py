"""The session page (``GET /ui/sessions/{id}``): a session's DAG drawn live in a browser.

The page and its script and style are static files shipped in this package
(``parrot/manager/api/ui``; no CDN, no build step): the same bytes for every session, so
serving them reveals nothing and needs no token.  The page's script reads the
session's token from the URL's fragment (``#token=...``, which browsers never send to
a server, so it stays out of request lines, access logs and ``Referer`` headers),
presents it as ``Authorization: Bearer`` on its requests for
``/v1/sessions/{id}/graph``, and draws what they answer; a missing or wrong token gets
the API's own 401, 403 or 404, which the page shows.  Every response carries a
Content-Security-Policy that allows only this origin's script, style and requests,
and no framing.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

__all__ = ["UI_HEADERS", "ui_router"]

UI_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
"""Headers of every UI response (the page may run only its own files, be framed by none)."""

_FILES = {
    "dag.html": "text/html; charset=utf-8",
    "dag.js": "text/javascript; charset=utf-8",
    "dag.css": "text/css; charset=utf-8",
}


def _load() -> dict[str, bytes]:
    folder = resources.files("parrot.manager.api") / "ui"
    return {name: (folder / name).read_bytes() for name in _FILES}


def ui_router() -> APIRouter:
    """The page's routes; its files are read once, here."""
    files = _load()
    router = APIRouter()

    def answer(name: str) -> Response:
        return Response(files[name], media_type=_FILES[name], headers=UI_HEADERS)

    @router.get("/ui/sessions/{session_id}", include_in_schema=False)
    async def session_page(session_id: str) -> Response:
        """The page (the session is named by the path, which the script reads)."""
        return answer("dag.html")

    @router.get("/ui/static/dag.js", include_in_schema=False)
    async def script() -> Response:
        return answer("dag.js")

    @router.get("/ui/static/dag.css", include_in_schema=False)
    async def style() -> Response:
        return answer("dag.css")

    return router

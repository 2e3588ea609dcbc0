"""``/docs`` (Swagger UI) and ``/redoc`` work offline: every URL their HTML loads is
on the manager itself, and each answers 200 with the asset's content."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import LiveServer

# every URL an HTML page may load: src/href attributes, and the JS string Swagger UI and
# ReDoc are pointed at the schema with
_URL = re.compile(r"""(?:\b(?:src|href)\s*=\s*|\burl:\s*|spec-url\s*=\s*)["']([^"']+)["']""")

JSON = "application/json"


@pytest.fixture
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize(
    ("page", "assets"),
    [
        ("/docs", {".js": "javascript", ".css": "text/css", ".png": "image/png", ".json": JSON}),
        ("/redoc", {".js": "javascript", ".png": "image/png", ".json": JSON}),
    ],
)
def test_page_loads_only_same_origin_urls_that_answer(http, page: str, assets: dict[str, str]) -> None:
    response = http.get(page)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    html = response.text
    assert "://" not in html, "the page names an absolute URL (a CDN?)"
    urls = _URL.findall(html)
    suffixes = {re.search(r"\.\w+$", u).group() for u in urls}  # type: ignore[union-attr]
    assert suffixes == set(assets), urls  # the schema and every script, style and icon
    for url in urls:
        assert url.startswith("/") and not url.startswith("//"), url
        asset = http.get(url)
        assert asset.status_code == 200, url
        suffix = re.search(r"\.\w+$", url).group()  # type: ignore[union-attr]
        assert assets[suffix] in asset.headers["content-type"], (url, asset.headers["content-type"])
        assert len(asset.content) > 1000, url


def test_the_bundled_swagger_ui_is_the_real_script(http) -> None:
    """The script the page loads defines what the page calls (not an empty stand-in)."""
    script = http.get("/static-offline-docs/swagger-ui-bundle.js").text
    assert "SwaggerUIBundle" in script and len(script) > 500_000


def test_an_unknown_asset_is_a_404_and_the_server_goes_on(http) -> None:
    assert http.get("/static-offline-docs/no-such-file.js").status_code == 404
    assert http.get("/static-offline-docs/../../etc/passwd").status_code == 404
    assert http.get("/healthz").json()["ok"] is True

"""An engine in another process, reached over its HTTP API.

Any transport failure becomes :class:`EngineError`; error bodies the engine
returns are rebuilt into the errors it raised.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Sequence

import httpx

from parrot.protocol.cluster import cluster_headers
from parrot.protocol.errors import BadRequest, EngineError, ParrotError, error_from_body
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import EngineStats, GenerateChunk
from parrot.protocol.tokenizer import TextTokenizer


class RemoteEngine:
    def __init__(
        self, url: str, model_name: str, max_seq_len: int, tokenizer: TextTokenizer, client: httpx.AsyncClient
    ):
        self.url = url.rstrip("/")
        self._model = model_name
        self._max_seq_len = max_seq_len
        self._tokenizer = tokenizer
        self._client = client

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        cluster_secret: str | None = None,
        timeout_s: float = 30.0,
        verify: ssl.SSLContext | bool = True,
    ) -> RemoteEngine:
        """Fetch the engine's tokenizer and description, then return a client for it (every
        request presenting ``cluster_secret``; an ``https`` engine's certificate checked
        with ``verify``, see :func:`parrot.protocol.cluster.client_tls`).

        Raises :class:`EngineError` when the engine cannot be reached or answers with an
        error, and :class:`BadRequest` when its answer is not an engine's description."""
        client = httpx.AsyncClient(
            base_url=url.rstrip("/"),
            timeout=httpx.Timeout(timeout_s),
            headers=cluster_headers(cluster_secret),
            verify=verify,
        )
        try:
            info = await _request(client, "GET", "/tokenizer")
            try:
                described = (
                    str(info["model"]),
                    int(info["max_seq_len"]),
                    TextTokenizer.from_dict(info["tokenizer"]),
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise BadRequest(
                    f"{url} did not answer GET /tokenizer as a Parrot engine does: {exc!r}"
                ) from exc
        except BaseException:
            await client.aclose()
            raise
        return cls(url, *described, client)

    @property
    def model_name(self) -> str:
        return self._model

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def tokenizer(self) -> TextTokenizer:
        return self._tokenizer

    async def close(self) -> None:
        await self._client.aclose()

    async def fill(
        self,
        tokens: Sequence[int],
        context_id: int,
        parent_context_id: int | None = None,
        cache_salt: str = "",
        *,
        priority: int = 0,
        retain: bool = False,
    ) -> int | None:
        """Append ``tokens``; returns how many took their KV from the engine's prefix cache
        (None from an engine whose answer does not say)."""
        body = {"tokens": list(tokens), "context_id": context_id, "parent_context_id": parent_context_id}
        if cache_salt:
            body["cache_salt"] = cache_salt
        if priority:
            body["priority"] = priority
        if retain:
            body["retain"] = True
        answer = await _request(
            self._client,
            "POST",
            "/fill",
            body,
            timeout=_NO_READ_TIMEOUT,  # a long prompt on a busy engine takes a while
        )
        reused = answer.get("cached_tokens")
        return reused if isinstance(reused, int) and 0 <= reused <= len(tokens) else None

    async def generate(
        self,
        sampling: SamplingParams,
        context_id: int,
        parent_context_id: int | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[GenerateChunk]:
        body = {
            "sampling": sampling.to_dict(),
            "context_id": context_id,
            "parent_context_id": parent_context_id,
        }
        if priority:
            body["priority"] = priority
        try:
            # no read timeout: a long generation may pause between tokens while the engine is busy;
            # a dead engine is caught by the broken stream or by its missing heartbeats
            stream = self._client.stream("POST", "/generate", json=body, timeout=_NO_READ_TIMEOUT)
            async with stream as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise _error(resp)
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    chunk = GenerateChunk.model_validate_json(line)
                    if chunk.error is not None:
                        raise error_from_body(500, {"error": chunk.error.model_dump()})
                    yield chunk
                    if chunk.done:
                        return
            raise EngineError(f"engine at {self.url} ended the generate stream without finishing")
        except httpx.HTTPError as exc:
            raise EngineError(f"engine at {self.url} failed during generate: {exc!r}") from exc

    async def free_context(self, context_id: int) -> None:
        await _request(self._client, "POST", "/free_context", {"context_id": context_id})

    async def stats(self) -> EngineStats:
        return EngineStats.model_validate(await _request(self._client, "GET", "/stats"))

    async def set_token_capacity(self, n: int) -> None:
        """Change the engine's token capacity (see ``LocalEngine.set_token_capacity``)."""
        await _request(self._client, "POST", "/token_capacity", {"token_capacity": n})


_NO_READ_TIMEOUT = httpx.Timeout(30.0, read=None)


async def _request(
    client: httpx.AsyncClient,
    method: str,
    path: str,
    body: dict | None = None,
    timeout: httpx.Timeout | None = None,
) -> dict:
    try:
        resp = await client.request(method, path, json=body, timeout=timeout or client.timeout)
    except httpx.HTTPError as exc:
        raise EngineError(f"engine at {client.base_url} unreachable on {path}: {exc!r}") from exc
    if resp.status_code >= 400:
        raise _error(resp)
    if not resp.content:
        return {}
    try:
        body = resp.json()
    except ValueError as exc:
        raise EngineError(f"engine at {client.base_url} answered {path} with invalid JSON") from exc
    if not isinstance(body, dict):
        raise EngineError(f"engine at {client.base_url} answered {path} with a JSON {type(body).__name__}")
    return body


def _error(resp: httpx.Response) -> ParrotError:
    try:
        body = resp.json()
    except (json.JSONDecodeError, ValueError):
        body = resp.text[:500]
    return error_from_body(resp.status_code, body)

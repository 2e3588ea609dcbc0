"""A scripted OpenAI-compatible server on loopback that fails in one chosen way.

``GET /v1/models`` always answers (model ``tiny``, 512 tokens), so the manager keeps
finding the server alive and re-places calls on it; ``POST /v1/completions`` misbehaves
as ``Script.mode`` says; ``POST /tokenize`` answers ``Script.tokenize`` when set (404
otherwise).  Modes: ``ok`` (a valid two-chunk answer), ``ok-ids`` (one that carries
its token ids), ``slow-ok`` (a valid answer after ``SLOW_S``), ``500``, ``400``, ``slow`` (no
byte for ``SLOW_S``), ``bad-json``, ``no-text`` (a choice without text), ``wrong-ids``
(token ids outside the vocabulary), ``no-done`` (the stream ends without ``[DONE]``),
``abort`` (finish_reason ``abort``), ``ok-models-only`` (completions answer 404),
``paced`` (``max_tokens`` one-token chunks, each after ``PACE_BASE_S`` plus
``PACE_PER_TOKEN_S`` per token of every answer in flight, prompt and sent tokens: a
server whose step time grows with its load as an engine's does).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.conftest import LiveServer, serve_asgi

SLOW_S = 2.0
MAX_SEQ_LEN = 512
PACE_BASE_S = 0.04
PACE_PER_TOKEN_S = 5e-6


@dataclass
class Script:
    mode: str
    tokenize: list[int] | None = None
    completions: int = 0  # POST /v1/completions received
    bodies: list[dict] = field(default_factory=list)  # their JSON bodies
    in_flight_tokens: int = 0  # mode paced: tokens of the answers being streamed


@dataclass
class Misbehaving:
    live: LiveServer
    script: Script

    @property
    def url(self) -> str:
        return self.live.url

    def stop(self) -> None:
        self.live.stop()


def _sse(*events: str) -> StreamingResponse:
    async def body():
        for e in events:
            yield f"data: {e}\n\n".encode()

    return StreamingResponse(body(), media_type="text/event-stream")


def _chunk(text: str, finish: str | None = None, extra: str = "") -> str:
    finish_json = "null" if finish is None else f'"{finish}"'
    return f'{{"choices":[{{"index":0,"text":"{text}","finish_reason":{finish_json}{extra}}}]}}'


_ONE_ID = ',"token_ids":[7]'


async def _paced(script: Script, body: dict):
    held = len(body["prompt"])  # token ids: the adapter sends them to a vllm-kind backend
    script.in_flight_tokens += held
    try:
        for _ in range(body["max_tokens"] - 1):
            await asyncio.sleep(PACE_BASE_S + PACE_PER_TOKEN_S * script.in_flight_tokens)
            yield f"data: {_chunk('a', extra=_ONE_ID)}\n\n".encode()
            script.in_flight_tokens += 1
            held += 1
        yield f"data: {_chunk('a', 'length', _ONE_ID)}\n\ndata: [DONE]\n\n".encode()
    finally:
        script.in_flight_tokens -= held


def _app(script: Script) -> Starlette:
    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "max_model_len": MAX_SEQ_LEN}]})

    async def tokenize(_: Request) -> Response:
        if script.tokenize is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return JSONResponse({"tokens": script.tokenize})

    async def completions(request: Request) -> Response:
        script.completions += 1
        script.bodies.append(await request.json())
        mode = script.mode
        if mode == "500":
            return JSONResponse({"error": {"message": "engine exploded"}}, status_code=500)
        if mode == "400":
            return JSONResponse({"error": {"message": "no such sampling option"}}, status_code=400)
        if mode == "ok-models-only":
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if mode in ("slow", "slow-ok"):
            await asyncio.sleep(SLOW_S)
        if mode == "paced":
            return StreamingResponse(_paced(script, script.bodies[-1]), media_type="text/event-stream")
        events = {
            "ok": [_chunk("he"), _chunk("llo", "length"), "[DONE]"],
            "ok-ids": [
                _chunk("he", extra=',"token_ids":[7,8]'),
                _chunk("llo", "stop", ',"token_ids":[9]'),
                "[DONE]",
            ],
            "slow-ok": [_chunk("late", "length"), "[DONE]"],
            "slow": [_chunk("late", "length"), "[DONE]"],
            "bad-json": [_chunk("he"), "{not json", "[DONE]"],
            "no-text": ['{"choices":[{"index":0,"finish_reason":null}]}', "[DONE]"],
            "wrong-ids": [_chunk("he", extra=',"token_ids":[1000000]'), "[DONE]"],
            "no-done": [_chunk("he")],
            "abort": [_chunk("he"), _chunk("", "abort"), "[DONE]"],
        }[mode]
        return _sse(*events)

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


def start_misbehaving(script: Script) -> Misbehaving:
    """Serve ``script`` on a free loopback port (a thread of its own) until ``stop``."""
    return Misbehaving(serve_asgi(_app(script), LiveServer(url="", manager=None)), script)  # type: ignore[arg-type]

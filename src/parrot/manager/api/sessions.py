"""The HTTP routes of sessions, their variables and their calls (``/v1/sessions/...``).

Thin: parse, authorize (each session is reached with its own token), delegate to
:class:`~parrot.manager.service.Manager`, serialise.  Operations that may
tokenize client text (creating, setting, submitting, batches) run through
:meth:`Manager.run_tokenized`, so long text is tokenized off the event loop and
no request stalls the others."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query, Response
from fastapi.responses import StreamingResponse

from parrot.manager.api.batch import apply_batch, wait_for_values
from parrot.manager.api.output_constraints import check_batch, check_outputs
from parrot.manager.service import Manager
from parrot.manager.var_stream import variable_events
from parrot.manager.views import MAX_GRAPH_TEXT_CHARS, MAX_GRAPH_VALUE_CHARS, call_info, var_info, var_text
from parrot.protocol import clock
from parrot.protocol.asgi import OffLoopJsonRoute, bearer_token, ndjson_line
from parrot.protocol.clock import TIME_HEADER
from parrot.protocol.schemas import (
    BatchRequest,
    BatchResult,
    CallInfo,
    CallSubmitted,
    CreateSession,
    CreateVariable,
    Criteria,
    SessionCreated,
    SetVariable,
    SubmitCall,
    VariableInfo,
)

__all__ = ["sessions_router"]

Auth = Annotated[str | None, Header(alias="Authorization", description="Bearer <session token>")]
ApiKey = Annotated[
    str | None, Header(alias="Authorization", description="Bearer <API key> (when the manager has keys)")
]


def sessions_router(manager: Manager) -> APIRouter:
    """The routes, bound to ``manager``, one group per resource (each route a few lines:
    parse, authorize, call a :class:`Manager` method, serialise)."""
    router = APIRouter(route_class=OffLoopJsonRoute)  # large bodies are parsed off the event loop
    _session_routes(router, manager)
    _variable_writes(router, manager)
    _variable_reads(router, manager)
    _call_routes(router, manager)
    _graph_route(router, manager)
    return router


def _session_routes(router: APIRouter, manager: Manager) -> None:
    """Opening (with an optional batch) and closing sessions."""

    @router.post("/v1/sessions", status_code=201, response_model=SessionCreated)
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
                await check_batch(batch)
                result = await manager.run_tokenized(
                    lambda: apply_batch(manager, manager.authorize(session.session_id, token), batch)
                )
            except BaseException:
                manager.close_session(session)
                raise
            await wait_for_values(manager, session, batch, result)
        return SessionCreated(session_id=session.session_id, token=token, batch=result)

    @router.delete("/v1/sessions/{session_id}", status_code=204)
    async def close_session(session_id: str, authorization: Auth = None) -> Response:
        manager.close_session(manager.authorize(session_id, bearer_token(authorization)))
        return Response(status_code=204)


def _variable_writes(router: APIRouter, manager: Manager) -> None:
    """Creating and setting variables (their text tokenized off the loop)."""

    @router.post("/v1/sessions/{session_id}/variables", status_code=201, response_model=VariableInfo)
    async def create_variable(
        session_id: str, body: CreateVariable, authorization: Auth = None
    ) -> VariableInfo:
        token = bearer_token(authorization)
        var = await manager.run_tokenized(
            lambda: manager.create_variable(manager.authorize(session_id, token), body.name, body.value)
        )
        return var_info(var)

    @router.put("/v1/sessions/{session_id}/variables/{var_id}", response_model=VariableInfo)
    async def set_variable(
        session_id: str, var_id: str, body: SetVariable, authorization: Auth = None
    ) -> VariableInfo:
        token = bearer_token(authorization)
        var = await manager.run_tokenized(
            lambda: manager.set_variable(manager.authorize(session_id, token), var_id, body.value)
        )
        return var_info(var)


def _variable_reads(router: APIRouter, manager: Manager) -> None:
    """Reading a variable, long-polled or streamed; a read may carry the criteria it asks for."""

    @router.get("/v1/sessions/{session_id}/variables/{var_id}", response_model=VariableInfo)
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
        return var_info(var)

    @router.get(
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
            async for event in variable_events(var):
                yield ndjson_line(event)

        return StreamingResponse(lines(), media_type="application/x-ndjson")


def _call_routes(router: APIRouter, manager: Manager) -> None:
    """Submitting calls, one or in a batch (constraints compiled off the loop first), and
    reading one."""

    @router.post("/v1/sessions/{session_id}/calls", status_code=201, response_model=CallSubmitted)
    async def submit_call(session_id: str, body: SubmitCall, authorization: Auth = None) -> CallSubmitted:
        token = bearer_token(authorization)
        manager.authorize(session_id, token)  # 401/404 before any compiling
        await check_outputs(body.placeholders)
        call = await manager.run_tokenized(
            lambda: manager.submit_call(manager.authorize(session_id, token), body)
        )
        return CallSubmitted(call_id=call.call_id, outputs={n: o.var.var_id for n, o in call.outputs.items()})

    @router.post("/v1/sessions/{session_id}/batch", response_model=BatchResult)
    async def submit_batch(session_id: str, body: BatchRequest, authorization: Auth = None) -> BatchResult:
        """Create variables, submit calls and set variables in one request, all or none
        (see :mod:`parrot.manager.api.batch`)."""
        token = bearer_token(authorization)
        session = manager.authorize(session_id, token)
        await check_batch(body)
        result = await manager.run_tokenized(
            lambda: apply_batch(manager, manager.authorize(session_id, token), body)
        )
        await wait_for_values(manager, session, body, result)
        return result

    @router.get("/v1/sessions/{session_id}/calls/{call_id}", response_model=CallInfo)
    async def get_call(session_id: str, call_id: str, authorization: Auth = None) -> CallInfo:
        session = manager.authorize(session_id, bearer_token(authorization))
        return call_info(manager.call(session, call_id))


def _graph_route(router: APIRouter, manager: Manager) -> None:
    """The session's DAG, as the session page draws it."""

    @router.get("/v1/sessions/{session_id}/graph")
    async def get_graph(
        session_id: str,
        response: Response,
        value_chars: Annotated[
            int,
            Query(
                ge=0,
                le=MAX_GRAPH_VALUE_CHARS,
                description="With each variable, up to this many characters of its text: its "
                "value when ready, what its producer has streamed so far while pending.",
            ),
        ] = 0,
        authorization: Auth = None,
    ) -> dict:
        """The session's calls and variables (with ``value_chars``, each variable's text,
        at most MAX_GRAPH_TEXT_CHARS in all).  Consistent with reads: a variable shown
        ready is readable, and a call is shown done once its last output is ready (a
        call's earlier outputs are readable, and shown ready, while it still runs).
        ``X-Parrot-Time`` carries the manager's clock as it answers, on the scale of the
        calls' timestamps, so a client can place them on its own clock even where the
        two machines' (or a stepped system clock's) wall times disagree."""
        session = manager.authorize(session_id, bearer_token(authorization))
        response.headers[TIME_HEADER] = f"{clock.wall():.6f}"
        variables = []
        budget = MAX_GRAPH_TEXT_CHARS  # for the whole answer
        for v in session.variables.values():
            info = var_info(v).model_dump(exclude={"value"})
            if value_chars:
                text, cut = var_text(v, min(value_chars, budget))
                budget -= len(text)
                info["text"], info["text_truncated"] = text, cut
            variables.append(info)
        return {"calls": [call_info(c).model_dump() for c in session.calls.values()], "variables": variables}

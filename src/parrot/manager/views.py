"""What clients see of variables and calls: the protocol's views of the graph's objects."""

from __future__ import annotations

from parrot.manager.dag.graph import Call, Variable
from parrot.protocol.errors import ParrotError
from parrot.protocol.schemas import CallInfo, ErrorInfo, VariableInfo

__all__ = ["MAX_GRAPH_TEXT_CHARS", "MAX_GRAPH_VALUE_CHARS", "call_info", "error_info", "var_info", "var_text"]

MAX_GRAPH_VALUE_CHARS = 65536
"""The most characters of each variable's text one ``/graph`` answer carries (its
``value_chars``): a page polling a session twice a second must not move whole
large values each time."""

MAX_GRAPH_TEXT_CHARS = 1 << 20
"""The most characters of variables' text one ``/graph`` answer carries in all: past
it, the remaining variables' text is cut to nothing (``text_truncated``), so one
answer stays small enough to build on the event loop whatever the session holds."""


def error_info(err: ParrotError | None) -> ErrorInfo | None:
    if err is None:
        return None
    return ErrorInfo(code=err.code, message=err.message, detail=err.detail)


def var_info(var: Variable) -> VariableInfo:
    return VariableInfo(
        var_id=var.var_id,
        name=var.name,
        state=var.state,
        value=var.value,
        error=error_info(var.error),
        producer=var.producer.call_id if var.producer else None,
        consumers=[c.call_id for c in var.consumers],
    )


def call_info(call: Call) -> CallInfo:
    return CallInfo(
        call_id=call.call_id,
        name=call.name,
        state=call.state,
        inputs={n: (v.var_id if isinstance(v, Variable) else "<constant>") for n, v in call.inputs.items()},
        outputs={n: o.var.var_id for n, o in call.outputs.items()},
        engine_id=call.engine_id,
        objective=call.objective,  # type: ignore[arg-type]
        task_group=call.task_group,
        placement=call.placement,
        error=error_info(call.error),
        prompt_tokens=call.prompt_tokens,
        generated_tokens=call.generated_tokens,
        prefix_reused_tokens=call.prefix_reused_tokens,
        filled_tokens=call.filled_tokens,
        submitted_at=call.submitted_at,
        dispatched_at=call.dispatched_at,
        started_at=call.started_at,
        first_token_at=call.first_token_at,
        finished_at=call.finished_at,
    )


def var_text(var: Variable, limit: int) -> tuple[str, bool]:
    """A variable's text as a reader sees it now, cut to ``limit`` characters: its value
    once ready, the text its producer has streamed so far while pending (the pieces are
    joined only up to ``limit``), "" when failed.  Returns (text, whether it was cut)."""
    if var.state == "ready":
        value = var.value or ""
        return value[:limit], len(value) > limit
    if var.state == "failed":
        return "", False
    pieces: list[str] = []
    size = 0
    for piece in var.partial:
        if size + len(piece) > limit:
            pieces.append(piece[: limit - size])
            return "".join(pieces), True
        pieces.append(piece)
        size += len(piece)
    return "".join(pieces), False

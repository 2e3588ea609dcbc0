"""What clients see of variables and calls: the protocol's views of the graph's objects."""

from __future__ import annotations

from parrot.manager.graph import Call, Variable
from parrot.protocol.errors import ParrotError
from parrot.protocol.schemas import CallInfo, ErrorInfo, VariableInfo

__all__ = ["call_info", "error_info", "var_info"]


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
        submitted_at=call.submitted_at,
        dispatched_at=call.dispatched_at,
        started_at=call.started_at,
        first_token_at=call.first_token_at,
        finished_at=call.finished_at,
    )

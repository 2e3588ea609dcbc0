"""Batches: many operations on one session in one request, applied all or none.

The ops are validated in order by the single-op endpoints' own checks, on detached
objects (a :class:`_Plan`); only the graph edges of staged calls are added in place,
and removed again if an op is rejected.  Nothing awaits between the first op and the
commit (:meth:`~parrot.manager.service.Manager.commit`), so nobody sees a half-applied
batch, and a rejected one's error is the single-op error prefixed ``op <i> (<kind>): ``
with ``detail["op"] = i``.  Why and how: docs/manager.md, "Batches: all or none".
"""

from __future__ import annotations

import asyncio

from parrot.manager.dag.graph import Call, Session, Variable, link_call, unlink_call
from parrot.manager.service import Manager
from parrot.manager.staging import StagedCall, inline_bytes, value_bytes
from parrot.manager.views import var_info
from parrot.protocol.errors import BadRequest, BindingError, Conflict, ParrotError
from parrot.protocol.schemas import (
    BatchBinding,
    BatchOp,
    BatchOpResult,
    BatchRequest,
    BatchResult,
    CreateVariableOp,
    PlaceholderBinding,
    SetVariableOp,
    SubmitCallOp,
)


def apply_batch(manager: Manager, session: Session, req: BatchRequest) -> BatchResult:
    """Validate every op of ``req``, then apply them all; raises (changing nothing) if any is invalid."""
    plan = _Plan(manager, session, req.ops)
    for index, op in enumerate(req.ops):
        try:
            plan.stage(index, op)
        except ParrotError as err:
            plan.rollback()
            raise type(err)(
                f"op {index} ({op.op}): {err.message}", code=err.code, detail={**err.detail, "op": index}
            ) from err
        except BaseException:
            plan.rollback()
            raise
    try:
        if req.wait is not None:
            plan.check_wait(req.wait.refs)
        manager.settle_tokens()  # a check put off for long text: run again once it is tokenized
        plan.check_quota()
    except BaseException:
        plan.rollback()
        raise
    plan.commit()
    return BatchResult(results=plan.results, refs={ref: var.var_id for ref, var in plan.refs.items()})


async def wait_for_values(manager: Manager, session: Session, req: BatchRequest, result: BatchResult) -> None:
    """Wait (up to ``req.wait.wait_s``) until every ref of the applied batch's ``wait`` is
    no longer pending, then put each one's variable into ``result.values``."""
    if req.wait is None:
        return
    refs = list(dict.fromkeys(req.wait.refs))
    variables = [manager.variable(session, result.refs[ref]) for ref in refs]
    await asyncio.gather(*(manager.wait_variable(var, req.wait.wait_s) for var in variables))
    result.values = {ref: var_info(var) for ref, var in zip(refs, variables, strict=True)}


def _first_definitions(ops: list[BatchOp]) -> dict[str, int]:
    """Ref -> index of the first op that defines it."""
    first: dict[str, int] = {}
    for index, op in enumerate(ops):
        if isinstance(op, CreateVariableOp) and op.ref is not None:
            first.setdefault(op.ref, index)
        elif isinstance(op, SubmitCallOp):
            for b in op.placeholders:
                if b.define_ref is not None:
                    first.setdefault(b.define_ref, index)
    return first


class _Plan:
    """A batch validated up to some op.  Invariants: ``steps`` (new variables
    and staged calls, in op order) are not in the session; ``linked`` are the
    staged calls whose edges are in the graph; ``sets`` are not applied."""

    def __init__(self, manager: Manager, session: Session, ops: list[BatchOp]):
        self.manager = manager
        self.session = session
        self.first_definitions = _first_definitions(ops)
        self.refs: dict[str, Variable] = {}
        self.steps: list[Variable | StagedCall] = []
        self.linked: list[Call] = []
        self.sets: dict[Variable, tuple[str, int]] = {}  # variable -> (value, index of its op)
        self.results: list[BatchOpResult] = []
        self.value_bytes = 0  # client-supplied values of its ops, for the tenant's quota

    # ------------------------------------------------------------ staging
    def stage(self, index: int, op: BatchOp) -> None:
        if isinstance(op, CreateVariableOp):
            self._create(op)
        elif isinstance(op, SubmitCallOp):
            self._submit(op)
        else:
            self._set(index, op)

    def _create(self, op: CreateVariableOp) -> None:
        var = self.manager.new_variable(self.session, op.name, op.value)
        self.value_bytes += value_bytes(op.value)
        self._define(op.ref, var)
        self.steps.append(var)
        self.results.append(BatchOpResult(op=op.op, var_id=var.var_id))

    def _submit(self, op: SubmitCallOp) -> None:
        staged = self.manager.stage_call(self.session, op, self._lookup)
        self.value_bytes += inline_bytes(op)
        call = staged.call
        for out in call.outputs.values():
            if out.var in self.sets:
                raise Conflict(
                    f"variable {out.var.var_id} is set by op {self.sets[out.var][1]} of this batch; "
                    "it cannot be a call's output",
                    code="variable_has_value",
                )
        link_call(call)
        self.linked.append(call)
        for b in op.placeholders:
            if b.define_ref is not None:
                if b.name not in call.outputs:
                    raise BindingError(f"input {b.name!r} cannot define a ref; only outputs can")
                self._define(b.define_ref, call.outputs[b.name].var)
        self.steps.append(staged)
        outputs = {n: o.var.var_id for n, o in call.outputs.items()}
        self.results.append(BatchOpResult(op=op.op, call_id=call.call_id, outputs=outputs))

    def _set(self, index: int, op: SetVariableOp) -> None:
        var = self._named(op.var_id, op.ref, "set_variable")
        if var is None:
            raise BindingError("set_variable needs exactly one of 'var_id' or 'ref'")
        if var in self.sets:
            raise Conflict(
                f"variable {var.var_id} is already set by op {self.sets[var][1]} of this batch",
                code="variable_not_pending",
            )
        self.manager.check_settable(var, op.value)
        self.value_bytes += value_bytes(op.value)
        self.sets[var] = (op.value, index)
        self.results.append(BatchOpResult(op=op.op, var_id=var.var_id))

    # --------------------------------------------------------------- refs
    def _define(self, ref: str | None, var: Variable) -> None:
        if ref is None:
            return
        if ref in self.refs:
            raise BindingError(
                f"ref {ref!r} is already defined by op {self.first_definitions[ref]}", code="duplicate_ref"
            )
        self.refs[ref] = var

    def _lookup(self, b: PlaceholderBinding) -> Variable | None:
        ref = b.ref if isinstance(b, BatchBinding) else None
        return self._named(b.var_id, ref, f"binding {b.name!r}")

    def _named(self, var_id: str | None, ref: str | None, what: str) -> Variable | None:
        """The variable named by ``var_id`` (in the session) or ``ref`` (in this batch), if either."""
        if var_id is not None and ref is not None:
            raise BindingError(f"{what} names both a 'var_id' and a 'ref'; give one")
        if var_id is not None:
            return self.manager.variable(self.session, var_id)
        if ref is None:
            return None
        var = self.refs.get(ref)
        if var is not None:
            return var
        if ref in self.first_definitions:
            raise BindingError(
                f"ref {ref!r} is used before op {self.first_definitions[ref]} defines it", code="unknown_ref"
            )
        raise BindingError(f"ref {ref!r} is not defined in this batch", code="unknown_ref")

    # --------------------------------------------------------------- wait
    def check_wait(self, refs: list[str]) -> None:
        """Raise unless every ref is defined by the batch and can get its value without a
        later request: the answer would otherwise wait for what only the waiting client
        could send (a set it queued behind this batch)."""
        walked: set[Variable] = set()
        for ref in refs:
            var = self.refs.get(ref)
            if var is None:
                raise BindingError(f"wait: ref {ref!r} is not defined in this batch", code="unknown_ref")
            blocker = self._unset_upstream(var, walked)
            if blocker is not None:
                raise BadRequest(
                    f"wait: ref {ref!r} depends on variable {blocker.var_id}"
                    f"{f' ({blocker.name!r})' if blocker.name else ''}, which has no value, no producer "
                    "and is not set by this batch; its value could only come from a later request",
                    code="wait_needs_input",
                    detail={"ref": ref, "var_id": blocker.var_id},
                )

    def _unset_upstream(self, var: Variable, walked: set[Variable]) -> Variable | None:
        """A variable upstream of ``var`` (itself included) with no value, no producer and
        no set in this batch, if any.  ``walked`` holds the variables already cleared by
        earlier walks (iterative: a session's chains may be deeper than Python's recursion)."""
        stack = [var]
        while stack:
            node = stack.pop()
            if node in walked:
                continue
            walked.add(node)
            if node.state != "pending" or node in self.sets:
                continue
            if node.producer is None:
                return node
            stack.extend(node.producer.input_vars())
        return None

    # ----------------------------------------------------- end of the plan
    def rollback(self) -> None:
        """Remove the edges of the calls linked so far; the plan is dropped after."""
        for call in reversed(self.linked):
            unlink_call(call)
        self.linked.clear()

    def check_quota(self) -> None:
        """Raise QuotaExceeded unless the session's tenant may hold the whole batch."""
        calls = sum(1 for step in self.steps if isinstance(step, StagedCall))
        self.manager.check_room(self.session, calls=calls, value_bytes=self.value_bytes)

    def commit(self) -> None:
        """Apply the whole validated batch (raises nothing: every op was validated)."""
        sets = {var: value for var, (value, _) in self.sets.items()}
        self.manager.commit(self.session, self.steps, sets, value_bytes=self.value_bytes)

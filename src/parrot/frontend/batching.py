"""Operations recorded in a ``session.batch()`` block, sent as one request at its end."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from parrot.frontend.variable import SemanticVariable
from parrot.frontend.wire import parse_as, record_info
from parrot.protocol.errors import BadRequest, ParrotError
from parrot.protocol.schemas import MAX_BATCH_OPS, MAX_BATCH_WAIT_S, BatchRequest, BatchResult

if TYPE_CHECKING:
    from parrot.frontend.async_session import QueuedRequest
    from parrot.frontend.function import SemanticFunction

__all__ = ["RecordedBatch"]


class RecordedBatch:
    """Operations recorded in a ``session.batch()`` block, sent as one
    ``POST /v1/sessions/{sid}/batch`` when the block ends.

    Invariants: every variable the batch creates (with ``variable()`` or as a
    call's output) has a ref unique in the batch, ``_pending`` set to ``job``
    (async sessions; ``None`` for sync ones) and no id until :meth:`settle`
    assigns the manager's; a variable from outside the batch is named by its
    id, which must be known when :meth:`body` runs (``outside`` lists them).
    Values given to ``set`` are cached on their variables only by
    :meth:`settle`, once the manager accepted the whole batch.

    With ``fetch_outputs`` the request also asks for the values of the batch's final
    outputs (the outputs of its calls that no call of the batch reads): the manager
    answers once they are in (at most :data:`MAX_BATCH_WAIT_S` later), and :meth:`settle`
    caches them, so reading them costs no request.  One still pending then is read as
    usual.
    """

    def __init__(self, job: QueuedRequest | None, *, fetch_outputs: bool = False):
        self.job = job
        self.fetch_outputs = fetch_outputs
        self.refs: dict[SemanticVariable, str] = {}
        self.outside: list[SemanticVariable] = []
        self.sets: list[tuple[SemanticVariable, str]] = []
        self.outputs: list[SemanticVariable] = []  # of the batch's calls, in op order
        self.read_inside: set[SemanticVariable] = set()  # inputs of the batch's calls
        self._ops: list[Callable[[], dict[str, Any]]] = []  # built at send time: outside ids are known then

    def __len__(self) -> int:
        return len(self._ops)

    # ---------------------------------------------------------- recording
    def variable(self, var: SemanticVariable, body: dict[str, Any]) -> None:
        self._check_room()
        op = {"op": "create_variable", "ref": self._new_ref(var), **body}
        self._ops.append(lambda: op)

    def call(self, fn: SemanticFunction, inputs: dict[str, Any], outputs: list[SemanticVariable]) -> None:
        self._check_room()
        for value in inputs.values():
            if isinstance(value, SemanticVariable):
                self._use(value)
                self.read_inside.add(value)
        output_refs = {str(var.name): self._new_ref(var) for var in outputs}
        self.outputs.extend(outputs)
        self._ops.append(lambda: fn.batch_op(inputs, self.refs.get, output_refs))

    def set(self, var: SemanticVariable, value: str) -> None:
        self._check_room()
        self._use(var)
        self.sets.append((var, value))
        self._ops.append(lambda: {"op": "set_variable", **self._names(var), "value": value})

    def _check_room(self) -> None:
        if len(self._ops) >= MAX_BATCH_OPS:
            raise BadRequest(f"a batch holds at most {MAX_BATCH_OPS} operations")

    def _new_ref(self, var: SemanticVariable) -> str:
        ref = self.refs[var] = f"r{len(self.refs)}"
        var._pending = self.job
        return ref

    def _use(self, var: SemanticVariable) -> None:
        if var not in self.refs:
            self.outside.append(var)

    def _names(self, var: SemanticVariable) -> dict[str, str]:
        ref = self.refs.get(var)
        if ref is not None:
            return {"ref": ref}
        if var.id is None:
            raise ParrotError(f"variable {var.name!r} has no id yet", code="client_error")
        return {"var_id": var.id}

    # ------------------------------------------------------------ sending
    def final_outputs(self) -> list[SemanticVariable]:
        """The outputs of the batch's calls that no call of the batch reads."""
        return [var for var in self.outputs if var not in self.read_inside]

    def body(self) -> dict[str, Any]:
        """The ``BatchRequest`` JSON body, checked against the wire schema."""
        body: dict[str, Any] = {"ops": [op() for op in self._ops]}
        finals = self.final_outputs() if self.fetch_outputs else []
        if finals:
            body["wait"] = {"refs": [self.refs[var] for var in finals], "wait_s": MAX_BATCH_WAIT_S}
        BatchRequest.model_validate(body)
        return body

    @staticmethod
    def read_timeout(timeout: float, body: dict[str, Any]) -> float:
        """How long the client waits for the answer to ``body``: ``timeout``, plus the
        manager's wait when it fetches outputs."""
        return timeout + MAX_BATCH_WAIT_S if "wait" in body else timeout

    def settle(self, data: Any) -> None:
        """Take the manager's ``BatchResult``: ids of created variables, values of set ones."""
        result = parse_as(BatchResult, data, "batch")
        missing = [ref for ref in self.refs.values() if ref not in result.refs]
        if missing:
            raise ParrotError(f"the manager's answer to a batch lacks ref(s) {missing}", code="bad_response")
        for var, ref in self.refs.items():
            var._id = result.refs[ref]
        for var, value in self.sets:
            var._resolve(value)
        by_ref = {ref: var for var, ref in self.refs.items()}
        for ref, info in result.values.items():
            var = by_ref.get(ref)
            if var is None:
                raise ParrotError(
                    f"the manager's answer to a batch has a value for unknown ref {ref!r}",
                    code="bad_response",
                )
            record_info(var, info)

    def fail(self, error: ParrotError) -> None:
        """The batch was not applied: its variables carry ``error`` for ever."""
        for var in self.refs:
            var._fail(error)

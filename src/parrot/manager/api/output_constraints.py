"""Checking the constraints (structured outputs) of submitted calls before they are taken.

A call's outputs may carry a JSON schema, regex or choice list in their sampling
(:mod:`parrot.protocol.constraint`).  Compiling one costs from a millisecond to, for a
hostile schema, far more, so :func:`check_outputs` compiles each off the event loop
within ``COMPILE_TIMEOUT_S`` before the synchronous submit runs; a constraint that is
malformed, too large, slow or does not compile is a 400 naming the output and field
(e.g. ``invalid output 'answer' regex: ...``), and nothing is created.
"""

from __future__ import annotations

from collections.abc import Iterable

from parrot.protocol.constraint import Constraint, check_compiles_async
from parrot.protocol.schemas import BatchRequest, PlaceholderBinding, SubmitCallOp

__all__ = ["check_batch", "check_outputs"]


async def check_outputs(bindings: Iterable[PlaceholderBinding]) -> None:
    """Raise InvalidConstraint (400) for the first output whose constraint is bad."""
    for b in bindings:
        spec = (b.sampling or {}).get("constraint")
        if spec is None:
            continue
        where = f"output {b.name!r} constraint"
        constraint = Constraint.from_dict(spec, where)
        await check_compiles_async(constraint, f"output {b.name!r} {constraint.field}")


async def check_batch(body: BatchRequest) -> None:
    """:func:`check_outputs` over every call a batch submits."""
    for op in body.ops:
        if isinstance(op, SubmitCallOp):
            await check_outputs(op.placeholders)

"""Structured outputs in the OpenAI API: ``response_format`` and vLLM's fields.

Accepted on ``/v1/completions`` and ``/v1/chat/completions``, at most one of:

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object) or ``{"type": "json_schema", "json_schema": {"name": ...,
  "schema": {...}, "strict": ...}}`` (``name`` and ``strict`` are accepted and ignored:
  the schema is always enforced);
* ``structured_outputs`` as vLLM (0.10.2 and later) takes it: an object with exactly
  one of ``json`` (a schema, as an object or its JSON text), ``regex``, ``choice`` (a
  list of strings) or ``json_object: true`` (any JSON object); vLLM's other keys
  (``grammar``, ``structural_tag``, whitespace options) are refused with a 400 naming
  them, never ignored;
* ``guided_json`` (a schema, as an object or its JSON text), ``guided_regex``,
  ``guided_choice`` (a list of strings), as older vLLM named them.

:func:`constraint_of` turns them into a :class:`~parrot.protocol.constraint.Constraint`
and checks, off the event loop and within ``COMPILE_TIMEOUT_S``, that it compiles; any
failure is a 400 whose message names the field (e.g. ``invalid guided_regex: ...``).
"""

from __future__ import annotations

from typing import Any

from parrot.protocol.constraint import Constraint, InvalidConstraint, check_compiles_async

__all__ = ["constraint_of"]

RF = "response_format"
SO = "structured_outputs"
GUIDED = {"json_schema": "guided_json", "regex": "guided_regex", "choice": "guided_choice"}
SO_KEYS = ("json", "regex", "choice", "json_object")


def _bad(where: str, message: str) -> InvalidConstraint:
    return InvalidConstraint(f"invalid {where}: {message}", detail={"field": where})


def _from_response_format(rf: Any) -> tuple[str, Constraint] | None:
    """The constraint ``response_format`` asks for, with the field that holds it."""
    if not isinstance(rf, dict):
        raise _bad(RF, "must be an object with a 'type'")
    kind = rf.get("type")
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise _bad(RF, f"unknown field(s) {sorted(extra)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return RF, Constraint.json_schema({"type": "object"}, RF)
    if kind == "json_schema":
        where = f"{RF}.json_schema"
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad(where, "must be an object holding the 'schema'")
        if "schema" not in spec:
            raise _bad(f"{where}.schema", "is required")
        return f"{where}.schema", Constraint.json_schema(spec["schema"], f"{where}.schema")
    raise _bad(f"{RF}.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r:.60}")


def _from_structured_outputs(so: dict[str, Any]) -> tuple[str, Constraint]:
    """The constraint vLLM's ``structured_outputs`` object asks for, with its field (the
    request's model has checked that it is an object)."""
    other = sorted(set(so) - set(SO_KEYS))
    if other:
        raise _bad(SO, f"{', '.join(other)} not supported (only {', '.join(SO_KEYS)})")
    given = [k for k in SO_KEYS if so.get(k) is not None]
    if len(given) != 1:
        raise _bad(SO, f"give exactly one of {', '.join(SO_KEYS)}, got {len(given)}")
    key = given[0]
    where = f"{SO}.{key}"
    if key == "json_object":
        if so[key] is not True:
            raise _bad(where, "must be true")
        return where, Constraint.json_schema({"type": "object"}, where)
    if key == "json":
        return where, Constraint.json_schema(so[key], where)
    if key == "regex":
        return where, Constraint.regex(so[key], where)
    return where, Constraint.choice(so[key], where)


async def constraint_of(req: Any) -> Constraint | None:
    """The request's constraint (None if it asks for none), checked to compile; 400
    (:class:`InvalidConstraint`) naming the field otherwise."""
    guided = Constraint.of(
        req.guided_json, req.guided_regex, req.guided_choice, ("guided_json", "guided_regex", "guided_choice")
    )
    found = None if guided is None else (GUIDED[guided.kind], guided)
    for field, parse in ((SO, _from_structured_outputs), (RF, _from_response_format)):
        value = getattr(req, field)
        if value is None:
            continue
        parsed = parse(value)
        if parsed is not None and found is not None:
            raise InvalidConstraint(f"give at most one of {field} and {found[0]}", detail={"field": found[0]})
        found = found or parsed
    if found is None:
        return None
    where, constraint = found
    await check_compiles_async(constraint, where)
    return constraint

"""Output constraints for structured outputs: a JSON schema, a regex or a choice list.

A :class:`Constraint` is what a generated output must match; the engine enforces it
while decoding (:mod:`parrot.engine.grammar`) by masking every token that would leave
the language.  It travels inside :class:`~parrot.protocol.sampling.SamplingParams`
as ``{"json_schema": {...}}``, ``{"regex": "..."}`` or ``{"choices": [...]}``.

Invariants: a Constraint that exists passed the cheap checks (kind, type, the size
limits below); ``spec`` is canonical (a schema as compact JSON, its key order kept:
an object's properties are generated in the order the schema lists them), so equal
constraints compare and hash equal and compiled grammars are cached by
``(kind, spec)``.  Compiling (:func:`check_compiles`) is separate because it costs
real time: the manager runs it off the event loop under :data:`COMPILE_TIMEOUT_S`.

Grammars are llguidance's (a Rust library, 3 MB wheel, no Python dependencies):
JSON schemas compile with compact separators (``", "`` and ``": "``) and no other
whitespace, so a model cannot stall in whitespace; unsupported schema keywords are
an error, never silently ignored.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Literal

from parrot.protocol.errors import InvalidConstraint

__all__ = ["Constraint", "InvalidConstraint", "check_compiles", "check_compiles_async"]

MAX_SCHEMA_CHARS = 32_768  # the schema as compact JSON
MAX_REGEX_CHARS = 2_048
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1_024  # each choice
COMPILE_TIMEOUT_S = 2.0  # the manager's budget for checking that a constraint compiles
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

Kind = Literal["json_schema", "regex", "choice"]
KINDS: tuple[str, ...] = ("json_schema", "regex", "choice")
_WIRE_NAMES = {"json_schema": "json_schema", "regex": "regex", "choice": "choices"}


def _bad(where: str, message: str) -> InvalidConstraint:
    return InvalidConstraint(f"invalid {where}: {message}", detail={"field": where})


@dataclass(frozen=True)
class Constraint:
    """``kind`` and its canonical ``spec``: compact JSON of the schema (key order kept), the regex,
    or the JSON list of choices.  Build with :meth:`json_schema`, :meth:`regex`,
    :meth:`choice` or :meth:`of`, which check types and sizes."""

    kind: Kind
    spec: str

    @classmethod
    def json_schema(cls, schema: Any, where: str = "json_schema") -> Constraint:
        """``schema``: a JSON object (dict) or its JSON text; ``where`` names the field in errors."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise _bad(where, f"not valid JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise _bad(where, f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            spec = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise _bad(where, f"not JSON-serialisable ({exc})") from None
        if len(spec) > MAX_SCHEMA_CHARS:
            raise _bad(where, f"the schema has {len(spec)} JSON characters; the limit is {MAX_SCHEMA_CHARS}")
        return cls("json_schema", spec)

    @classmethod
    def regex(cls, pattern: Any, where: str = "regex") -> Constraint:
        """``pattern``: a regex the whole output must match (Rust ``regex`` syntax, anchored)."""
        if not isinstance(pattern, str) or not pattern:
            raise _bad(where, "a regex must be a non-empty string")
        if len(pattern) > MAX_REGEX_CHARS:
            raise _bad(where, f"the regex has {len(pattern)} characters; the limit is {MAX_REGEX_CHARS}")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Any, where: str = "choices") -> Constraint:
        """``choices``: the output is exactly one of these strings."""
        if not isinstance(choices, (list, tuple)) or not choices:
            raise _bad(where, "choices must be a non-empty list of strings")
        if len(choices) > MAX_CHOICES:
            raise _bad(where, f"{len(choices)} choices; the limit is {MAX_CHOICES}")
        for c in choices:
            if not isinstance(c, str) or not c:
                raise _bad(where, f"each choice must be a non-empty string, got {c!r:.60}")
            if len(c) > MAX_CHOICE_CHARS:
                raise _bad(where, f"a choice has {len(c)} characters; the limit is {MAX_CHOICE_CHARS}")
        return cls("choice", json.dumps(list(dict.fromkeys(choices)), ensure_ascii=False))

    @classmethod
    def of(
        cls,
        json_schema: Any = None,
        regex: Any = None,
        choices: Any = None,
        names: tuple[str, str, str] = ("json_schema", "regex", "choices"),
    ) -> Constraint | None:
        """The constraint given by at most one of the three (None if none); ``names`` are the
        fields' names as the caller's user wrote them, for errors."""
        given = [(n, v) for n, v in zip(names, (json_schema, regex, choices), strict=True) if v is not None]
        if len(given) > 1:
            raise InvalidConstraint(
                f"at most one of {', '.join(names)} may be given, got {', '.join(n for n, _ in given)}",
                detail={"field": given[1][0]},
            )
        if not given:
            return None
        if json_schema is not None:
            return cls.json_schema(json_schema, names[0])
        if regex is not None:
            return cls.regex(regex, names[1])
        return cls.choice(choices, names[2])

    @property
    def value(self) -> Any:
        """The schema (a dict), the regex or the list of choices."""
        return self.spec if self.kind == "regex" else json.loads(self.spec)

    @property
    def field(self) -> str:
        """The wire name of this constraint's field: ``json_schema``, ``regex`` or ``choices``."""
        return _WIRE_NAMES[self.kind]

    def to_dict(self) -> dict[str, Any]:
        return {self.field: self.value}

    @classmethod
    def from_dict(cls, data: Any, where: str = "constraint") -> Constraint:
        if isinstance(data, Constraint):
            return data
        if not isinstance(data, dict) or len(data) != 1 or next(iter(data)) not in _WIRE_NAMES.values():
            raise _bad(where, "must be an object with exactly one of 'json_schema', 'regex', 'choices'")
        found = cls.of(data.get("json_schema"), data.get("regex"), data.get("choices"))
        if found is None:
            raise _bad(where, "its value is null")
        return found

    def grammar(self) -> str:
        """This constraint as an llguidance grammar (cached)."""
        return _grammar(self.kind, self.spec)


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, spec: str) -> str:
    from llguidance import LLMatcher

    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    alternatives = " | ".join(json.dumps(c) for c in json.loads(spec))
    return LLMatcher.grammar_from_lark(f"start: {alternatives}")


@functools.lru_cache(maxsize=256)
def _compile_error(kind: str, spec: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(_grammar(kind, spec))


def check_compiles(constraint: Constraint, where: str | None = None) -> None:
    """Raise :class:`InvalidConstraint` (naming ``where``, by default the constraint's
    field) if the constraint does not compile.  Blocking (about a millisecond for a small
    schema, bounded by llguidance's lexer fuel): call it off the event loop."""
    error = _compile_error(constraint.kind, constraint.spec)
    if error:
        raise _bad(where or constraint.field, error.strip()[:500])


async def check_compiles_async(constraint: Constraint, where: str | None = None) -> None:
    """:func:`check_compiles` on a worker thread, failing with :class:`InvalidConstraint`
    if it takes over :data:`COMPILE_TIMEOUT_S` (the thread is left to finish; llguidance's
    fuel limits bound it)."""
    import asyncio

    try:
        await asyncio.wait_for(asyncio.to_thread(check_compiles, constraint, where), COMPILE_TIMEOUT_S)
    except TimeoutError:
        raise _bad(
            where or constraint.field, f"it did not compile within {COMPILE_TIMEOUT_S:g} s; simplify it"
        ) from None

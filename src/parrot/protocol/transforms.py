"""Output transforms: deterministic post-processing of a generated value.

A transform runs on the manager after an output has been generated and before
its value flows to consumers.  On the wire a transform is JSON: a list of
steps applied in order.  A single step object, or one of the string
shorthands ``"strip"``, ``"first_line"``, ``"first_item"``, is accepted too.

Steps::

    {"kind": "strip"}
    {"kind": "regex", "pattern": str, "group": int | str}   # group defaults to 1 if the
                                                             # pattern has groups, else 0
    {"kind": "json", "path": "a.b[0].c"}                    # path "" (the default) is the document
    {"kind": "first_line"}
    {"kind": "first_item"}

Invariants: :func:`parse_transforms` is the only way to build a chain from
untrusted input and rejects anything malformed with :class:`InvalidTransform`
(so a chain that exists is valid); :meth:`TransformChain.to_spec` returns the
canonical list form, and ``parse_transforms(chain.to_spec())`` equals
``chain``; :meth:`TransformChain.apply` either returns a string or raises
:class:`TransformFailed`, never anything else, and refuses inputs over
:data:`MAX_INPUT_BYTES` so that no regex runs over unbounded text.  Patterns
run on the ``regex`` package (``re``'s syntax, VERSION0) with a time budget of
:data:`MAX_REGEX_SECONDS` per match and the GIL released while matching, so a
pattern that backtracks catastrophically fails its call instead of stalling
the manager (which applies chains on a worker thread).

The helpers :func:`strip`, :func:`regex`, :func:`json_path`,
:func:`first_line` and :func:`first_item` build one-step chains for the Python
API (``P.transforms.strip()``); chains compose with ``+``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import regex as regex_engine  # the package; ``regex`` below is this module's helper

from parrot.protocol import errors
from parrot.protocol.errors import CallFailed, InvalidTransform

MAX_PATTERN_CHARS = 1000
MAX_PATH_CHARS = 1000
MAX_STEPS = 32
MAX_INPUT_BYTES = 1 << 20  # 1 MiB of UTF-8
MAX_JSON_CANDIDATES = 64  # opening brackets tried when looking for embedded JSON
MAX_REGEX_SECONDS = 0.5  # one pattern's search of one value

SHORTHANDS = ("strip", "first_line", "first_item")


class TransformFailed(CallFailed):
    """A transform could not be applied to a generated value (no regex match,
    no parsable JSON, a missing JSON path, input too large).  The output, and
    everything downstream of it, fails with this error."""

    default_code = "transform_failed"


errors._register(TransformFailed)  # so errors.error_from_body rebuilds it from "transform_failed"


# -------------------------------------------------------------------- steps
@dataclass(frozen=True)
class Strip:
    """Remove leading and trailing whitespace."""

    kind: ClassVar[str] = "strip"

    def apply(self, text: str) -> str:
        return text.strip()

    def to_spec(self) -> dict[str, Any]:
        return {"kind": self.kind}


@dataclass(frozen=True)
class FirstLine:
    """The first line that is not blank, stripped; ``""`` if there is none."""

    kind: ClassVar[str] = "first_line"

    def apply(self, text: str) -> str:
        return _first_nonblank_line(text)

    def to_spec(self) -> dict[str, Any]:
        return {"kind": self.kind}


_LIST_ITEM = re.compile(r"^[ \t]*(?:[-*•]|\d{1,9}[.)])[ \t]+(\S.*)$", re.MULTILINE)


@dataclass(frozen=True)
class FirstItem:
    """The first item of a ``-``/``*``/``•`` bulleted or ``1.``/``1)`` numbered
    list, marker removed and stripped (only the item's first line).  Without a
    list, the first non-blank line."""

    kind: ClassVar[str] = "first_item"

    def apply(self, text: str) -> str:
        match = _LIST_ITEM.search(text)
        if match is None:
            return _first_nonblank_line(text)
        return match.group(1).strip()

    def to_spec(self) -> dict[str, Any]:
        return {"kind": self.kind}


@dataclass(frozen=True)
class Regex:
    """The given group of the first match of ``pattern`` (``re``'s syntax, no flags), found
    within :data:`MAX_REGEX_SECONDS`."""

    pattern: str
    group: int | str

    kind: ClassVar[str] = "regex"

    def __post_init__(self) -> None:
        compiled = _compile(self.pattern)
        _check_group(compiled, self.group)
        object.__setattr__(self, "_compiled", compiled)

    def apply(self, text: str) -> str:
        try:
            match = self._compiled.search(text, concurrent=True, timeout=MAX_REGEX_SECONDS)  # type: ignore[attr-defined]
        except TimeoutError:
            raise TransformFailed(
                f"transform regex: pattern {_short(self.pattern)} ran past its {MAX_REGEX_SECONDS:g} s "
                f"budget on a value of {len(text)} characters (it backtracks too much)",
                detail={"pattern": self.pattern, "seconds": MAX_REGEX_SECONDS},
            ) from None
        if match is None:
            raise TransformFailed(
                f"transform regex: pattern {_short(self.pattern)} does not match the value",
                detail={"pattern": self.pattern},
            )
        value = match.group(self.group)
        if value is None:
            raise TransformFailed(
                f"transform regex: group {self.group!r} of pattern {_short(self.pattern)} "
                "did not take part in the match",
                detail={"pattern": self.pattern, "group": self.group},
            )
        return value

    def to_spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "pattern": self.pattern, "group": self.group}


@dataclass(frozen=True)
class JsonPath:
    """Parse the first JSON object or array in the value and follow ``path``.

    The whole value is tried first (so a bare JSON scalar works too), then a
    fenced code block, then each ``{``/``[`` in order (at most
    :data:`MAX_JSON_CANDIDATES`).  A string result is returned as is; anything
    else is re-serialised with ``json.dumps`` (``ensure_ascii=False``).
    """

    path: str = ""

    kind: ClassVar[str] = "json"

    def __post_init__(self) -> None:
        object.__setattr__(self, "_steps", _parse_path(self.path))

    def apply(self, text: str) -> str:
        node = _find_json(text)
        for step in self._steps:  # type: ignore[attr-defined]
            if isinstance(step, int):
                ok = isinstance(node, list) and -len(node) <= step < len(node)
            else:
                ok = isinstance(node, dict) and step in node
            if not ok:
                raise TransformFailed(
                    f"transform json: path {self.path!r} not found in the value (at {step!r})",
                    detail={"path": self.path},
                )
            node = node[step]
        if isinstance(node, str):
            return node
        return json.dumps(node, ensure_ascii=False)

    def to_spec(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path}


Step = Strip | FirstLine | FirstItem | Regex | JsonPath


# -------------------------------------------------------------------- chain
@dataclass(frozen=True)
class TransformChain:
    """A non-empty sequence of steps, applied left to right."""

    steps: tuple[Step, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        if not self.steps:
            raise InvalidTransform("invalid transform: a chain needs at least one step")
        if len(self.steps) > MAX_STEPS:
            raise InvalidTransform(f"invalid transform: at most {MAX_STEPS} steps, got {len(self.steps)}")

    def apply(self, text: str) -> str:
        """Run every step on ``text``; raises :class:`TransformFailed` on any failure."""
        if not isinstance(text, str):
            raise TransformFailed(f"transform input must be a string, got {type(text).__name__}")
        for step in self.steps:
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > MAX_INPUT_BYTES:
                raise TransformFailed(
                    f"transform {step.kind}: input of {size} bytes exceeds the {MAX_INPUT_BYTES}-byte limit",
                    detail={"bytes": size, "limit": MAX_INPUT_BYTES},
                )
            text = step.apply(text)
        return text

    def to_spec(self) -> list[dict[str, Any]]:
        """The canonical JSON form: a list of step objects with every field explicit."""
        return [step.to_spec() for step in self.steps]

    def __add__(self, other: TransformChain) -> TransformChain:
        if not isinstance(other, TransformChain):
            return NotImplemented
        return TransformChain(self.steps + other.steps)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)


def parse_transforms(spec: Any) -> TransformChain | None:
    """Validate a transform spec; ``None`` for ``None`` or an empty list.

    Accepts a list of steps, one step, a shorthand string, or an existing
    :class:`TransformChain` (returned unchanged).  Raises
    :class:`InvalidTransform` naming the problem.
    """
    if spec is None:
        return None
    if isinstance(spec, TransformChain):
        return spec
    if isinstance(spec, (str, dict, *_STEP_TYPES)):
        items: list[Any] = [spec]
    elif isinstance(spec, (list, tuple)):
        items = list(spec)
    else:
        raise InvalidTransform(
            f"invalid transform: expected a list of steps, a step object or a shorthand string, "
            f"got {type(spec).__name__}"
        )
    if not items:
        return None
    if len(items) > MAX_STEPS:
        raise InvalidTransform(f"invalid transform: at most {MAX_STEPS} steps, got {len(items)}")
    steps: list[Step] = []
    for i, item in enumerate(items):
        if isinstance(item, TransformChain):
            steps.extend(item.steps)
        else:
            steps.append(_parse_step(item, i))
    return TransformChain(tuple(steps))


def _parse_step(item: Any, index: int) -> Step:
    where = f"step {index}"
    if isinstance(item, _STEP_TYPES):
        return item
    if isinstance(item, str):
        if item not in SHORTHANDS:
            raise InvalidTransform(
                f"invalid transform: {where}: unknown shorthand {item!r} (expected one of {list(SHORTHANDS)})"
            )
        item = {"kind": item}
    if not isinstance(item, dict):
        raise InvalidTransform(f"invalid transform: {where}: expected an object, got {type(item).__name__}")
    kind = item.get("kind")
    if kind is None:
        raise InvalidTransform(f"invalid transform: {where}: missing field 'kind'")
    if not isinstance(kind, str) or kind not in _FIELDS:
        raise InvalidTransform(
            f"invalid transform: {where}: unknown kind {kind!r} (expected one of {sorted(_FIELDS)})"
        )
    required, optional = _FIELDS[kind]
    unknown = set(item) - {"kind", *required, *optional}
    if unknown:
        raise InvalidTransform(f"invalid transform: {where} ({kind}): unknown field(s) {sorted(unknown)}")
    missing = [f for f in required if f not in item]
    if missing:
        raise InvalidTransform(f"invalid transform: {where} ({kind}): missing field(s) {missing}")
    try:
        if kind == "strip":
            return Strip()
        if kind == "first_line":
            return FirstLine()
        if kind == "first_item":
            return FirstItem()
        if kind == "regex":
            pattern = item["pattern"]
            if not isinstance(pattern, str):
                raise InvalidTransform(f"'pattern' must be a string, got {type(pattern).__name__}")
            group = item.get("group")
            if group is None:
                group = 1 if _compile(pattern).groups else 0
            return Regex(pattern, group)
        path = item.get("path", "")
        if not isinstance(path, str):
            raise InvalidTransform(f"'path' must be a string, got {type(path).__name__}")
        return JsonPath(path)
    except InvalidTransform as exc:
        raise InvalidTransform(f"invalid transform: {where} ({kind}): {exc.message}") from None


_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "strip": ((), ()),
    "first_line": ((), ()),
    "first_item": ((), ()),
    "regex": (("pattern",), ("group",)),
    "json": ((), ("path",)),
}
_STEP_TYPES = (Strip, FirstLine, FirstItem, Regex, JsonPath)


# ------------------------------------------------------------------ helpers
def strip() -> TransformChain:
    """Remove surrounding whitespace."""
    return TransformChain((Strip(),))


def regex(pattern: str, group: int | str | None = None) -> TransformChain:
    """The ``group`` of the first match of ``pattern`` (default: 1 if it has groups, else 0)."""
    return TransformChain((_parse_step({"kind": "regex", "pattern": pattern, "group": group}, 0),))


def json_path(path: str = "") -> TransformChain:
    """The value at ``path`` (``"a.b[0].c"``) in the first JSON object/array of the text."""
    return TransformChain((_parse_step({"kind": "json", "path": path}, 0),))


def first_line() -> TransformChain:
    """The first non-blank line, stripped."""
    return TransformChain((FirstLine(),))


def first_item() -> TransformChain:
    """The first item of a bulleted or numbered list (else the first non-blank line)."""
    return TransformChain((FirstItem(),))


# ---------------------------------------------------------------- internals
def _short(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 60 else pattern[:57] + "...")


def _compile(pattern: str) -> regex_engine.Pattern[str]:
    if not isinstance(pattern, str):
        raise InvalidTransform(f"'pattern' must be a string, got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise InvalidTransform(f"pattern longer than {MAX_PATTERN_CHARS} characters ({len(pattern)})")
    try:
        return regex_engine.compile(pattern, regex_engine.VERSION0)
    except (regex_engine.error, RecursionError, OverflowError, ValueError) as exc:
        raise InvalidTransform(f"pattern {_short(pattern)} does not compile: {exc}") from None


def _check_group(compiled: regex_engine.Pattern[str], group: Any) -> None:
    if isinstance(group, bool) or not isinstance(group, (int, str)):
        raise InvalidTransform(f"'group' must be an integer or a group name, got {group!r}")
    if isinstance(group, int):
        if not 0 <= group <= compiled.groups:
            raise InvalidTransform(f"group {group} out of range: the pattern has {compiled.groups} group(s)")
    elif group not in compiled.groupindex:
        names = sorted(compiled.groupindex)
        raise InvalidTransform(f"unknown group name {group!r} (the pattern names {names})")


_PATH_TOKEN = re.compile(r"\.?([^.\[\]]+)|\[(-?\d{1,9})\]")


def _parse_path(path: str) -> tuple[str | int, ...]:
    """``"a.b[0].c"`` -> ``("a", "b", 0, "c")``; ``""`` -> ``()``.

    Keys are runs of characters other than ``.``, ``[`` and ``]``; a key after
    the first needs a leading dot; indices are (possibly negative) integers.
    """
    if not isinstance(path, str):
        raise InvalidTransform(f"'path' must be a string, got {type(path).__name__}")
    if len(path) > MAX_PATH_CHARS:
        raise InvalidTransform(f"path longer than {MAX_PATH_CHARS} characters")
    steps: list[str | int] = []
    pos = 0
    while pos < len(path):
        match = _PATH_TOKEN.match(path, pos)
        dotted = path.startswith(".", pos)
        if match is None or (dotted and pos == 0) or (match.group(1) is not None and pos > 0 and not dotted):
            raise InvalidTransform(f"malformed path {path!r} at offset {pos}")
        steps.append(match.group(1) if match.group(1) is not None else int(match.group(2)))
        pos = match.end()
    return tuple(steps)


_FENCE = re.compile(r"```[A-Za-z0-9_+-]*[ \t]*\n(.*?)```", re.DOTALL)
_DECODER = json.JSONDecoder()


def _find_json(text: str) -> Any:
    """The first JSON document found in ``text`` (see :class:`JsonPath`)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    fence = _FENCE.search(text)
    if fence is not None:
        try:
            return json.loads(fence.group(1))
        except (ValueError, RecursionError):
            pass
    tried = 0
    pos = 0
    while tried < MAX_JSON_CANDIDATES:
        starts = [i for i in (text.find("{", pos), text.find("[", pos)) if i != -1]
        if not starts:
            break
        start = min(starts)
        tried += 1
        try:
            value, _end = _DECODER.raw_decode(text, start)
            return value
        except (ValueError, RecursionError):
            pos = start + 1
    raise TransformFailed("transform json: no valid JSON object or array found in the value")


def _first_nonblank_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""

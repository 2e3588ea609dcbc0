"""Prompt templates with semantic-variable placeholders.

Syntax: constant text with placeholders in double braces.  A placeholder is
``{{input:name}}``, ``{{output:name}}`` or the bare ``{{name}}`` whose
direction comes from elsewhere (a decorated function's annotations, or the
binding sent with a call).  Single braces are ordinary text, so JSON examples
in a prompt need no escaping.

Invariants of a parsed :class:`Template`: pieces alternate freely between
non-empty text and placeholders; every ``{{`` is closed by ``}}`` before the
next ``{{``; names are Python identifiers; an output name occurs exactly once
and is never also an input.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from parrot.protocol.errors import InvalidTemplate

Direction = Literal["input", "output"]
DIRECTIONS: tuple[Direction, ...] = ("input", "output")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
MAX_TEMPLATE_CHARS = 1_000_000
MAX_PLACEHOLDERS = 4096
"""Placeholders in one template (occurrences, not names): parsing and binding take about
15 microseconds each, so this bounds what one request costs the manager's event loop."""


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Placeholder:
    name: str
    direction: Direction | None  # None: bare {{name}}, resolved by the caller


Piece = Text | Placeholder


@dataclass(frozen=True)
class Template:
    source: str
    pieces: tuple[Piece, ...]

    @cached_property
    def placeholders(self) -> tuple[Placeholder, ...]:
        return tuple(p for p in self.pieces if isinstance(p, Placeholder))

    @property
    def names(self) -> list[str]:
        """Placeholder names in order of first appearance."""
        return list(self._directions)

    @cached_property
    def _directions(self) -> dict[str, Direction | None]:
        """Each name (in order of first appearance) with its first explicit direction
        (None if every occurrence is bare): one pass, so that looking up every name of a
        template with many placeholders stays linear."""
        out: dict[str, Direction | None] = {}
        for p in self.placeholders:
            if out.get(p.name) is None:
                out[p.name] = p.direction
        return out

    def direction_of(self, name: str) -> Direction | None:
        return self._directions.get(name)

    def with_directions(self, directions: dict[str, Direction]) -> Template:
        """Resolve bare placeholders; explicit ones must agree with ``directions``."""
        pieces: list[Piece] = []
        for p in self.pieces:
            if isinstance(p, Placeholder):
                want = directions.get(p.name)
                if want is None:
                    want = p.direction
                if want is None:
                    raise InvalidTemplate(f"placeholder {{{{{p.name}}}}} is neither input nor output")
                if p.direction is not None and p.direction != want:
                    raise InvalidTemplate(
                        f"placeholder {p.name!r} is marked {p.direction} in the template but bound as {want}"
                    )
                p = Placeholder(p.name, want)
            pieces.append(p)
        resolved = Template(self.source, tuple(pieces))
        _check_outputs(resolved)
        return resolved

    def to_inline(self) -> str:
        """The template in the fully explicit inline form (``{{input:x}}``)."""
        out = []
        for p in self.pieces:
            if isinstance(p, Text):
                out.append(p.text)
            elif p.direction is None:
                out.append("{{" + p.name + "}}")
            else:
                out.append("{{" + p.direction + ":" + p.name + "}}")
        return "".join(out)


def parse_template(source: str) -> Template:
    """Parse ``source``; raises :class:`InvalidTemplate` naming the problem and its offset."""
    if not isinstance(source, str):
        raise InvalidTemplate("template must be a string")
    if len(source) > MAX_TEMPLATE_CHARS:
        raise InvalidTemplate(f"template longer than {MAX_TEMPLATE_CHARS} characters")
    if source.count("{{") > MAX_PLACEHOLDERS:  # every '{{' opens a placeholder
        raise InvalidTemplate(f"template has more than {MAX_PLACEHOLDERS} placeholders")
    pieces: list[Piece] = []
    pos = 0
    while True:
        start = source.find("{{", pos)
        stray = source.find("}}", pos)
        if stray != -1 and (start == -1 or stray < start):
            raise InvalidTemplate(f"unbalanced braces: '}}}}' at offset {stray} closes nothing")
        if start == -1:
            if pos < len(source):
                pieces.append(Text(source[pos:]))
            break
        if start > pos:
            pieces.append(Text(source[pos:start]))
        end = source.find("}}", start + 2)
        reopen = source.find("{{", start + 2)
        if end == -1 or (reopen != -1 and reopen < end):
            raise InvalidTemplate(f"unbalanced braces: '{{{{' at offset {start} is never closed")
        pieces.append(_parse_placeholder(source[start + 2 : end].strip(), start))
        pos = end + 2
    template = Template(source, tuple(pieces))
    _check_outputs(template)
    return template


def _parse_placeholder(body: str, offset: int) -> Placeholder:
    direction: Direction | None = None
    name = body
    if ":" in body:
        prefix, name = (s.strip() for s in body.split(":", 1))
        if prefix not in DIRECTIONS:
            raise InvalidTemplate(
                f"placeholder at offset {offset}: direction must be 'input' or 'output', got {prefix!r}"
            )
        direction = prefix  # type: ignore[assignment]
    if not name:
        raise InvalidTemplate(f"placeholder at offset {offset} has an empty name")
    if not _NAME.match(name):
        raise InvalidTemplate(f"placeholder at offset {offset}: {name!r} is not a valid name")
    return Placeholder(name, direction)


def _check_outputs(template: Template) -> None:
    seen_out: set[str] = set()
    inputs: set[str] = set()
    for p in template.placeholders:
        if p.direction == "output":
            if p.name in seen_out:
                raise InvalidTemplate(f"output placeholder {p.name!r} appears more than once")
            seen_out.add(p.name)
        elif p.direction == "input":
            inputs.add(p.name)
    both = seen_out & inputs
    if both:
        raise InvalidTemplate(f"placeholder(s) {sorted(both)} used as both input and output")


def prompt_pieces(template: Template, chat: bool) -> list[Piece]:
    """The template's pieces as the model will read them, before any chat
    markup: with ``chat=True``, whitespace at the edges of the user's turn
    (a docstring's newline before the output) is dropped — it only confuses
    the model — and the output is the last piece.

    The manager renders calls from these pieces, and :func:`prompt_text` turns
    them into the text a request-level client sends; both read them here so
    the two cannot drift apart.  With ``chat=True`` the template must end with
    its only output (trailing whitespace allowed), as the manager requires.
    """
    pieces = list(template.pieces)
    if not chat:
        return pieces
    while pieces and isinstance(pieces[-1], Text) and not pieces[-1].text.strip():
        pieces.pop()
    outputs = [p for p in pieces if isinstance(p, Placeholder) and p.direction == "output"]
    if len(outputs) != 1 or pieces[-1] is not outputs[0]:
        raise InvalidTemplate(
            "with chat=True the template must have exactly one output placeholder, as its last element"
        )
    body = pieces[:-1]
    if body and isinstance(body[-1], Text):
        body[-1] = Text(body[-1].text.rstrip())
    if body and isinstance(body[0], Text):
        body[0] = Text(body[0].text.lstrip())
    return [*(p for p in body if not isinstance(p, Text) or p.text), pieces[-1]]


def prompt_text(
    template: Template,
    values: Mapping[str, str],
    *,
    chat: bool = False,
    chat_wrap: tuple[str, str] | None = None,
) -> str:
    """The text the model reads before the template's first output, with the
    inputs set to ``values``: what a request-level client sends as the whole
    prompt of ``POST /v1/completions`` to get what the call generates.

    With ``chat=True``, ``chat_wrap`` is the model's ``(before, between)``
    markup (:meth:`parrot.protocol.tokenizer.ChatFormat.wrap`), placed around
    the user's text as the manager places it.  A BOS token is not text: the
    server adds it to every prompt, a completion's included.
    """
    if chat and chat_wrap is None:
        raise InvalidTemplate("chat=True needs the model's chat markup (chat_wrap) to render the prompt")
    out: list[str] = []
    for piece in prompt_pieces(template, chat):
        if isinstance(piece, Text):
            out.append(piece.text)
        elif piece.direction == "output":
            break
        else:
            if piece.name not in values:
                raise InvalidTemplate(f"no value for input {piece.name!r}")
            out.append(values[piece.name])
    if not chat:
        return "".join(out)
    before, between = chat_wrap  # type: ignore[misc]
    return before + "".join(out) + between

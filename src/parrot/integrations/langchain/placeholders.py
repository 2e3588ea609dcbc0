"""Semantic variables disguised as text, so LangChain code can format them.

While a pipeline is translated into a Parrot DAG, a model's output is not known yet:
it is the semantic variable of a call recorded on the server.  The translator hands
LangChain a *marker* string in its place (``"\\ue000<n>\\ue001"``, two Unicode
private-use characters around the variable's index), so prompt templates, string
joins and f-strings run unchanged and the text they produce carries the markers
where the variables go.  :meth:`Markers.split` cuts such text back into constant
text and variables; :meth:`Markers.resolve` swaps fetched values in.

Invariants: a marker names exactly one variable of this translation; text a user
passes in may not contain the private-use delimiters (:meth:`check_input` refuses
it), so every delimiter in traced text comes from a marker, and a delimiter that is
not part of a whole marker means some code cut or changed one (an error naming it).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from langchain_core.messages import BaseMessage
from langchain_core.prompt_values import ChatPromptValue, StringPromptValue

from parrot.frontend.variable import SemanticVariable

OPEN, CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(f"{OPEN}(\\d+){CLOSE}")


class MarkerDamaged(ValueError):
    """Traced text holds a delimiter that is not part of a whole marker."""


class Markers:
    """The variables of one translation and their markers."""

    def __init__(self) -> None:
        self.variables: list[SemanticVariable] = []

    def mark(self, var: SemanticVariable) -> str:
        self.variables.append(var)
        return f"{OPEN}{len(self.variables) - 1}{CLOSE}"

    def split(self, text: str) -> list[str | SemanticVariable]:
        """``text`` as constant pieces and variables, in order (no empty pieces)."""
        out: list[str | SemanticVariable] = []
        pos = 0
        for m in _MARKER.finditer(text):
            if m.start() > pos:
                out.append(text[pos : m.start()])
            index = int(m.group(1))
            if index >= len(self.variables):
                raise MarkerDamaged(f"unknown Parrot output marker {index}")
            out.append(self.variables[index])
            pos = m.end()
        if pos < len(text):
            out.append(text[pos:])
        for piece in out:
            if isinstance(piece, str) and (OPEN in piece or CLOSE in piece):
                raise MarkerDamaged("the text of a Parrot output was cut or changed before it was used")
        return out

    def check(self, value: Any) -> None:
        """Raise :class:`MarkerDamaged` if any text inside ``value`` holds a damaged marker."""
        map_text(value, lambda text: (self.split(text), text)[1])

    def resolve(self, value: Any, fetch: Callable[[SemanticVariable], str]) -> Any:
        """``value`` with every marker replaced by its variable's fetched text."""

        def swap(text: str) -> str:
            return "".join(p if isinstance(p, str) else fetch(p) for p in self.split(text))

        return map_text(value, swap)


def map_text(value: Any, fn: Callable[[str], str]) -> Any:
    """``value`` with ``fn`` applied to every string in it (through dicts, lists, tuples,
    prompt values and messages); other leaves are returned as they are."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_text(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(map_text(v, fn) for v in value)
    if isinstance(value, StringPromptValue):
        return StringPromptValue(text=fn(value.text))
    if isinstance(value, ChatPromptValue):
        return ChatPromptValue(messages=[map_text(m, fn) for m in value.messages])
    if isinstance(value, BaseMessage):
        return value.model_copy(update={"content": map_text(value.content, fn)})
    return value


def check_input(value: Any) -> None:
    """Refuse input text that holds the private-use delimiters markers are made of."""

    def look(text: str) -> str:
        if OPEN in text or CLOSE in text:
            raise ValueError("input text may not contain the characters U+E000 or U+E001 (Parrot markers)")
        return text

    map_text(value, look)

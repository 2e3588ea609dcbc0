"""A variable's stream as the client reads it: events, and the text ``stream()`` yields."""

from __future__ import annotations

from typing import NamedTuple

from parrot.frontend.variable import SemanticVariable
from parrot.protocol.errors import ParrotError

__all__ = ["StreamEvent", "StreamedText"]


class StreamEvent(NamedTuple):
    """One line of a variable's stream: a text delta, a restart, or the end (with the value)."""

    text: str = ""
    restart: bool = False
    done: bool = False
    value: str | None = None


class StreamedText:
    """What ``stream()`` has yielded of a variable, kept a prefix of the text the producer
    is generating.

    When the producing call is re-run on another engine the server sends
    ``{"restart": true}`` and streams the new run's text from its start.  What the
    new run repeats of the text already yielded is not yielded again; the rest
    is.  So the pieces ``stream()`` yields always join to the text of the run that
    made the value (the value itself, unless the output has a transform), or, if
    the new run wrote something else where the old one had been yielded, the
    stream raises (``stream_restarted``) instead of yielding text the value will
    not have (``get()`` then reads the value)."""

    def __init__(self, var: SemanticVariable) -> None:
        self.var = var
        self.yielded = ""  # joined pieces given to the caller
        self.current: list[str] = []  # deltas of the run being streamed, since its start
        self.restarted = False

    def take(self, event: StreamEvent) -> str:
        """The text to yield for ``event`` (possibly empty)."""
        if event.restart:
            self.current, self.restarted = [], True
            return ""
        if event.done:  # after a restart the new run may not have reached what was yielded yet
            return self._advance("".join(self.current)) if self.restarted else ""
        if not event.text:
            return ""
        self.current.append(event.text)
        if not self.restarted:  # one run: every delta extends what was yielded
            self.yielded += event.text
            return event.text
        return self._advance("".join(self.current))

    def _advance(self, text: str) -> str:
        known = self.yielded
        if len(text) <= len(known):
            if not known.startswith(text):
                raise self._diverged()
            return ""
        if not text.startswith(known):
            raise self._diverged()
        self.yielded = text
        return text[len(known) :]

    def _diverged(self) -> ParrotError:
        label = self.var.name or self.var.id
        return ParrotError(
            f"stream of variable {label}: its call was re-run on another engine and wrote other text "
            f"than the {len(self.yielded)} characters already streamed; get() returns its value",
            code="stream_restarted",
        )

"""``stream()`` after the server restarts a variable's stream (its producer re-run on another
engine): the pieces yielded join to the text of the run that made the value, never more."""

from __future__ import annotations

import pytest

from parrot.frontend.streaming import StreamedText, StreamEvent
from parrot.frontend.variable import SemanticVariable
from parrot.protocol.errors import ParrotError


def variable() -> SemanticVariable:
    return SemanticVariable(None, name="answer", var_id="v1")  # type: ignore[arg-type]  # no session needed


def run(events: list[StreamEvent]) -> str:
    streamed = StreamedText(variable())
    return "".join(streamed.take(e) for e in events)


def text(*deltas: str) -> list[StreamEvent]:
    return [StreamEvent(text=d) for d in deltas]


RESTART = [StreamEvent(restart=True)]


def test_a_stream_without_restart_yields_every_delta() -> None:
    assert run([*text("Hel", "lo", " world"), StreamEvent(done=True, value="HELLO")]) == "Hello world"


def test_a_rerun_that_repeats_the_text_yields_only_what_is_new() -> None:
    events = (
        text("The cat ", "sat") + RESTART + text("The ", "cat sat on", " the mat") + [StreamEvent(done=True)]
    )
    assert run(events) == "The cat sat on the mat"


def test_a_rerun_that_ends_on_other_text_raises() -> None:
    with pytest.raises(ParrotError) as info:
        run(text("The cat sat") + RESTART + text("The dog") + [StreamEvent(done=True)])
    assert info.value.code == "stream_restarted" and "11 characters already streamed" in info.value.message
    assert (
        run(text("The cat sat") + RESTART + text("The cat sat") + [StreamEvent(done=True)]) == "The cat sat"
    )


def test_a_rerun_that_writes_other_text_raises_instead_of_yielding_it() -> None:
    streamed = StreamedText(variable())
    assert streamed.take(StreamEvent(text="abc")) == "abc"
    streamed.take(StreamEvent(restart=True))
    assert streamed.take(StreamEvent(text="ab")) == ""  # still a prefix of what was yielded
    with pytest.raises(ParrotError, match="wrote other text"):
        streamed.take(StreamEvent(text="x"))

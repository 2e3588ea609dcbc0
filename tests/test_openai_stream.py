"""Reading a backend's SSE completion stream (:mod:`parrot.manager.backends.openai_stream`):
valid chunks parse to pieces; anything else raises MalformedAnswer saying what."""

from __future__ import annotations

import pytest

from parrot.manager.backends.openai_stream import MalformedAnswer, StreamPiece, parse_sse_line

VOCAB = 100


def test_valid_lines_parse_to_pieces():
    assert parse_sse_line('data: {"choices":[{"text":"hi","finish_reason":null}]}', VOCAB) == StreamPiece(
        "hi"
    )
    line = 'data: {"choices":[{"text":"!","finish_reason":"stop","token_ids":[5, 99]}]}'
    assert parse_sse_line(line, VOCAB) == StreamPiece("!", [5, 99], "stop")
    usage = 'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":7}}'
    assert parse_sse_line(usage, VOCAB) == StreamPiece(usage_tokens=7)
    assert parse_sse_line("data: [DONE]", VOCAB) == StreamPiece(done=True)
    for skipped in ("", "   ", ": keep-alive", "event: completion", "id: 3", "retry: 100"):
        assert parse_sse_line(skipped, VOCAB) is None


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("hello", "not a server-sent event"),
        ("data: {oops", "not JSON"),
        ("data: [1, 2]", "a JSON list, not an object"),
        ('data: {"error": {"message": "boom"}}', "an error in the stream: {'message': 'boom'}"),
        ('data: {"id": 1}', "without a 'choices' list"),
        ('data: {"choices":[{"text":"a"},{"text":"b"}]}', "2 choices"),
        ('data: {"choices":[{"finish_reason":null}]}', "without a string 'text'"),
        ('data: {"choices":[{"text":"a","finish_reason":3}]}', "finish_reason that is not a string"),
        ('data: {"choices":[{"text":"a","token_ids":[100]}]}', "vocabulary of 100"),
        ('data: {"choices":[{"text":"a","token_ids":[-1]}]}', "vocabulary of 100"),
        ('data: {"choices":[{"text":"a","token_ids":[true]}]}', "vocabulary of 100"),
        ('data: {"choices":[{"text":"a","token_ids":"12"}]}', "vocabulary of 100"),
        ('data: {"choices":[],"usage":{"completion_tokens":"7"}}', "usage without a count"),
    ],
)
def test_malformed_lines_say_what_is_wrong(line, message):
    with pytest.raises(MalformedAnswer) as err:
        parse_sse_line(line, VOCAB)
    assert message in str(err.value)

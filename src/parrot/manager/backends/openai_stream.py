"""Reading an OpenAI-compatible ``/v1/completions`` answer streamed as server-sent events.

Pure functions over text: one SSE ``data:`` line in, one :class:`StreamPiece` out,
every field checked.  Whatever does not read as a completion chunk raises
:class:`MalformedAnswer` naming what was wrong, so the adapter
(:mod:`parrot.manager.backends.openai_backend`) can turn it into an engine failure that
names the backend; nothing malformed ever reaches a variable.

Accepted: ``data: [DONE]`` (the end), ``data: {"choices": [{"text": ..., "finish_reason":
..., "token_ids"?: [...]}], "usage"?: ...}``; a chunk with no choices (the usage chunk of
``stream_options.include_usage``); comment lines (``:``), ``event:``/``id:``/``retry:``
fields and blank lines are skipped.  ``token_ids`` (vLLM's ``return_token_ids``) must be
ints below the tokenizer's vocabulary size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

FINISH_REASONS = ("stop", "length")
"""The finish reasons a completed generation may report; any other (``abort``, ``error``,
a server's own) means the backend did not finish the request."""


class MalformedAnswer(ValueError):
    """A line of the backend's stream is not a completion chunk (the message says why)."""


@dataclass(frozen=True)
class StreamPiece:
    """One parsed stream event: ``done`` for ``[DONE]``; else the choice's ``text``,
    its ``token_ids`` when the server sent them (None when it did not) and its
    ``finish_reason`` (None while generating)."""

    text: str = ""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    done: bool = False
    usage_tokens: int | None = field(default=None)


_SKIPPED_FIELDS = ("event:", "id:", "retry:")


def parse_sse_line(line: str, vocab_size: int) -> StreamPiece | None:
    """The piece a ``data:`` line carries; None for lines that carry none (blank lines,
    comments, other SSE fields).  Raises :class:`MalformedAnswer`."""
    line = line.strip()
    if not line or line.startswith(":") or line.startswith(_SKIPPED_FIELDS):
        return None
    if not line.startswith("data:"):
        raise MalformedAnswer(f"a stream line that is not a server-sent event: {line[:120]!r}")
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return StreamPiece(done=True)
    try:
        chunk = json.loads(data)
    except ValueError as exc:
        raise MalformedAnswer(f"a stream event that is not JSON: {data[:120]!r}") from exc
    return parse_chunk(chunk, vocab_size)


def parse_chunk(chunk: object, vocab_size: int) -> StreamPiece:
    """Check one completion chunk (a decoded JSON value); raises :class:`MalformedAnswer`."""
    if not isinstance(chunk, dict):
        raise MalformedAnswer(f"a stream event that is a JSON {type(chunk).__name__}, not an object")
    if chunk.get("error"):
        raise MalformedAnswer(f"an error in the stream: {str(chunk['error'])[:300]}")
    usage = _usage_tokens(chunk.get("usage"))
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        raise MalformedAnswer("a stream event without a 'choices' list")
    if not choices:
        return StreamPiece(usage_tokens=usage)
    choice = choices[0]
    if len(choices) != 1 or not isinstance(choice, dict):
        raise MalformedAnswer(f"a stream event with {len(choices)} choices; one was asked for")
    text = choice.get("text")
    if not isinstance(text, str):
        raise MalformedAnswer("a choice without a string 'text'")
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise MalformedAnswer(f"a finish_reason that is not a string: {finish!r:.60}")
    ids = choice.get("token_ids")
    if ids is not None and not _valid_ids(ids, vocab_size):
        raise MalformedAnswer(
            f"token_ids that are not ids of the model's vocabulary of {vocab_size}: {str(ids)[:120]}"
        )
    return StreamPiece(text=text, token_ids=ids, finish_reason=finish, usage_tokens=usage)


def _usage_tokens(usage: object) -> int | None:
    if usage is None:
        return None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise MalformedAnswer(f"a usage without a count of completion_tokens: {str(usage)[:120]}")
    return tokens


def _valid_ids(ids: object, vocab_size: int) -> bool:
    return isinstance(ids, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids
    )

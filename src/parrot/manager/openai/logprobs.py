"""Generated tokens' logprobs in OpenAI's two shapes.

The engine reports, per generated token, its id, its logprob and the most likely
ids at its step (:class:`~parrot.protocol.schemas.TokenLogprob`); these turn them
into what the ``openai`` client parses: a completion's ``{"tokens",
"token_logprobs", "top_logprobs", "text_offset"}`` and a chat completion's
``{"content": [{"token", "logprob", "bytes", "top_logprobs"}], "refusal"}``.
A token is shown as the text its id decodes to alone (special tokens included),
as vLLM shows it; a token that is part of a multi-byte character reads as U+FFFD.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from parrot.protocol.schemas import TokenLogprob
from parrot.protocol.tokenizer import TextTokenizer

__all__ = ["chat_logprobs", "completion_logprobs"]


@functools.lru_cache(maxsize=1 << 16)
def _text(tokenizer: TextTokenizer, token_id: int) -> str:
    """The id's text alone (cached: answers repeat the same ids; bounded to 65,536 ids)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: TextTokenizer, entries: Sequence[TokenLogprob], offset: int = 0
) -> dict[str, Any]:
    """``/v1/completions``'s ``logprobs`` for ``entries``, the first token at character
    ``offset`` of the choice's text.  Each ``top_logprobs`` entry maps the chosen token
    and the most likely ones to their logprobs (vLLM's form)."""
    tokens: list[str] = []
    offsets: list[int] = []
    top: list[dict[str, float]] = []
    for e in entries:
        text = _text(tokenizer, e.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        alternatives = {_text(tokenizer, t): lp for t, lp in e.top}
        alternatives.setdefault(text, e.logprob)
        top.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _chat_token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}


def chat_logprobs(tokenizer: TextTokenizer, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``/v1/chat/completions``'s ``logprobs`` for ``entries``."""
    content = []
    for e in entries:
        item = _chat_token(_text(tokenizer, e.token_id), e.logprob)
        item["top_logprobs"] = [_chat_token(_text(tokenizer, t), lp) for t, lp in e.top]
        content.append(item)
    return {"content": content, "refusal": None}


def text_length(tokenizer: TextTokenizer, entries: Sequence[TokenLogprob]) -> int:
    """Characters the entries' tokens read as (to offset the next ones)."""
    return sum(len(_text(tokenizer, e.token_id)) for e in entries)

"""Which start of a request-level prompt to count once per engine.

A call of a semantic function declares what it shares: the constant text its
template starts with (a system prompt) is counted once per engine
(:attr:`parrot.manager.render.Rendered.constant_prefix`).  A plain completion
declares nothing: its whole prompt is one input value.  Yet 32 requests that
start with one 2,000-token system prompt and end in different questions hold
that system prompt once in an engine whose prefix cache shares it, and counting
it 32 times makes the scheduler's latency cap and capacity refuse work the
engine has room for.

:class:`SharedStarts` finds the shared start from the prompt's inner chunk keys
(:func:`parrot.manager.prefix.leading_chunks`): the longest chunk boundary that
an engine was recently given (:class:`~parrot.manager.prefix.PrefixIndex`) or
that another recent call's prompt also has; when none, the last boundary (the
call counts its own start once, which is exact for a call alone).  The tokens
before that boundary are the prompt's tokens times the share of the value
before it (exact for token-id prompts).  The counts of recent calls' keys are
bounded (least recently seen dropped first).
"""

from __future__ import annotations

from collections import OrderedDict

from parrot.manager.graph import Call
from parrot.manager.prefix import PrefixIndex, leading_chunks

__all__ = ["SharedStarts"]


class SharedStarts:
    def __init__(self, prefixes: PrefixIndex, min_tokens: int, max_keys: int = 65536):
        self.prefixes = prefixes
        self.min_tokens = min_tokens
        self.max_keys = max_keys
        self._seen: OrderedDict[str, int] = OrderedDict()  # inner key -> recent calls with it

    def chunks(self, call: Call) -> list[tuple[str, float]]:
        """The call's leading inner keys (with the share of the value before each),
        counted among the recent calls'."""
        inner, _ = leading_chunks(call)
        seen = self._seen
        for key, _share in inner:
            seen[key] = seen.get(key, 0) + 1
            seen.move_to_end(key)
        while len(seen) > self.max_keys:
            seen.popitem(last=False)
        return inner

    def prefix(self, chunks: list[tuple[str, float]], prompt_tokens: int) -> tuple[str, int] | None:
        """(key, tokens) of the start of a prompt of ``prompt_tokens`` tokens with these
        leading ``chunks`` to count once per engine, or None (no inner key, or fewer
        than ``min_tokens`` tokens before the chosen one)."""
        if not chunks:
            return None
        chosen = chunks[-1]
        for key, share in reversed(chunks):
            if self._seen.get(key, 0) >= 2 or self.prefixes.held_anywhere(key):
                chosen = (key, share)
                break
        tokens = round(prompt_tokens * chosen[1])
        return (chosen[0], tokens) if tokens >= self.min_tokens else None

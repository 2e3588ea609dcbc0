"""Which start of a call's prompt to count once per engine.

Calls that start alike hold that start once in an engine whose prefix cache shares
it: 32 requests under one 2,000-token system prompt, or the sixteen reviewers of a
multi-agent round whose prompts repeat the plan and every file's code and differ
only in the file they review.  Counting that start once per call makes the
scheduler's latency cap and capacity refuse work the engine has room for (the
reviewers ran one at a time).

:class:`SharedStarts` finds the start to count once from the prompt's keys
(:func:`parrot.manager.dag.prefix.key_shares`: every boundary between constant text and
values, and the values' inner chunk keys): the longest one that an engine was
recently given (:class:`~parrot.manager.dag.prefix.PrefixIndex`) or that another recent
call's prompt also has.  When none is, the likeliest start to be shared by calls to
come: the call's leading constant text if it has one (a system prompt: the part
every call of the template shares, whoever comes next), else its next-to-last key
(all but the prompt's last piece or chunk, where prompts of one kind tend to differ:
the question after a system prompt sent as one value).  A call alone holds the whole
of its prompt whichever start is chosen.  The tokens before a key are the prompt's
tokens times the share of the prompt before it (exact for token-id prompts, and for
the constant text, whose tokens the renderer counts).  The counts of recent calls'
keys are bounded (least recently seen dropped first).
"""

from __future__ import annotations

from collections import OrderedDict

from parrot.manager.dag.graph import Call
from parrot.manager.dag.prefix import PrefixIndex, key_shares

__all__ = ["SharedStarts"]


class SharedStarts:
    def __init__(self, prefixes: PrefixIndex, min_tokens: int, max_keys: int = 65536):
        self.prefixes = prefixes
        self.min_tokens = min_tokens
        self.max_keys = max_keys
        self._seen: OrderedDict[str, int] = OrderedDict()  # key -> recent calls with it

    def chunks(self, call: Call) -> list[tuple[str, float]]:
        """The call's keys (with the share of the prompt before each), counted among the
        recent calls'."""
        shares = key_shares(call)
        seen = self._seen
        for key, _share in shares:
            seen[key] = seen.get(key, 0) + 1
            seen.move_to_end(key)
        while len(seen) > self.max_keys:
            seen.popitem(last=False)
        return shares

    def prefix(
        self,
        chunks: list[tuple[str, float]],
        prompt_tokens: int,
        constant: tuple[str, int] | None = None,
    ) -> tuple[str, int] | None:
        """(key, tokens) of the start of a prompt to count once per engine, or None (no
        key, or fewer than ``min_tokens`` tokens before the chosen one).  ``chunks``: the
        prompt's keys from :meth:`chunks`; ``prompt_tokens``: its tokens before its first
        output; ``constant``: (key, tokens) of its leading constant text, if any."""
        if not chunks:
            return None
        chosen: tuple[str, float] | None = None
        for key, share in reversed(chunks):
            if self._seen.get(key, 0) >= 2 or self.prefixes.held_anywhere(key):
                chosen = (key, share)
                break
        if chosen is None and constant is not None:
            return constant if constant[1] >= self.min_tokens else None
        if chosen is None:
            chosen = chunks[-2] if len(chunks) >= 2 else chunks[-1]
        if constant is not None and chosen[0] == constant[0]:
            tokens = constant[1]
        else:
            tokens = round(prompt_tokens * chosen[1])
        return (chosen[0], tokens) if tokens >= self.min_tokens else None

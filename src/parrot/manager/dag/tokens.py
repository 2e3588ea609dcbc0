"""Tokenizing client text without stalling the manager's event loop.

No request and no scheduling round holds the loop for more than ~100 ms: text that
cannot fit is rejected from its byte length, short text (:data:`INLINE_TOKENIZE_BYTES`,
at most :data:`INLINE_PASS_BYTES` per pass) is tokenized where it is needed, and longer
text is deferred by a :class:`TokenSource` and tokenized in worker threads
(:meth:`TokenSource.resolve`) before the synchronous code runs again
(:meth:`parrot.manager.service.Manager.run_tokenized`).  Tokens are the same either way.
Why and how, with the figures: docs/manager.md, "Validating without stalling the event
loop".
"""

from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from parrot.protocol.tokenizer import TextTokenizer

INLINE_TOKENIZE_BYTES = 32 * 1024
"""Text of at most this many UTF-8 bytes is tokenized on the event loop; longer text in a
worker thread (``ManagerConfig.inline_tokenize_bytes``)."""
INLINE_PASS_BYTES = 64 * 1024
"""At most this many bytes of text are tokenized on the event loop in one pass of an
operation (a batch's many short texts: ~40 ms), the rest in the worker threads."""
TOKENIZE_THREADS = 2
"""Worker threads tokenizing long text, shared by every manager of the process."""

_POOL = ThreadPoolExecutor(max_workers=TOKENIZE_THREADS, thread_name_prefix="parrot-tokenize")


def utf8_len(text: str) -> int:
    """UTF-8 length of ``text`` (O(1) for ASCII text)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass(frozen=True)
class Tokenized:
    """What tokenizing one text gave: its token count, and its ids unless there were
    too many to be of use to whoever asked (``ids`` None: ``count`` exceeds that)."""

    count: int
    ids: list[int] | None


@dataclass(frozen=True)
class _Need:
    tokenizer: TextTokenizer
    text: str
    keep_ids: int  # keep the ids when there are at most this many


_Key = tuple[TextTokenizer, bytes]


class NeedsTokenizing(Exception):
    """Raised instead of tokenizing long text on the event loop; the text is recorded
    in the :class:`TokenSource` that deferred it.  Not a ParrotError: whoever runs the
    code catches it, resolves the source and runs the code again; no client sees it."""


class TokenSource:
    """Where synchronous code gets the tokens of a text: short text is tokenized at
    once, long text is looked up among the texts this source tokenized off the loop,
    and deferred if it is not there yet.

    ``inline_bytes=None`` never defers (tokenizes everything at once): for callers
    with no event loop to protect, and the behaviour of code given no source."""

    def __init__(self, inline_bytes: int | None = INLINE_TOKENIZE_BYTES) -> None:
        self.inline_bytes = inline_bytes
        self._inline_left = INLINE_PASS_BYTES  # of this pass (start_pass)
        self._known: dict[_Key, Tokenized] = {}
        self._needed: dict[_Key, _Need] = {}

    @property
    def pending(self) -> bool:
        """Whether some text was deferred and is not tokenized yet."""
        return bool(self._needed)

    def start_pass(self) -> None:
        """A new pass of the operation: its budget of text tokenized on the loop is whole again."""
        self._inline_left = INLINE_PASS_BYTES

    def get(self, tokenizer: TextTokenizer, text: str, keep_ids: int) -> Tokenized | None:
        """The tokens of ``text`` (ids kept when there are at most ``keep_ids``), or
        None when the text is long, or the pass's budget of inline tokenizing is
        spent, and it is not tokenized yet: it is then recorded, for :meth:`resolve`."""
        if self.inline_bytes is None:
            ids = tokenizer.encode(text)
            return Tokenized(len(ids), ids)
        size = utf8_len(text)
        if size <= self.inline_bytes and size <= self._inline_left:
            self._inline_left -= size
            ids = tokenizer.encode(text)
            return Tokenized(len(ids), ids)
        key = (tokenizer, _digest(text))
        known = self._known.get(key)
        if known is not None and (known.ids is not None or known.count > keep_ids):
            return known
        earlier = self._needed.get(key)
        keep = keep_ids if earlier is None else max(keep_ids, earlier.keep_ids)
        self._needed[key] = _Need(tokenizer, text, keep)
        return None

    async def resolve(self) -> None:
        """Tokenize every deferred text in the worker threads and remember the results."""
        needed, self._needed = self._needed, {}
        if not needed:
            return
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(
            *(loop.run_in_executor(_POOL, _tokenize, need) for need in needed.values())
        )
        self._known.update(zip(needed, results, strict=True))


def _tokenize(need: _Need) -> Tokenized:
    """Runs in a worker thread, without the GIL while the tokenizer works."""
    count, ids = need.tokenizer.encode_unlocked(need.text, keep_ids=need.keep_ids)
    return Tokenized(count, ids)

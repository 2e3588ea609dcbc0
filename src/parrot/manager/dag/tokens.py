"""Tokenizing client text without stalling the manager's event loop.

The rule: no request and no scheduling round holds the event loop for more
than ~100 ms, whatever the size of the text in it.  Tokenizing is the costly
part (about 0.6 µs per byte with SmolLM2's BPE: seconds for a value near the
8 MiB body limit), so:

* **Text that cannot fit is rejected without being tokenized.**  A byte-level
  BPE's longest token stands for at most ``L`` bytes of input
  (:attr:`~parrot.protocol.tokenizer.TextTokenizer.max_token_bytes`: 13 for the
  tiny test model, whose longest token is ``<|endoftext|>``; 81 for SmolLM2),
  so text of ``B`` bytes has at least ``ceil(B / L)`` tokens
  (:meth:`~parrot.protocol.tokenizer.TextTokenizer.min_tokens`).  A value or
  prompt over ``max_seq_len * L`` bytes is ``context_too_long`` at once.
* **Short text is tokenized where it is needed**: at most ``inline_bytes`` UTF-8
  bytes (:data:`INLINE_TOKENIZE_BYTES`, 32 KiB: ~20 ms with SmolLM2's BPE or
  the tiny model's, leaving room for the rest of a request's work), and at most
  :data:`INLINE_PASS_BYTES` in all per pass of an operation: a batch of
  thousands of short texts tokenizes the first 64 KiB of them where they are
  needed and the rest off the loop, like one long text.
* **Longer text is tokenized in a worker thread, ahead of the code that needs
  it.**  That code is synchronous (the manager validates a request completely
  before it changes anything, with nothing awaited in between), so it runs with
  a :class:`TokenSource` that *defers* long text it has not seen: the text is
  recorded and the code either raises :class:`NeedsTokenizing` (a render) or
  skips the check for now (a value's length, see
  :meth:`parrot.manager.service.Manager.run_tokenized`).  The caller then
  tokenizes what was recorded off the loop (:meth:`TokenSource.resolve`) and
  runs the code again, which finds the tokens.  The worker threads use
  :meth:`~parrot.protocol.tokenizer.TextTokenizer.encode_unlocked`, which
  releases the GIL (``encode`` holds it: in a thread it would still stall the
  loop).  At most :data:`TOKENIZE_THREADS` texts are tokenized at once, which
  also bounds the memory a tokenizer's intermediate results take.

Tokens are the same whichever way they were computed: both ways run the same
tokenizer over the same string.
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

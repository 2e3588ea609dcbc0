"""Automatic prefix caching: full KV blocks addressed by the tokens they hold (torch-free).

A context's token sequence is cut into blocks of ``block_size`` tokens.  The
*digest* of block ``i`` is a cryptographic hash of the digest of block
``i - 1`` (for ``i == 0``, a root fixed per *cache salt*) and block ``i``'s
tokens, so equal digests mean equal tokens from position 0 to the block's end
under the same salt — whichever context, call or session computed them.  The
manager gives each tenant's calls their own salt (unless the operator lets
tenants share), so one tenant never hits, nor times, another's blocks.  The cache maps digests to
the block holding that KV, and a context that is about to compute tokens a
cached block already holds takes the block instead (a hit), like vLLM's
automatic prefix caching or SGLang's radix cache.  Nothing has to be
declared: a system prompt, a document read by several calls, a conversation's
history or a request-level client's repeated prefix are all found by their
tokens.

Invariants:
- only *full, computed* blocks are indexed, and at most one block per digest
  (the first to be computed; a block computed again elsewhere at the same time
  stays private to its context);
- an indexed block is *retained* in the :class:`BlockPool`: when no context
  references it any more it is cached, not freed, and the pool evicts it
  (least recently released first) only when an allocation needs the room,
  telling the cache through ``on_evict``;
- an indexed block is never written: a context about to write into a block it
  shares is given a copy (copy-on-write), and :meth:`PrefixCache.forget` drops
  a block from the index before its only holder rewrites rows of it;
- a hit never covers a context's last token: the step that computes it gives
  the logits the next token is sampled from.

Each :class:`~parrot.engine.core.contexts.Context` keeps the digests of its full
computed blocks (``block_hashes``), maintained by
:class:`~parrot.engine.core.contexts.ContextTable`, so extending the chain costs
one hash per new block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

from parrot.engine.core.block_pool import BlockPool

ROOT = b"parrot-prefix-cache/1"


def salted_root(salt: str) -> bytes:
    """The digest chain's root for contexts of prefix-cache salt ``salt`` (``ROOT`` for
    none): blocks of equal tokens under different salts get different digests, so one
    salt's cached blocks are never found by another's contexts."""
    if not salt:
        return ROOT
    return hashlib.blake2b(ROOT + b"/salt/" + salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def block_digest(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The digest of a block holding ``tokens`` after the block whose digest is ``previous``."""
    return hashlib.blake2b(previous + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCache:
    """Digest -> block index over one :class:`BlockPool` (it installs the pool's ``on_evict``)."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self._block_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        pool.on_evict = self._evicted

    def __len__(self) -> int:
        return len(self._block_of)

    def lookup(self, digest: bytes) -> int | None:
        return self._block_of.get(digest)

    def add(self, digest: bytes, block: int) -> bool:
        """Index ``block`` (used, full, computed) under ``digest``; False if the digest
        is already indexed (another block holds the same tokens) or the block is."""
        if digest in self._block_of or block in self._digest_of:
            return False
        self.pool.retain(block)
        self._block_of[digest] = block
        self._digest_of[block] = digest
        return True

    def forget(self, block: int) -> None:
        """Drop ``block`` from the index (its holder is about to rewrite it)."""
        digest = self._digest_of.pop(block, None)
        if digest is not None:
            del self._block_of[digest]
            self.pool.unretain(block)

    def _evicted(self, block: int) -> None:
        del self._block_of[self._digest_of.pop(block)]

    def match(self, previous: bytes, tokens: Callable[[int, int], Sequence[int]], start: int, stop: int):
        """Indexed blocks continuing a chain, as ``[(digest, block), ...]``.

        ``previous`` is the digest of the block before block ``start`` (``ROOT``
        for 0); ``tokens(lo, hi)`` returns the sequence's tokens ``[lo, hi)``; blocks
        ``start .. stop - 1`` are tried in order and the run ends at the first miss.
        Nothing changes (no reference is taken).
        """
        bs, found = self.block_size, []
        for i in range(start, stop):
            digest = block_digest(previous, tokens(i * bs, (i + 1) * bs))
            block = self._block_of.get(digest)
            if block is None:
                break
            found.append((digest, block))
            previous = digest
        return found

"""Context tree and paged-KV bookkeeping: which tokens each context holds and
which KV blocks hold them.

A context is a sequence of tokens whose KV cache the engine keeps.  A child
context is *forked* from a parent at the parent's current length: it sees the
parent's first ``prefix_len`` tokens (and, recursively, the parent's own
ancestors) without copying them, then appends tokens of its own.  The parent
may keep growing after the fork; the child never sees those later tokens.

KV lives in fixed-size blocks of a :class:`~parrot.engine.core.block_pool.BlockPool`.
Every context has its own *block table* covering all its computed tokens from
position 0: token ``p`` lives in block ``block_table[p // bs]`` at row ``p % bs``.
A fork copies the parent's table entries for the prefix and increfs them (no
KV is copied); the first write into a block whose refcount is > 1 copies the
block first (copy-on-write, see :meth:`ContextTable.reserve`).

Invariants:
- ``ctx.prefix_len`` (tokens visible from ancestors) is fixed at fork time;
  ``ctx.length == ctx.prefix_len + len(ctx.own_tokens)``.
- ``0 <= ctx.computed_len <= ctx.length``: positions before ``computed_len``
  have KV in the context's blocks; the rest are *pending*.  ``computed_len``
  may drop below ``prefix_len`` when KV is evicted under memory pressure
  (:meth:`ContextTable.truncate`): the tokens stay known (through
  :meth:`Context.tokens`), so the KV can be recomputed.
- Between steps, ``len(ctx.block_table) == ceil(computed_len / bs)``; during a
  step :meth:`ContextTable.reserve` may extend it to cover the step's writes.
- A block's refcount equals the number of block-table entries naming it, over
  all contexts in the table.  Blocks shared by two tables arise from a fork
  or from a prefix-cache hit (:mod:`parrot.engine.core.prefix_cache`; a hit is
  taken, and a block indexed, only right after the indexed block before it),
  hold the same tokens
  at the same positions and form a common prefix of both tables, so along one
  table refcounts never increase: a context's *private* blocks (refcount 1)
  are a suffix of its table.
- A context is forked only when its parent has no pending tokens.
- With a prefix cache, ``ctx.block_hashes`` holds the digests of exactly the
  context's full computed blocks: ``len(ctx.block_hashes) == ctx.computed_len // bs``
  between steps (:meth:`ContextTable.index_computed` extends it after a step;
  :meth:`ContextTable.truncate` and forks keep it so).  Without one it stays empty.
- ``free`` drops a context at once: its id may be reused immediately and its
  block references go; blocks still read by children stay alive through the
  children's references.  A child keeps a Python reference to its parent's
  :class:`Context` only for the parent's *tokens* (needed to recompute
  evicted KV), never for its storage.

Torch-free: the KV tensors belong to :mod:`parrot.engine.kv_store`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from parrot.engine.core.block_pool import BlockPool
from parrot.engine.core.prefix_cache import ROOT, PrefixCache, block_digest, salted_root
from parrot.protocol.errors import BadRequest, Conflict, ContextTooLong, NotFound


@dataclass(eq=False)
class Context:
    context_id: int
    parent: Context | None
    prefix_len: int
    own_tokens: list[int] = field(default_factory=list)
    computed_len: int = 0
    block_table: list[int] = field(default_factory=list)
    busy: bool = False  # a job owns it (running, or preempted and waiting to resume)
    retained: bool = False  # kept for a call that will read it: evicted after other idle contexts
    last_used: int = 0  # a logical clock, for least-recently-used eviction
    block_hashes: list[bytes] = field(default_factory=list)  # digests of the full computed blocks
    root: bytes = ROOT  # the digest chain's root: its prefix-cache salt's (a fork's is its parent's)

    @property
    def length(self) -> int:
        return self.prefix_len + len(self.own_tokens)

    @property
    def num_computed(self) -> int:
        """Own tokens with KV (negative when evicted KV reaches into the prefix)."""
        return self.computed_len - self.prefix_len

    @num_computed.setter
    def num_computed(self, value: int) -> None:
        self.computed_len = self.prefix_len + value

    @property
    def num_pending(self) -> int:
        return self.length - self.computed_len

    @property
    def pending(self) -> list[int]:
        return self.tokens(self.computed_len, self.length)

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``[start, end)`` (``0 <= start <= end <= length``)."""
        if start >= self.prefix_len:
            return self.own_tokens[start - self.prefix_len : end - self.prefix_len]
        out: list[int] = []
        pos = 0
        for ctx, visible in self.lineage():
            lo, hi = max(start, pos), min(end, pos + visible)
            if lo < hi:
                out.extend(ctx.own_tokens[lo - pos : hi - pos])
            pos += visible
        return out

    def lineage(self) -> list[tuple[Context, int]]:
        """(context, number of its own tokens visible) from the root down to self."""
        chain: list[tuple[Context, int]] = [(self, len(self.own_tokens))]
        node = self
        while node.parent is not None:
            visible = node.prefix_len - node.parent.prefix_len
            chain.append((node.parent, visible))
            node = node.parent
        chain.reverse()
        return chain


class ContextTable:
    """All contexts of one engine, with their block tables.

    ``pool`` holds the KV blocks (default: room for four full-length contexts,
    for bookkeeping-only use).  ``on_release(context_id)`` is called when a
    context is freed.  ``prefix_cache``: index full computed blocks by their
    tokens so that later contexts reuse them (:meth:`reuse_cached`).
    """

    def __init__(
        self,
        max_seq_len: int,
        on_release: Callable[[int], None] | None = None,
        *,
        pool: BlockPool | None = None,
        prefix_cache: bool = False,
    ):
        self.max_seq_len = max_seq_len
        self.pool = pool if pool is not None else BlockPool(4 * -(-max_seq_len // 16))
        self.block_size = self.pool.block_size
        self.cache = PrefixCache(self.pool) if prefix_cache else None
        self._contexts: dict[int, Context] = {}
        self._on_release = on_release

    def __len__(self) -> int:
        return len(self._contexts)

    def __contains__(self, context_id: int) -> bool:
        return context_id in self._contexts

    def __iter__(self) -> Iterator[Context]:
        return iter(self._contexts.values())

    def get(self, context_id: int) -> Context:
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise NotFound(f"context {context_id} does not exist", code="context_not_found")
        return ctx

    def open(self, context_id: int, parent_context_id: int | None, cache_salt: str = "") -> Context:
        """Return context ``context_id``, creating it (forked from the parent, if
        given) when it does not exist yet.  Naming a parent for an existing
        context is allowed only if it is that context's parent.  A new root
        context takes ``cache_salt``'s digest root; a fork shares its parent's."""
        existing = self._contexts.get(context_id)
        if existing is not None:
            if parent_context_id is not None and (
                existing.parent is None or existing.parent.context_id != parent_context_id
            ):
                raise Conflict(
                    f"context {context_id} exists and is not a child of context {parent_context_id}",
                    code="context_conflict",
                )
            return existing
        parent: Context | None = None
        if parent_context_id is not None:
            if parent_context_id == context_id:
                raise BadRequest("a context cannot be its own parent")
            parent = self.get(parent_context_id)
            if parent.num_pending:
                raise Conflict(
                    f"parent context {parent_context_id} has uncomputed tokens; fork after its fill ends",
                    code="context_conflict",
                )
        prefix = parent.length if parent else 0
        root = parent.root if parent is not None else salted_root(cache_salt)
        ctx = Context(context_id, parent, prefix, computed_len=prefix, root=root)
        if parent is not None:
            ctx.block_table = parent.block_table[: self.pool.blocks_for(ctx.prefix_len)]
            self.pool.incref(ctx.block_table)
            ctx.block_hashes = parent.block_hashes[: prefix // self.block_size]
        self._contexts[context_id] = ctx
        return ctx

    def check_length(self, ctx_id: int, length: int) -> None:
        """Raise ContextTooLong unless a context of ``length`` tokens can ever be held."""
        if length > self.max_seq_len:
            raise ContextTooLong(
                f"context {ctx_id} would hold {length} tokens; the model's context is {self.max_seq_len}"
            )
        capacity = self.pool.num_blocks * self.block_size
        if length > capacity:
            raise ContextTooLong(
                f"context {ctx_id} would hold {length} tokens; the engine's KV cache holds {capacity}",
                code="kv_capacity_exceeded",
            )

    def append(self, ctx: Context, tokens: list[int]) -> None:
        self.check_length(ctx.context_id, ctx.length + len(tokens))
        ctx.own_tokens.extend(tokens)

    def free(self, context_id: int) -> None:
        ctx = self.get(context_id)
        del self._contexts[context_id]
        self.truncate(ctx, 0)
        if self._on_release is not None:
            self._on_release(context_id)

    # ------------------------------------------------------------ KV blocks
    def blocks_needed(self, ctx: Context, n: int) -> int:
        """Fresh blocks :meth:`reserve` would take to write ``n`` tokens at ``computed_len``."""
        bs, table, c = self.block_size, ctx.block_table, ctx.computed_len
        need = max(0, -(-(c + n) // bs) - len(table))
        if c % bs and self.pool.refcount(table[c // bs]) > 1:
            need += 1  # copy-on-write of the partially filled shared block
        return need

    def reserve(self, ctx: Context, n: int) -> list[tuple[int, int]] | None:
        """Make ``ctx``'s table cover positions ``[computed_len, computed_len + n)``
        with blocks it may write.  Returns the ``(src, dst)`` block copies the
        caller must perform before writing (copy-on-write), or ``None`` when
        the pool is short; then nothing changed."""
        bs, table, c = self.block_size, ctx.block_table, ctx.computed_len
        pool = self.pool
        need = self.blocks_needed(ctx, n)
        fresh = pool.allocate(need)
        if fresh is None:
            return None
        copies: list[tuple[int, int]] = []
        if c % bs and pool.refcount(table[c // bs]) > 1:
            src, dst = table[c // bs], fresh.pop()
            table[c // bs] = dst
            pool.decref((src,))
            copies.append((src, dst))
        elif c % bs and self.cache is not None:
            self.cache.forget(table[c // bs])  # rows of it are about to be rewritten
        table.extend(fresh)
        return copies

    # ------------------------------------------------------- prefix cache
    def index_computed(self, ctx: Context) -> None:
        """After ``ctx.computed_len`` grew: digest its newly full blocks and index
        them in the prefix cache (no-op without one)."""
        cache = self.cache
        if cache is None:
            return
        bs, hashes, table = self.block_size, ctx.block_hashes, ctx.block_table
        previous = hashes[-1] if hashes else ctx.root
        # only right after the indexed block of the previous digest: a context's indexed
        # blocks are a prefix of its table (after a private duplicate nothing is indexed)
        chained = not hashes or cache.lookup(previous) == table[len(hashes) - 1]
        for i in range(len(hashes), ctx.computed_len // bs):
            digest = block_digest(previous, ctx.tokens(i * bs, (i + 1) * bs))
            hashes.append(digest)
            chained = chained and (cache.add(digest, table[i]) or cache.lookup(digest) == table[i])
            previous = digest

    def digests_ahead(self, ctx: Context, stop: int) -> list[bytes]:
        """Digests of ``ctx``'s blocks ``len(ctx.block_hashes) .. stop - 1`` from its tokens
        (computed or not; block ``stop - 1`` must be whole within ``ctx.length``)."""
        bs, hashes = self.block_size, ctx.block_hashes
        previous = hashes[-1] if hashes else ctx.root
        out = []
        for i in range(len(hashes), stop):
            previous = block_digest(previous, ctx.tokens(i * bs, (i + 1) * bs))
            out.append(previous)
        return out

    def reuse_cached(self, ctx: Context) -> int:
        """Take indexed blocks for ``ctx``'s next pending tokens (whole blocks, never
        its last token); returns the number of tokens they cover (0 without a cache,
        or when its computed length is not at a block boundary)."""
        cache, bs = self.cache, self.block_size
        if cache is None or ctx.computed_len % bs:
            return 0
        start, stop = ctx.computed_len // bs, (ctx.length - 1) // bs
        if stop <= start:
            return 0
        previous = ctx.block_hashes[start - 1] if start else ctx.root
        if start and cache.lookup(previous) != ctx.block_table[start - 1]:
            return 0  # its last block is a private duplicate: shared blocks must stay a common prefix
        found = cache.match(previous, ctx.tokens, start, stop)
        if not found:
            return 0
        blocks = [b for _, b in found]
        self.pool.incref(blocks)
        ctx.block_table.extend(blocks)
        ctx.block_hashes.extend(d for d, _ in found)
        ctx.computed_len += bs * len(found)
        return bs * len(found)

    def cached_prefix(self, tokens: list[int], cache_salt: str = "") -> list[int]:
        """The indexed blocks a new context of ``tokens`` and ``cache_salt`` would reuse
        (nothing is taken)."""
        if self.cache is None:
            return []
        stop = (len(tokens) - 1) // self.block_size
        root = salted_root(cache_salt)
        return [b for _, b in self.cache.match(root, lambda lo, hi: tokens[lo:hi], 0, stop)]

    def slots(self, ctx: Context, start: int, n: int) -> list[int]:
        """Flat cache rows (``block * bs + offset``) of positions ``[start, start + n)``."""
        bs, table = self.block_size, ctx.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    def private_from(self, ctx: Context) -> int:
        """Index of the first block of ``ctx``'s private suffix (refcount-1 blocks)."""
        refcount, table = self.pool.refcount, ctx.block_table
        i = len(table)
        while i and refcount(table[i - 1]) == 1:
            i -= 1
        return i

    def truncate(self, ctx: Context, num_tokens: int) -> int:
        """Forget ``ctx``'s KV from position ``num_tokens`` on (its tokens stay);
        returns the number of blocks that went back to the pool."""
        keep = self.pool.blocks_for(num_tokens)
        ctx.computed_len = min(ctx.computed_len, num_tokens)
        del ctx.block_hashes[ctx.computed_len // self.block_size :]
        dropped = ctx.block_table[keep:]
        del ctx.block_table[keep:]
        return len(self.pool.decref(dropped))

    def stored_tokens(self) -> int:
        """Tokens whose KV is stored: filled rows of used blocks, shared blocks once.

        A block's fill is the largest of its holders'.  Only a table's last block
        can be partly filled for its context, so a block is partly filled overall
        only if *every* holder has it as a partly filled last block; this is
        O(number of contexts).
        """
        bs = self.block_size
        partial: dict[int, list[int]] = {}  # block -> [largest fill, holders with it partly filled]
        for ctx in self._contexts.values():
            rows = ctx.computed_len % bs
            if rows:
                seen = partial.setdefault(ctx.block_table[-1], [0, 0])
                seen[0] = max(seen[0], rows)
                seen[1] += 1
        refcount = self.pool.refcount
        missing = sum(bs - rows for b, (rows, holders) in partial.items() if holders == refcount(b))
        return self.pool.num_used * bs - missing

    def all_ids(self) -> list[int]:
        return list(self._contexts)

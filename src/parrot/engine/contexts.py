"""Context tree: which tokens each context holds and which ancestor prefix it sees.

A context is a sequence of tokens whose KV cache the engine keeps.  A child
context is *forked* from a parent at the parent's current length: it sees the
parent's first ``fork_len`` tokens (and, recursively, the parent's own
ancestors) without copying them, then appends tokens of its own.  The parent
may keep growing after the fork; the child never sees those later tokens.

Invariants:
- ``ctx.prefix_len`` (tokens visible from ancestors) is fixed at fork time;
  ``ctx.length == ctx.prefix_len + len(ctx.own_tokens)``.
- ``0 <= ctx.num_computed <= len(ctx.own_tokens)``: own tokens before
  ``num_computed`` have KV stored; the rest are pending.
- A context is forked only when its parent has no pending tokens, so every
  visible ancestor token has KV.
- Storage of a context lives while it is referenced: by the user (until
  ``free``) or by any live child.  ``free`` on a context with children only
  drops the user's reference; storage goes when the last child goes.

Torch-free: the KV tensors belong to the kv store, keyed by context id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from parrot.protocol.errors import BadRequest, Conflict, ContextTooLong, NotFound


@dataclass(eq=False)
class Context:
    context_id: int
    parent: Context | None
    prefix_len: int
    own_tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    live_children: int = 0
    user_freed: bool = False
    busy: bool = False  # a fill or generate is running on it

    @property
    def length(self) -> int:
        return self.prefix_len + len(self.own_tokens)

    @property
    def computed_length(self) -> int:
        return self.prefix_len + self.num_computed

    @property
    def pending(self) -> list[int]:
        return self.own_tokens[self.num_computed :]

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
    """All contexts of one engine.  ``on_release(context_id)`` is called when a
    context's storage may be dropped."""

    def __init__(self, max_seq_len: int, on_release: Callable[[int], None] | None = None):
        self.max_seq_len = max_seq_len
        self._contexts: dict[int, Context] = {}
        self._on_release = on_release

    def __len__(self) -> int:
        return sum(1 for c in self._contexts.values() if not c.user_freed)

    def __contains__(self, context_id: int) -> bool:
        ctx = self._contexts.get(context_id)
        return ctx is not None and not ctx.user_freed

    def get(self, context_id: int) -> Context:
        ctx = self._contexts.get(context_id)
        if ctx is None or ctx.user_freed:
            raise NotFound(f"context {context_id} does not exist", code="context_not_found")
        return ctx

    def open(self, context_id: int, parent_context_id: int | None) -> Context:
        """Return context ``context_id``, creating it (forked from the parent, if
        given) when it does not exist yet.  Naming a parent for an existing
        context is allowed only if it is that context's parent."""
        existing = self._contexts.get(context_id)
        if existing is not None and not existing.user_freed:
            if parent_context_id is not None and (
                existing.parent is None or existing.parent.context_id != parent_context_id
            ):
                raise Conflict(
                    f"context {context_id} exists and is not a child of context {parent_context_id}",
                    code="context_conflict",
                )
            return existing
        if existing is not None:
            raise Conflict(f"context id {context_id} is still being released", code="context_conflict")
        parent: Context | None = None
        if parent_context_id is not None:
            if parent_context_id == context_id:
                raise BadRequest("a context cannot be its own parent")
            parent = self.get(parent_context_id)
            if parent.pending:
                raise Conflict(
                    f"parent context {parent_context_id} has uncomputed tokens; fork after its fill ends",
                    code="context_conflict",
                )
            parent.live_children += 1
        ctx = Context(context_id, parent, parent.length if parent else 0)
        self._contexts[context_id] = ctx
        return ctx

    def append(self, ctx: Context, tokens: list[int]) -> None:
        if ctx.length + len(tokens) > self.max_seq_len:
            raise ContextTooLong(
                f"context {ctx.context_id} would hold {ctx.length + len(tokens)} tokens; "
                f"the model's context is {self.max_seq_len}"
            )
        ctx.own_tokens.extend(tokens)

    def free(self, context_id: int) -> None:
        ctx = self.get(context_id)
        ctx.user_freed = True
        self._release_if_unreferenced(ctx)

    def _release_if_unreferenced(self, ctx: Context) -> None:
        while ctx is not None and ctx.user_freed and ctx.live_children == 0:
            del self._contexts[ctx.context_id]
            if self._on_release is not None:
                self._on_release(ctx.context_id)
            parent = ctx.parent
            if parent is not None:
                parent.live_children -= 1
            ctx = parent  # type: ignore[assignment]

    def stored_tokens(self) -> int:
        """Tokens whose KV is stored (shared prefixes counted once)."""
        return sum(c.num_computed for c in self._contexts.values())

    def all_ids(self) -> list[int]:
        return [cid for cid, c in self._contexts.items() if not c.user_freed]

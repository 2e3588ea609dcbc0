"""Prompt-prefix hashing at variable boundaries, and the cluster-wide index of
prefix contexts held by engines (the paper's ``PrefixHash``).

A call's template is constant text interleaved with variables.  At every
boundary where constant text ends and a variable begins, before the call's
first output, the prompt so far gets a key: a hash chained over the pieces
(constant text, and input values once known) and the chat flag.  Two calls
whose prompts agree up to a boundary get the same key there, whichever
session, application or tenant they come from, so finding sharing is one
dict lookup per boundary, not a token-by-token comparison.

Keys depend only on the text, never on the tokenizer: rendering is
piecewise (each piece is tokenized on its own), so equal pieces give equal
tokens on any one engine, and an engine serves one model.

:class:`PrefixIndex` maps (key, engine) to the context that holds that prefix
there.  An entry is *pinned* while calls use it or queued/pending calls will
(their interest is registered at submit); unpinned entries are evicted least
recently used beyond a per-engine budget.  Pure bookkeeping: no I/O.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from parrot.manager.graph import Call, Variable
from parrot.protocol.template import Piece, Placeholder, Text

_tick = itertools.count()


def _chain(prev: bytes, kind: bytes, text: str) -> bytes:
    data = text.encode()
    return hashlib.blake2b(prev + kind + len(data).to_bytes(8, "little") + data, digest_size=16).digest()


def user_pieces(call: Call) -> list[Piece]:
    """The template's pieces as the model will read them, before any chat
    markup: with ``chat=True``, whitespace at the edges of the user's turn
    (a docstring's newline before the output) is dropped — it only confuses
    the model — and the output is the last piece."""
    pieces = list(call.template.pieces)
    if not call.chat:
        return pieces
    while pieces and isinstance(pieces[-1], Text) and not pieces[-1].text.strip():
        pieces.pop()
    body = pieces[:-1]
    if body and isinstance(body[-1], Text):
        body[-1] = Text(body[-1].text.rstrip())
    if body and isinstance(body[0], Text):
        body[0] = Text(body[0].text.lstrip())
    return [*(p for p in body if not isinstance(p, Text) or p.text), pieces[-1]]


def prefix_keys(call: Call) -> list[str]:
    """Keys of the call's prompt at each constant->variable boundary before its
    first output, as far as its inputs are known (stops at the first input
    without a value).  Outermost first.

    Once every input it reads is known the keys are final (templates and
    values never change), so they are computed once and kept on the call."""
    if call.prefix_cache is not None:
        return list(call.prefix_cache)
    keys: list[str] = []
    h = _chain(b"", b"C" if call.chat else b"R", "")
    pieces = user_pieces(call)
    for i, piece in enumerate(pieces):
        if isinstance(piece, Text):
            h = _chain(h, b"T", piece.text)
            nxt = pieces[i + 1] if i + 1 < len(pieces) else None
            if isinstance(nxt, Placeholder):
                keys.append(h.hex())
            continue
        if piece.direction == "output":
            break
        value = call.inputs[piece.name]
        if isinstance(value, Variable):
            if value.value is None:
                return keys  # not final: an input is still pending
            value = value.value
        h = _chain(h, b"V", value)
    call.prefix_cache = tuple(keys)
    return keys


@dataclass(eq=False)
class PrefixEntry:
    key: str
    engine_id: str
    context_id: int
    num_tokens: int
    users: int = 0  # running calls forked from it
    ready: object = None  # set by the executor: an awaitable resolved once the fill is done
    last_used: int = field(default_factory=lambda: next(_tick))


class PrefixIndex:
    def __init__(self, max_unpinned_per_engine: int = 32):
        self.max_unpinned_per_engine = max_unpinned_per_engine
        self._entries: dict[tuple[str, str], PrefixEntry] = {}
        self._by_engine: dict[str, OrderedDict[str, PrefixEntry]] = {}
        self._interest: dict[str, set[Call]] = {}
        self._versions: dict[str, int] = {}  # engine id -> bumped when its entries change
        self._keys_on: dict[str, frozenset[str]] = {}  # engine id -> keys_on(), until it changes
        # engines whose entries changed since the executor last took this set (see take_changed)
        self._changed_engines: set[str] = set()

    # ------------------------------------------------------------ interest
    def add_interest(self, call: Call, keys: list[str]) -> None:
        """``call`` will use these prefixes; counted until the call ends."""
        for k in keys:
            self._interest.setdefault(k, set()).add(call)

    def interest(self, key: str) -> int:
        """How many unfinished calls will use prefix ``key``."""
        calls = self._interest.get(key)
        if not calls:
            return 0
        for c in [c for c in calls if c.state in ("done", "failed")]:
            calls.discard(c)
        if not calls:
            del self._interest[key]
        return len(calls)

    # ------------------------------------------------------------- entries
    def lookup(self, key: str, engine_id: str) -> PrefixEntry | None:
        return self._entries.get((key, engine_id))

    def longest(self, keys: list[str], engine_id: str) -> tuple[int, PrefixEntry] | None:
        """The deepest of ``keys`` held on ``engine_id``, with its position in ``keys``."""
        for i in range(len(keys) - 1, -1, -1):
            entry = self._entries.get((keys[i], engine_id))
            if entry is not None:
                return i, entry
        return None

    def engines_holding(self, key: str) -> list[str]:
        return [eid for eid, entries in self._by_engine.items() if key in entries]

    def version(self, engine_id: str) -> int:
        return self._versions.get(engine_id, 0)

    def _changed(self, engine_id: str) -> None:
        self._versions[engine_id] = self._versions.get(engine_id, 0) + 1
        self._keys_on.pop(engine_id, None)
        self._changed_engines.add(engine_id)

    def take_changed(self) -> set[str]:
        """Engines whose entries changed since the last call (and forget them)."""
        changed, self._changed_engines = self._changed_engines, set()
        return changed

    def keys_on(self, engine_id: str) -> frozenset[str]:
        """The keys held on an engine; the same object until they change."""
        keys = self._keys_on.get(engine_id)
        if keys is None:
            keys = self._keys_on[engine_id] = frozenset(self._by_engine.get(engine_id, ()))
        return keys

    def add(self, entry: PrefixEntry) -> None:
        if (entry.key, entry.engine_id) in self._entries:
            raise ValueError(f"prefix {entry.key} already indexed on {entry.engine_id}")
        self._entries[(entry.key, entry.engine_id)] = entry
        self._by_engine.setdefault(entry.engine_id, OrderedDict())[entry.key] = entry
        self._changed(entry.engine_id)

    def acquire(self, entry: PrefixEntry) -> None:
        entry.users += 1
        entry.last_used = next(_tick)
        self._by_engine[entry.engine_id].move_to_end(entry.key)

    def release(self, entry: PrefixEntry) -> None:
        if entry.users <= 0:
            raise ValueError("release without acquire")
        entry.users -= 1

    def remove(self, entry: PrefixEntry) -> None:
        self._entries.pop((entry.key, entry.engine_id), None)
        engine = self._by_engine.get(entry.engine_id)
        if engine is not None:
            engine.pop(entry.key, None)
        self._changed(entry.engine_id)

    def forget_engine(self, engine_id: str) -> list[PrefixEntry]:
        entries = list(self._by_engine.pop(engine_id, {}).values())
        self._changed(engine_id)
        for e in entries:
            self._entries.pop((e.key, engine_id), None)
        return entries

    def pinned(self, entry: PrefixEntry) -> bool:
        return entry.users > 0 or self.interest(entry.key) > 0

    def evictable(self, engine_id: str) -> list[PrefixEntry]:
        """Unpinned entries beyond the per-engine budget, least recently used
        first; the caller frees their contexts and calls :meth:`remove`."""
        entries = self._by_engine.get(engine_id, OrderedDict())
        unpinned = [e for e in entries.values() if not self.pinned(e)]
        excess = len(unpinned) - self.max_unpinned_per_engine
        return sorted(unpinned, key=lambda e: e.last_used)[: max(excess, 0)]

    def __len__(self) -> int:
        return len(self._entries)

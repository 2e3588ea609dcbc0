"""Prompt-prefix hashing at variable boundaries (the paper's ``PrefixHash``), and
which engines recently served which prefixes.

A prompt gets a key at every boundary between its pieces before the first output (and,
inside a long value, every ``CHUNK_CHARS`` characters): a hash chained over the pieces
from the call's prefix-cache salt, so calls that share a start find each other with one
dict lookup per boundary (:func:`prefix_keys`, :func:`key_shares`).
:class:`PrefixIndex` remembers per engine the keys recently placed there: a hint of
what its prefix cache holds, never a promise.  Keys depend only on the text, never on
the tokenizer.  Why and how: docs/scheduling.md, "Prefix keys".  Pure bookkeeping: no I/O.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable

from parrot.manager.dag.graph import Call, Variable
from parrot.protocol.template import Piece, Text, prompt_pieces

CHUNK_CHARS = 512
"""Characters of an input value between two of its inner keys (about 100-130 tokens)."""
CHUNK_IDS = 128
"""Token ids of a token-id prompt between two of its inner keys."""
MAX_CHUNK_KEYS = 128
"""Inner keys of one value at most (its first 64 KiB of text); the rest is one piece."""


def _chain(prev: bytes, kind: bytes, text: str) -> bytes:
    data = text.encode()
    return hashlib.blake2b(prev + kind + len(data).to_bytes(8, "little") + data, digest_size=16).digest()


def _chunked(h: bytes, kind: bytes, parts: list[str]) -> tuple[list[str], bytes]:
    """Chain ``parts`` (a value cut into chunks) onto ``h``: the key after every chunk
    but the last, and the state after them all."""
    inner: list[str] = []
    for i, part in enumerate(parts):
        h = _chain(h, kind, part)
        if i + 1 < len(parts):
            inner.append(h.hex())
    return inner, h


def _text_parts(value: str) -> list[str]:
    cut = CHUNK_CHARS * MAX_CHUNK_KEYS
    parts = [value[i : i + CHUNK_CHARS] for i in range(0, min(len(value), cut), CHUNK_CHARS)]
    if len(value) > cut:
        parts.append(value[cut:])
    return parts or [""]


def _id_parts(ids: tuple[int, ...]) -> list[str]:
    cut = CHUNK_IDS * MAX_CHUNK_KEYS
    chunks = [ids[i : i + CHUNK_IDS] for i in range(0, min(len(ids), cut), CHUNK_IDS)]
    if len(ids) > cut:
        chunks.append(ids[cut:])
    return [",".join(map(str, c)) for c in chunks] or [""]


def _start(call: Call) -> bytes:
    return _chain(b"", b"C" if call.chat else b"R", call.cache_salt)


def user_pieces(call: Call) -> list[Piece]:
    """The call's template pieces as the model will read them, before any chat
    markup (:func:`parrot.protocol.template.prompt_pieces`: with ``chat=True``,
    whitespace at the edges of the user's turn is dropped and the output is
    the last piece)."""
    return prompt_pieces(call.template, call.chat)


def prefix_keys(call: Call) -> list[str]:
    """Keys of the call's prompt at each boundary between two pieces before its
    first output, as far as its inputs are known (stops at the first input
    without a value).  Outermost first.

    Once every input it reads is known the keys are final (templates and
    values never change), so they are computed once and kept on the call."""
    if call.prefix_cache is not None:
        return list(call.prefix_cache)
    keys: list[str] = []
    h = _start(call)
    if call.prompt_ids is not None:  # a token-id prompt: its inner keys, then one after its ids
        inner, h = _chunked(h, b"I", _id_parts(call.prompt_ids))
        call.prefix_cache = (*inner, h.hex())
        return list(call.prefix_cache)
    pieces = user_pieces(call)
    for i, piece in enumerate(pieces):
        if isinstance(piece, Text):
            h = _chain(h, b"T", piece.text)
        elif piece.direction == "output":
            break
        else:
            value = call.inputs[piece.name]
            if isinstance(value, Variable):
                if value.value is None:
                    return keys  # not final: an input is still pending
                value = value.value
            inner, h = _chunked(h, b"V", _text_parts(value))
            keys.extend(inner)
        if i + 1 < len(pieces):
            keys.append(h.hex())
    call.prefix_cache = tuple(keys)
    return keys


def _parts(length: int, chunk: int) -> int:
    """How many pieces :func:`_text_parts` / :func:`_id_parts` cut a value of ``length`` into."""
    if length == 0:
        return 1
    return min(-(-length // chunk), MAX_CHUNK_KEYS) + (length > chunk * MAX_CHUNK_KEYS)


def key_shares(call: Call) -> list[tuple[str, float]]:
    """Every key of :func:`prefix_keys` (the boundaries and the values' inner keys) with
    the share of the prompt before the call's first output that lies before it (0..1],
    outermost first: characters of the template's text and values, or ids of a token-id
    prompt (exact then).  Empty while an input is not known, or for an empty prompt.
    The keys are those kept on the call, so nothing is hashed again."""
    keys = prefix_keys(call)
    offsets: list[int] = []
    if call.prompt_ids is not None:
        total = len(call.prompt_ids)
        inner = _parts(total, CHUNK_IDS) - 1
        offsets = [min(total, (i + 1) * CHUNK_IDS) for i in range(inner)] + [total]
    else:
        pieces = user_pieces(call)
        total = 0
        for i, piece in enumerate(pieces):
            if isinstance(piece, Text):
                total += len(piece.text)
            elif piece.direction == "output":
                break
            else:
                value = call.inputs[piece.name]
                if isinstance(value, Variable):
                    if value.value is None:
                        return []
                    value = value.value
                inner = _parts(len(value), CHUNK_CHARS) - 1
                offsets.extend(total + min(len(value), (j + 1) * CHUNK_CHARS) for j in range(inner))
                total += len(value)
            if i + 1 < len(pieces):
                offsets.append(total)
    if total == 0 or len(offsets) != len(keys):
        return []
    return [(key, at / total) for key, at in zip(keys, offsets, strict=True)]


def leading_text_key(call: Call) -> str | None:
    """The key of the call's leading constant text (its first boundary), when its
    prompt starts with text followed by another piece; None otherwise.  This text
    is the same for every call of the template, whatever its inputs, so it is the
    start the executor counts once per engine unless a longer one is shared
    (:mod:`parrot.manager.dag.shared_start`)."""
    pieces = user_pieces(call)
    if len(pieces) < 2 or not isinstance(pieces[0], Text):
        return None
    return prefix_keys(call)[0]  # a text piece's boundary needs no input value


class PrefixIndex:
    """Per engine, the prefix keys of the calls placed there most recently (at most
    ``keys_per_engine``, least recently placed dropped first)."""

    def __init__(self, keys_per_engine: int = 4096):
        if keys_per_engine < 1:
            raise ValueError("keys_per_engine must be >= 1")
        self.keys_per_engine = keys_per_engine
        self._by_engine: dict[str, OrderedDict[str, None]] = {}
        self._keys_on: dict[str, frozenset[str]] = {}  # engine id -> keys_on(), until it changes
        # engines whose keys changed since the executor last took this set (see take_changed)
        self._changed_engines: set[str] = set()
        self._holders: dict[str, int] = {}  # key -> engines holding it

    def record(self, engine_id: str, keys: Iterable[str]) -> None:
        """A call with these prefix keys was placed on ``engine_id``."""
        held = self._by_engine.setdefault(engine_id, OrderedDict())
        changed = False
        for k in keys:
            if k in held:
                held.move_to_end(k)
            else:
                held[k] = None
                self._holders[k] = self._holders.get(k, 0) + 1
                changed = True
        while len(held) > self.keys_per_engine:
            self._release(held.popitem(last=False)[0])
        if changed:
            self._keys_on.pop(engine_id, None)
            self._changed_engines.add(engine_id)

    def holds(self, key: str, engine_id: str) -> bool:
        return key in self._by_engine.get(engine_id, ())

    def engines_holding(self, key: str) -> list[str]:
        return [eid for eid, held in self._by_engine.items() if key in held]

    def held_anywhere(self, key: str) -> bool:
        """Whether any engine holds ``key`` (one lookup, whatever the number of engines)."""
        return key in self._holders

    def _release(self, key: str) -> None:
        n = self._holders.get(key, 0) - 1
        if n > 0:
            self._holders[key] = n
        else:
            self._holders.pop(key, None)

    def keys_on(self, engine_id: str) -> frozenset[str]:
        """The keys recorded for an engine; the same object until they change."""
        keys = self._keys_on.get(engine_id)
        if keys is None:
            keys = self._keys_on[engine_id] = frozenset(self._by_engine.get(engine_id, ()))
        return keys

    def take_changed(self) -> set[str]:
        """Engines whose keys changed since the last call (and forget them)."""
        changed, self._changed_engines = self._changed_engines, set()
        return changed

    def forget_engine(self, engine_id: str) -> None:
        for key in self._by_engine.pop(engine_id, ()):
            self._release(key)
        self._keys_on.pop(engine_id, None)
        self._changed_engines.add(engine_id)

    def __len__(self) -> int:
        return sum(len(h) for h in self._by_engine.values())

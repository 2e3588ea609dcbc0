"""The plan of the PyTorch decode attention (:mod:`parrot.engine.kernels.attention.torch_impl`):
how a decode batch's segments become *rows*, which rows run how, and the partial slots
they fill.  It depends only on the batch, not on the layer, so a :class:`TorchDecodePlan`
is built once per step and every layer reuses it (:mod:`parrot.engine.paged`).

A row is a run of keys (flat token indices into the cache viewed as
``[num_blocks * block_size, KVH, D]``) and the queries that read all of it: with
``share=True`` one row per segment several sequences read (the segments one sequence
reads alone joined into one row), with ``share=False`` one row per sequence.  A row is
cut into pieces of at most :func:`piece_tokens` keys; the shortest single-query rows
are batched, padded to one width (:class:`Padded`), within :data:`PAD_BUDGET`.

The budgets are read at call time (tests lower them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from parrot.engine.kernels.attention import cpu_kernel
from parrot.engine.kernels.attention.segments import Segment, segment_token_index

__all__ = [
    "KV_BUDGET",
    "PAD_BUDGET",
    "SCORE_BUDGET",
    "Padded",
    "Row",
    "TorchDecodePlan",
    "fits_whole",
    "piece_tokens",
]

# Budgets, in elements, for the gathered K (and V) of one piece and for its score
# matrix.  1 Mi fp32 elements = 4 MiB (256 tokens of 32 x 128 heads): the gathered
# K and V of a piece stay in L3 while its GEMMs / GEMVs read them (the best of the
# powers of two from 2^18 to 2^23 in benchmarks/attention_decode.py).
KV_BUDGET = 1 << 20
SCORE_BUDGET = 1 << 20
# Budget, in elements, for the padded K (and V) of all batched single-query rows
# (rows x padded width x KVH x D); rows beyond it take the piece loop.  4 Mi fp32
# elements = 16 MiB: 32 rows of 680 tokens of SmolLM2's 3 x 64 kv heads.
PAD_BUDGET = 1 << 22


@dataclass(frozen=True)
class Row:
    """A run of keys and the queries that read all of it (see the module docstring)."""

    seqs: Tensor  # LongTensor [m] on the compute device
    m: int
    tok: Tensor  # LongTensor [L] flat token indices on the compute device


def rows_for_segments(segments: Sequence[Segment], block_size: int, device: torch.device) -> list[Row]:
    """One row per segment read by several sequences; the segments only one sequence
    reads (its private tail, and its ancestors' runs that nothing else in the batch
    shares) are joined into one row for that sequence, so a batch without sharing
    takes the direct (no-merge) path."""
    rows = []
    alone: dict[int, list[Tensor]] = {}
    for seg in segments:
        tok = segment_token_index(seg, block_size, device)
        if seg.seqs.numel() == 1:
            alone.setdefault(int(seg.seqs[0]), []).append(tok)
            continue
        seqs = seg.seqs.to(device=device, dtype=torch.int64)
        rows.append(Row(seqs, seqs.numel(), tok))
    for seq, toks in alone.items():
        tok = toks[0] if len(toks) == 1 else torch.cat(toks)
        rows.append(Row(torch.tensor([seq], device=device), 1, tok))
    return rows


def rows_per_sequence(
    segments: Sequence[Segment], batch: int, block_size: int, device: torch.device
) -> list[Row]:
    """One single-query row per sequence of the batch, its segments' keys concatenated
    (``share=False``); ValueError when a sequence is in no segment."""
    parts: list[list[Tensor]] = [[] for _ in range(batch)]
    for seg in segments:
        tok = segment_token_index(seg, block_size, device)
        for s in seg.seqs.tolist():
            parts[s].append(tok)
    rows = []
    for b, toks in enumerate(parts):
        if not toks:
            raise ValueError(f"sequence {b} is not listed by any segment")
        tok = toks[0] if len(toks) == 1 else torch.cat(toks)
        rows.append(Row(torch.tensor([b], device=device), 1, tok))
    return rows


def piece_tokens(kv_heads: int, dim: int, big_m: int) -> int:
    """Keys per piece of a row: gathered K (and V) and the [KVH, M, T] scores within budget."""
    return max(1, min(KV_BUDGET // (kv_heads * dim), SCORE_BUDGET // (kv_heads * big_m)))


def row_slots(row: Row, kv_heads: int, dim: int, group: int) -> int:
    """Partial slots a row fills: one per piece for single-query rows, m for multi-query rows."""
    if row.m == 1:
        return -(-row.tok.numel() // piece_tokens(kv_heads, dim, group))
    return row.m


def fits_whole(row: Row, kv_heads: int, dim: int) -> bool:
    """Whether a row's gathered K (and V) stays within :data:`PAD_BUDGET` (so it may be
    gathered whole rather than piece by piece)."""
    return row.tok.numel() * kv_heads * dim <= PAD_BUDGET


@dataclass
class Padded:
    """Single-query rows batched: row r reads ``tok.view(rows, width)[r, :lengths[r]]``.

    Padding repeats the row's own first token (a real key of that row, so padding
    never reads another sequence's or an unwritten cache row) and ``pad`` masks it.
    """

    seqs: Tensor  # LongTensor [rows]
    tok: Tensor  # LongTensor [rows * width]
    pad: Tensor | None  # bool [rows, 1, 1, width], True at padding; None if no row is padded
    lengths: Tensor  # LongTensor [rows]: keys of each row
    rows: int
    width: int
    _additive: dict[torch.dtype, Tensor] = field(default_factory=dict)

    def additive(self, dtype: torch.dtype) -> Tensor:
        """``pad`` as an additive mask (0 / -inf) of ``dtype``, built once per dtype."""
        got = self._additive.get(dtype)
        if got is None:
            assert self.pad is not None
            got = torch.zeros(self.pad.shape, dtype=dtype, device=self.pad.device).masked_fill_(
                self.pad, -torch.inf
            )
            self._additive[dtype] = got
        return got


def pad_rows(rows: list[Row], device: torch.device) -> Padded:
    width = max(r.tok.numel() for r in rows)
    tok = torch.empty(len(rows), width, dtype=torch.int64, device=device)
    lengths = []
    for i, r in enumerate(rows):
        n = r.tok.numel()
        tok[i, :n] = r.tok
        tok[i, n:] = r.tok[0]
        lengths.append(n)
    pad = None
    lens = torch.tensor(lengths, device=device)
    if min(lengths) < width:
        pad = (torch.arange(width, device=device) >= lens.unsqueeze(1)).view(len(rows), 1, 1, width)
    seqs = torch.cat([r.seqs for r in rows])
    return Padded(seqs, tok.view(-1), pad, lens, len(rows), width)


def split_singles(singles: list[Row], kv_heads: int, dim: int) -> tuple[list[Row], list[Row]]:
    """(batched, looped): the shortest rows whose padded K fits PAD_BUDGET are batched."""
    order = sorted(singles, key=lambda r: r.tok.numel())
    fit = 0
    for i, r in enumerate(order):
        if (i + 1) * r.tok.numel() * kv_heads * dim > PAD_BUDGET:
            break
        fit = i + 1
    return order[:fit], order[fit:]


class TorchDecodePlan:
    """The layer-independent part of one decode batch's attention (built once per step).

    ``kernel``: single-query rows run in the C kernel (:mod:`cpu_kernel`), which
    reads the cache in place, so all of them are batched whatever their length;
    ``shared_kernel``: with ``kernel``, shared rows run in the C shared kernel
    where it is built for the head dim.

    Invariants: every partial slot has an owner; slots are filled in the order
    batched rows, looped single rows (one slot per piece), shared rows (one slot per
    query); with ``kernel`` nothing is looped; ``direct`` is True exactly when each
    sequence has one slot and slot i belongs to sequence i, so outputs need no merge;
    ``lse_merge`` (starts [B + 1], slots [S]: each sequence's slots, CSR) is set when
    every partial comes from a C kernel (normalised, with its log-sum-exp) and a merge
    is needed, which then runs in :func:`cpu_kernel.merge_lse`.
    """

    def __init__(
        self,
        segments: Sequence[Segment],
        *,
        batch: int,
        block_size: int,
        kv_heads: int,
        dim: int,
        group: int,
        share: bool,
        device: torch.device,
        kernel: bool = False,
    ):
        self.segments = segments
        self.batch = batch
        self.share = share
        self.kernel = kernel
        self.shape = (kv_heads, dim, group)
        if share:
            rows = rows_for_segments(segments, block_size, device)
        else:
            rows = rows_per_sequence(segments, batch, block_size, device)
        singles = [r for r in rows if r.m == 1]
        self.shared = [r for r in rows if r.m > 1]
        self.shared_kernel = kernel and bool(self.shared) and cpu_kernel.shared_built(dim)
        batched, self.looped = (singles, []) if kernel else split_singles(singles, kv_heads, dim)
        batched.sort(key=lambda r: int(r.seqs[0]))  # in batch order: the common case needs no merge
        self.padded = pad_rows(batched, device) if batched else None
        owners = [] if self.padded is None else [self.padded.seqs]
        for r in self.looped:
            owners.append(r.seqs.expand(row_slots(r, kv_heads, dim, group)))
        owners.extend(r.seqs for r in self.shared)
        self.owner = torch.cat(owners) if owners else torch.empty(0, dtype=torch.int64, device=device)
        self.slots = self.owner.numel()
        self.direct = (
            not self.looped
            and not self.shared
            and self.padded is not None
            and self.padded.rows == batch
            and bool((self.padded.seqs == torch.arange(batch, device=device)).all())
        )
        # With the C kernels every partial is normalised with its log-sum-exp: they
        # merge in one C pass, sequence by sequence (each one's slots, in slot order).
        self.lse_merge: tuple[Tensor, Tensor] | None = None
        if kernel and not self.direct and (self.shared_kernel or not self.shared):
            starts = torch.zeros(batch + 1, dtype=torch.int64, device=device)
            starts[1:] = torch.bincount(self.owner, minlength=batch).cumsum(0)
            self.lse_merge = (starts, torch.argsort(self.owner, stable=True))

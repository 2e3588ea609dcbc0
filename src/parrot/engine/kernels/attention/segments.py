"""Segments: runs of cached tokens in a paged KV cache, each read by a set of queries.

A decode batch over a prefix tree is described by a flat list of segments.  A
shared prefix is one segment listing every sequence under it; a sequence's
private suffix is a segment listing only that sequence.  Nested prefixes are
simply more segments (the root segment lists all sequences of the tree, the
next level a subset, ...).  Every key a sequence attends to lies in exactly one
of the segments that list it; the segments of one sequence, taken together,
are its whole context (order does not matter for decode attention).

Cache layout: ``k_cache, v_cache: [num_blocks, block_size, KVH, D]``; token
``i`` of a segment lives at block ``block_ids[(start + i) // block_size]``,
row ``(start + i) % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Segment", "segment_token_index", "validate_segments"]


@dataclass(frozen=True, eq=False)
class Segment:
    """A run of consecutive cached tokens read by a set of queries.

    block_ids: LongTensor [nb] — physical blocks holding the run, in order;
    start: offset of the run's first token inside block_ids[0] (0 <= start < block_size);
    length: number of tokens (>= 1); the run covers block_ids[0][start:] ... and ends inside
        block_ids[-1]; nb == ceil((start + length) / block_size) exactly;
    seqs: LongTensor [m] — indices (into the batch) of the queries that attend to this run
        (sorted, unique, m >= 1).

    Construction does not check anything (it is on the hot path); call
    :func:`validate_segments` to check a whole batch.  Equality and hashing are by
    identity (``eq=False``): field-wise ``==`` on tensors would be ambiguous.
    """

    block_ids: Tensor
    start: int
    length: int
    seqs: Tensor


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_index_tensor(t: object) -> bool:
    return (
        isinstance(t, Tensor)
        and t.dim() == 1
        and not t.is_floating_point()
        and not t.is_complex()
        and t.dtype != torch.bool
    )


def validate_segments(segments: Sequence[Segment], batch_size: int, num_blocks: int, block_size: int) -> None:
    """Raise ValueError unless ``segments`` describe a well-formed decode batch (one
    check after another, each with its own message).

    Checks every structural invariant of :class:`Segment` (types, ``0 <= start <
    block_size``, ``length >= 1``, ``nb == ceil((start + length) / block_size)``,
    block ids in ``[0, num_blocks)``, ``seqs`` non-empty, strictly increasing and
    in ``[0, batch_size)``) and that every sequence of the batch is listed by at
    least one segment.  It cannot check that a sequence's segments are disjoint
    runs of *its* context — that is the caller's semantic contract.

    Cost: Python work per segment plus one concatenation and a handful of
    reductions over all block ids and all seq ids (one host transfer each on
    CUDA), independent of the number of tokens.
    """
    _check_sizes(batch_size, num_blocks, block_size)
    if not isinstance(segments, Sequence):
        raise ValueError(f"segments must be a sequence of Segment, got {type(segments).__name__}")
    if not segments:
        if batch_size:
            raise ValueError(f"no segments for a batch of {batch_size} sequences")
        return
    for i, seg in enumerate(segments):
        _check_segment(i, seg, block_size)
    _check_block_ids(segments, num_blocks)
    _check_seqs(segments, batch_size)


def _check_sizes(batch_size: int, num_blocks: int, block_size: int) -> None:
    """The batch's sizes are ints, ``batch_size >= 0``, ``num_blocks >= 1``, ``block_size >= 1``."""
    for name, val in (("batch_size", batch_size), ("num_blocks", num_blocks), ("block_size", block_size)):
        if not _is_int(val):
            raise ValueError(f"{name} must be an int, got {type(val).__name__}")
    if batch_size < 0 or num_blocks < 1 or block_size < 1:
        raise ValueError(
            f"need batch_size >= 0, num_blocks >= 1, block_size >= 1; "
            f"got {batch_size}, {num_blocks}, {block_size}"
        )


def _check_segment(i: int, seg: object, block_size: int) -> None:
    """Segment ``i`` on its own: a :class:`Segment` of int start and length, ``0 <= start <
    block_size``, ``length >= 1``, 1-D integer index tensors, exactly the blocks its run
    spans and at least one query."""
    if not isinstance(seg, Segment):
        raise ValueError(f"segment {i}: expected Segment, got {type(seg).__name__}")
    if not _is_int(seg.start) or not _is_int(seg.length):
        raise ValueError(f"segment {i}: start and length must be ints")
    if not 0 <= seg.start < block_size:
        raise ValueError(f"segment {i}: start={seg.start} outside [0, block_size={block_size})")
    if seg.length < 1:
        raise ValueError(f"segment {i}: length={seg.length} must be >= 1")
    if not _is_index_tensor(seg.block_ids):
        raise ValueError(f"segment {i}: block_ids must be a 1-D integer tensor")
    if not _is_index_tensor(seg.seqs):
        raise ValueError(f"segment {i}: seqs must be a 1-D integer tensor")
    nb = -(-(seg.start + seg.length) // block_size)
    if seg.block_ids.numel() != nb:
        raise ValueError(
            f"segment {i}: start={seg.start}, length={seg.length}, block_size={block_size} "
            f"needs exactly {nb} blocks, got {seg.block_ids.numel()}"
        )
    if seg.seqs.numel() == 0:
        raise ValueError(f"segment {i}: seqs is empty (a segment must be read by >= 1 query)")


def _check_block_ids(segments: Sequence[Segment], num_blocks: int) -> None:
    """Every block id of every segment is in ``[0, num_blocks)`` (one concatenation)."""
    blocks = torch.cat([s.block_ids.detach().to("cpu", torch.int64) for s in segments])
    lo, hi = int(blocks.min()), int(blocks.max())
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise ValueError(f"block id {bad} outside [0, num_blocks={num_blocks})")


def _check_seqs(segments: Sequence[Segment], batch_size: int) -> None:
    """Every segment's seqs are in ``[0, batch_size)``, strictly increasing, and together
    they list every sequence of the batch."""
    seqs = torch.cat([s.seqs.detach().to("cpu", torch.int64) for s in segments])
    lo, hi = int(seqs.min()), int(seqs.max())
    if lo < 0 or hi >= batch_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"seq index {bad} outside [0, batch_size={batch_size})")
    # Strictly increasing inside each segment: every adjacent difference that is
    # not across a segment boundary must be positive.
    diffs = seqs[1:] - seqs[:-1]
    inside = torch.ones_like(diffs, dtype=torch.bool)
    ends = torch.tensor([s.seqs.numel() for s in segments]).cumsum(0)[:-1] - 1
    inside[ends] = False
    if bool((diffs[inside] <= 0).any()):
        bad = int(torch.nonzero(inside & (diffs <= 0))[0, 0])
        seg_i = int(torch.searchsorted(ends, bad, right=False))
        raise ValueError(f"segment {seg_i}: seqs must be sorted and unique")
    covered = torch.bincount(seqs, minlength=batch_size) > 0
    if not bool(covered.all()):
        missing = int(torch.nonzero(~covered)[0, 0])
        raise ValueError(f"sequence {missing} is not listed by any segment")


def segment_token_index(seg: Segment, block_size: int, device: torch.device | None = None) -> Tensor:
    """Flat row indices of the segment's tokens in a cache viewed as ``[num_blocks * block_size, ...]``.

    Returns LongTensor [length]: ``block_ids[(start + i) // bs] * bs + (start + i) % bs``.
    """
    device = seg.block_ids.device if device is None else device
    pos = torch.arange(seg.start, seg.start + seg.length, device=device)
    blocks = seg.block_ids.to(device=device, dtype=torch.int64)
    return blocks[pos // block_size] * block_size + pos % block_size

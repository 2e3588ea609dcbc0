"""Triton split-segment decode attention for CUDA (and the CPU interpreter, TRITON_INTERPRET=1).

Triton is optional: nothing here imports it at module import time.  The kernels
are built on first call; without triton installed the call raises
:class:`TritonUnavailableError` (an ImportError).

Plan (built on the host from the segments, O(#segments + #pieces) Python work):

* every segment is cut into *pieces* of at most ``piece_tokens`` keys (split-K,
  for parallelism on long shared prefixes); piece p reads blocks
  ``block_table[bt_off[p]:]`` from row ``start[p]`` for ``length[p]`` tokens, and
  is read by the ``m[p]`` queries ``seqs_cat[q_off[p]:q_off[p] + m[p]]``;
* a piece's GEMM M dimension is its m queries × the G query heads of one kv
  head (row r = query r // G, head kvh * G + r % G), tiled by BLOCK_M into
  *work items*; grid = (work items, KVH).  Each program loads every K/V tile of
  its piece once and computes scores for all its rows with ``tl.dot``;
* member j of piece p writes its partial (out, lse) to slot ``slot0[p] + j`` of
  ``part_out [S, H, D]`` / ``part_lse [S, H]`` (fp32);
* the merge kernel, one program per (sequence, head), walks that sequence's
  slots (CSR ``seq_ptr``/``seq_slots``) with an online log-sum-exp.

Numerics: masked keys get score -inf; the running max starts at -inf and is
finite after the first tile (every piece has >= 1 key in its first tile), so
``exp`` only ever sees arguments <= 0 or ``-inf - finite``.  Masked K/V loads
return 0 and never touch memory outside the segment; padded query rows load 0
and are never stored.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from parrot.engine.kernels.attention.segments import Segment

__all__ = [
    "TritonDecodePlan",
    "TritonUnavailableError",
    "interpret_requested",
    "plan_triton_decode",
    "triton_paged_decode_attention",
]

DEFAULT_PIECE_TOKENS = 512
BLOCK_N = 32
# Full fp32 products for fp32 inputs (tf32 would miss the 1e-5 accuracy target);
# irrelevant for fp16/bf16 inputs.
DOT_PRECISION = "ieee"


class TritonUnavailableError(ImportError):
    """Raised when the triton backend is requested but triton cannot be imported."""


# Kernels per interpreter mode: triton decides compiled vs interpreted when a
# function is decorated, so kernels built under TRITON_INTERPRET=1 must not be
# reused without it (and vice versa).
_KERNELS: dict[bool, dict[str, Any]] = {}


def interpret_requested() -> bool:
    """True when TRITON_INTERPRET asks for triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def _kernels() -> dict[str, Any]:
    """The kernels for the current interpreter mode, loaded the first time one is used
    (:func:`_load_kernels`), so that triton is never imported with the package."""
    mode = interpret_requested()
    if mode not in _KERNELS:
        _KERNELS[mode] = _load_kernels(mode)
    return _KERNELS[mode]


def _load_kernels(mode: bool) -> dict[str, Any]:
    """The kernels of :mod:`~parrot.engine.kernels.attention.triton_jit`, that file executed
    as a module of its own for interpreter mode ``mode`` (so that each mode's kernels and
    their helpers are decorated under it); :class:`TritonUnavailableError` without triton."""
    try:
        import triton.language  # noqa: F401  (imports triton itself too)
    except ImportError as exc:
        raise TritonUnavailableError(
            "backend='triton' needs the 'triton' package (pip install triton); "
            "use backend='torch' or 'auto' without it"
        ) from exc
    name = f"{__package__}._triton_jit_{'interpreted' if mode else 'compiled'}"
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("triton_jit.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # where inspect (triton reads the kernels' source) finds it
    spec.loader.exec_module(module)
    return {"partials": module.segment_partials, "merge": module.merge}


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclass
class _Plan:
    """Host-side int tables for both kernels (see the module docstring)."""

    block_table: list[int] = field(default_factory=list)
    seqs_cat: list[int] = field(default_factory=list)
    bt_off: list[int] = field(default_factory=list)  # per piece ...
    start: list[int] = field(default_factory=list)
    length: list[int] = field(default_factory=list)
    q_off: list[int] = field(default_factory=list)
    m: list[int] = field(default_factory=list)
    slot0: list[int] = field(default_factory=list)
    w_piece: list[int] = field(default_factory=list)  # per work item ...
    w_row0: list[int] = field(default_factory=list)
    seq_ptr: list[int] = field(default_factory=list)  # per sequence: CSR over its slots
    seq_slots: list[int] = field(default_factory=list)
    block_m: int = 16

    def tables(self) -> list[list[int]]:
        return [
            self.block_table, self.seqs_cat, self.bt_off, self.start, self.length, self.q_off,
            self.m, self.slot0, self.w_piece, self.w_row0, self.seq_ptr, self.seq_slots,
        ]  # fmt: skip


def _plan(
    segments: Sequence[Segment], batch: int, block_size: int, group: int, share: bool, piece_tokens: int
) -> _Plan:
    if not share:  # baseline: every (segment, sequence) pair read separately
        segments = [
            Segment(s.block_ids, s.start, s.length, s.seqs[i : i + 1])
            for s in segments
            for i in range(s.seqs.numel())
        ]
    plan = _Plan()
    owner: list[int] = []
    for seg in segments:
        bt0, q0 = len(plan.block_table), len(plan.seqs_cat)
        plan.block_table.extend(seg.block_ids.tolist())
        seqs = seg.seqs.tolist()
        plan.seqs_cat.extend(seqs)
        for a in range(0, seg.length, piece_tokens):
            pos0 = seg.start + a
            plan.bt_off.append(bt0 + pos0 // block_size)
            plan.start.append(pos0 % block_size)
            plan.length.append(min(piece_tokens, seg.length - a))
            plan.q_off.append(q0)
            plan.m.append(len(seqs))
            plan.slot0.append(len(owner))
            owner.extend(seqs)
    plan.block_m = min(64, max(16, _next_pow2(max(m * group for m in plan.m))))
    for p, m in enumerate(plan.m):
        for r0 in range(0, m * group, plan.block_m):
            plan.w_piece.append(p)
            plan.w_row0.append(r0)
    by_seq: list[list[int]] = [[] for _ in range(batch)]
    for slot, b in enumerate(owner):
        by_seq[b].append(slot)
    plan.seq_ptr.append(0)
    for slots in by_seq:
        plan.seq_slots.extend(slots)
        plan.seq_ptr.append(len(plan.seq_slots))
    return plan


def _upload(tables: list[list[int]], device: torch.device) -> list[Tensor]:
    """All int tables in one host-to-device copy; returns a view per table."""
    flat = torch.tensor([x for t in tables for x in t], dtype=torch.int32).to(device)
    return list(flat.split([len(t) for t in tables]))


@dataclass(frozen=True, eq=False)
class TritonDecodePlan:
    """One decode batch's tables, planned on the host and uploaded to ``device`` once,
    for every layer of a step (the layers differ only in their caches and queries).
    Valid for queries of ``batch`` sequences with ``group`` query heads per kv head over
    caches of ``block_size``-token blocks, while its segments are."""

    batch: int
    block_size: int
    group: int
    share: bool
    plan: _Plan = field(repr=False)
    tables: list[Tensor] = field(repr=False)


def plan_triton_decode(
    segments: Sequence[Segment],
    *,
    batch: int,
    block_size: int,
    group: int,
    share: bool,
    device: torch.device | str,
    piece_tokens: int = DEFAULT_PIECE_TOKENS,
) -> TritonDecodePlan:
    """Plan and upload ``segments`` (on the host: keep their tensors on the CPU) once."""
    if piece_tokens < 1:
        raise ValueError(f"piece_tokens must be >= 1, got {piece_tokens}")
    plan = _plan(segments, batch, block_size, group, share, piece_tokens)
    return TritonDecodePlan(
        batch, block_size, group, share, plan, _upload(plan.tables(), torch.device(device))
    )


def _plan_for(
    segments: Sequence[Segment] | TritonDecodePlan,
    q: Tensor,
    block_size: int,
    kv_heads: int,
    *,
    share: bool,
    piece_tokens: int,
) -> TritonDecodePlan:
    """``segments`` planned for this call's shapes, or the given plan once checked to
    fit them (batch, block size, GQA group, q's device)."""
    batch, heads, _ = q.shape
    group = heads // kv_heads
    if not isinstance(segments, TritonDecodePlan):
        return plan_triton_decode(
            segments,
            batch=batch,
            block_size=block_size,
            group=group,
            share=share,
            device=q.device,
            piece_tokens=piece_tokens,
        )
    made = segments
    if (made.batch, made.block_size, made.group) != (batch, block_size, group):
        raise ValueError(
            f"the Triton decode plan is for batch {made.batch}, block size {made.block_size}, "
            f"group {made.group}; got {batch}, {block_size}, {group}"
        )
    if made.tables and made.tables[0].device != q.device:
        raise ValueError(f"the Triton decode plan is on {made.tables[0].device}, q on {q.device}")
    return made


def triton_paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    segments: Sequence[Segment] | TritonDecodePlan,
    *,
    scale: float,
    share: bool,
    piece_tokens: int = DEFAULT_PIECE_TOKENS,
) -> Tensor:
    """Triton backend of :func:`parrot.engine.kernels.attention.paged_decode_attention`
    (inputs already checked).

    q: [B, H, D]; k_cache, v_cache: [NB, BS, KVH, D] (any strides).  Returns [B, H, D] in q's dtype.
    Segment tensors are read on the host (keep them on the CPU to avoid device syncs);
    a :func:`plan_triton_decode` plan (its ``share`` and pieces win) skips that work.
    """
    if q.dtype == torch.float64:
        raise ValueError("the triton backend supports float32/float16/bfloat16, not float64")
    kern = _kernels()
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    made = _plan_for(segments, q, block_size, kv_heads, share=share, piece_tokens=piece_tokens)
    plan = made.plan
    (block_table, seqs_cat, bt_off, start, length, q_off, m, slot0, w_piece, w_row0, seq_ptr, seq_slots) = (
        made.tables
    )
    slots = len(plan.seq_slots)
    part_out = torch.empty(slots, heads, dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(slots, heads, dtype=torch.float32, device=q.device)
    block_d = max(16, _next_pow2(dim))

    kern["partials"][(len(plan.w_piece), kv_heads)](
        q, *q.stride(),
        k_cache, *k_cache.stride(),
        v_cache, *v_cache.stride(),
        block_table, seqs_cat,
        bt_off, start, length, q_off, m, slot0,
        w_piece, w_row0,
        part_out, part_lse,
        scale, heads, dim,
        GROUP=heads // kv_heads, BS=block_size,
        BLOCK_M=plan.block_m, BLOCK_N=BLOCK_N, BLOCK_D=block_d, PRECISION=DOT_PRECISION,
    )  # fmt: skip
    out = torch.empty_like(q)
    kern["merge"][(batch, heads)](
        part_out, part_lse, seq_ptr, seq_slots,
        out, *out.stride(),
        heads, dim,
        BLOCK_D=block_d,
    )  # fmt: skip
    return out

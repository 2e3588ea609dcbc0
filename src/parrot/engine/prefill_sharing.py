"""Prefill chunks under a shared cached prefix: the prefix is attended once for all of them.

When several sequences forked from one context are prefilled in the same step
(32 questions under one system prompt, say), every chunk's queries read the same
prefix keys.  Chunk by chunk, that prefix would be gathered and read once per
chunk.  Instead the step's chunks are grouped by the physical blocks their pasts
share (the prefix tree of :func:`~parrot.engine.core.prefix_tree.decode_runs`, built
on the chunks' block tables), and per layer:

* each shared run is attended once by the query rows of all the chunks under it,
  unmasked (the whole run precedes each of those queries): one call of the C
  shared-prefix kernel (:func:`~parrot.engine.kernels.attention.cpu_kernel.shared_row`,
  reading the cache in place), or of PyTorch's fused kernel over the run's keys
  gathered once where the C kernel is not built;
* each chunk's other keys (the unshared rest of its past, then its own tokens,
  causally) as before (:func:`~parrot.engine.prefill_attention.prefill_partial`);
* the partials are merged exactly by log-sum-exp
  (:func:`~parrot.engine.kernels.attention.merge.merge_partials` with ``den = 1``).

Invariant: a shared run lies before the start of every chunk under it.  Shared
runs are whole blocks present in two or more block tables, while a chunk writes
only blocks it alone holds (reservation makes them writable, copying on write),
so none of a chunk's own tokens is in a shared block.  :func:`plan_shared_prefill`
checks this anyway and declines to share (the per-chunk path is always exact).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from parrot.engine.core.prefix_tree import decode_runs
from parrot.engine.kernels.attention import cpu_kernel
from parrot.engine.kernels.attention.merge import merge_partials
from parrot.engine.kernels.attention.torch_impl import cpu_flash_attention
from parrot.engine.prefill_attention import fused_prefill_available, prefill_partial

__all__ = ["SharedPrefill", "plan_shared_prefill"]


@dataclass(frozen=True)
class _SharedRun:
    rows: Tensor  # int64 [M]: the query rows (among the chunks' rows) that read the run
    tok: Tensor  # int64 [L]: the run's keys as flat cache rows
    chunks: int  # how many chunks lie under the run


@dataclass(frozen=True)
class _Private:
    rows: slice  # the chunk's query rows (among the chunks' rows)
    blocks: Tensor  # int64: blocks holding the chunk's positions [first, total)
    first: int  # first position not covered by a shared run (a block boundary)
    total: int  # the sequence's length after the chunk
    start: int  # position of the chunk's first token


class SharedPrefill:
    """The layer-independent plan of one step's prefill chunks (built once per step).

    Query rows are numbered over the chunks' tokens in step order (chunk 0's rows
    first).  Every row has one private partial, plus one per shared run above its
    chunk; ``owner`` lists the row of every partial in the order :meth:`attend`
    produces them (all private rows, then the runs in plan order)."""

    def __init__(self, privates: list[_Private], runs: list[_SharedRun], rows: int, device: torch.device):
        self.privates = privates
        self.runs = runs
        self.rows = rows
        self.owner = torch.cat([torch.arange(rows, device=device)] + [r.rows for r in runs])
        self._kernel: bool | None = None  # whether runs go to the C kernel; decided by the first layer

    @property
    def shared_rows(self) -> int:
        """Query rows that read some shared run (each once per run above them)."""
        return sum(r.rows.numel() for r in self.runs)

    @property
    def rows_per_shared_key(self) -> float:
        """The mean number of query rows one chunk brings to a shared key: the shared
        (row, key) pairs over the (chunk, key) pairs the runs cover.  What the shared
        plan saves against attending chunk by chunk grows with the second (each chunk
        would read the key again), what it costs with the first (where the per-chunk
        kernel is faster per pair than the shared-row kernel, as on AMX)."""
        pairs = sum(r.rows.numel() * r.tok.numel() for r in self.runs)
        covered = self._covered_pairs
        return pairs / covered if covered else 0.0

    @property
    def shared_keys_per_row(self) -> float:
        """The shared keys the chunks read per query row they bring: the (chunk, shared key)
        pairs the runs cover over the chunks' rows, i.e. the shared prefix's length against
        the chunks' (0.16 for 200-token chunks under a 32-token prefix, 100 for 20-token
        questions under a 2,000-token one).  What the shared plan saves against attending
        chunk by chunk (reading the prefix once per chunk) grows with it."""
        return self._covered_pairs / self.rows if self.rows else 0.0

    @property
    def _covered_pairs(self) -> int:
        """The (chunk, shared key) pairs the runs cover."""
        return sum(r.chunks * r.tok.numel() for r in self.runs)

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        """q: [rows, H, D], the chunks' queries; k_cache, v_cache: [NB, BS, KVH, D] with
        every chunk's keys written.  Returns [rows, H, D] in q's dtype: causal
        attention of every chunk over its sequence, scale 1/sqrt(D)."""
        num_blocks, block_size, kv_heads, dim = k_cache.shape
        kf = k_cache.view(num_blocks * block_size, kv_heads, dim)
        vf = v_cache.view(num_blocks * block_size, kv_heads, dim)
        # A bf16 cache: the flash calls run in bf16 (as unshared prefill does); the C
        # kernel reads bf16 rows with fp32 queries; partials merge in fp32.
        adt = torch.bfloat16 if k_cache.dtype == torch.bfloat16 else q.dtype
        qa = q.to(adt)
        outs: list[Tensor] = []
        lses: list[Tensor] = []
        for p in self.privates:
            n = p.total - p.first
            kk = k_cache.index_select(0, p.blocks).view(-1, kv_heads, dim)[:n].to(adt)
            vv = v_cache.index_select(0, p.blocks).view(-1, kv_heads, dim)[:n].to(adt)
            out, lse = prefill_partial(qa[p.rows], kk, vv, p.start - p.first)
            outs.append(out)
            lses.append(lse)
        if self._kernel is None:
            self._kernel = (
                cpu_kernel.supports(torch.float32, k_cache)
                and v_cache.is_contiguous()
                and cpu_kernel.shared_built(dim)
            )
        qs = (q.float() * (1.0 / math.sqrt(dim))).contiguous() if self._kernel else None
        for run in self.runs:
            if qs is not None:
                m = run.rows.numel()
                out = torch.empty(m, q.shape[1], dim)
                lse = torch.empty(m, q.shape[1])
                cpu_kernel.shared_row(qs, run.rows, kf, vf, run.tok, out, lse)
            else:
                out, lse = _flash_run(qa, kf, vf, run)
            outs.append(out)
            lses.append(lse)
        part_out = torch.cat(outs)
        part_lse = torch.cat(lses)
        merged = merge_partials(part_out, part_lse, torch.ones_like(part_lse), self.owner, self.rows)
        return merged.to(q.dtype)


def _flash_run(q: Tensor, kf: Tensor, vf: Tensor, run: _SharedRun) -> tuple[Tensor, Tensor]:
    """One shared run through PyTorch's fused kernel: its keys gathered once, the M
    query rows x G heads of each kv head as one unmasked query block.  (out [M, H, D],
    lse [M, H]), fp32."""
    _, heads, dim = q.shape
    kv_heads = kf.shape[1]
    group = heads // kv_heads
    m = run.rows.numel()
    qg = q.index_select(0, run.rows).view(m, kv_heads, group, dim).permute(1, 2, 0, 3)
    qg = qg.reshape(1, kv_heads, group * m, dim)  # row g * m + i of kv head j: query i, head j * G + g
    k = kf.index_select(0, run.tok).to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
    v = vf.index_select(0, run.tok).to(q.dtype).transpose(0, 1).unsqueeze(0)
    out, lse = cpu_flash_attention()(qg, k, v, 0.0, False, scale=1.0 / math.sqrt(dim))
    out = out.view(kv_heads, group, m, dim).permute(2, 0, 1, 3).reshape(m, heads, dim).float()
    lse = lse.view(kv_heads, group, m).permute(2, 0, 1).reshape(m, heads).float()
    return out, lse


def plan_shared_prefill(
    tables: Sequence[Sequence[int]],
    starts: Sequence[int],
    totals: Sequence[int],
    block_size: int,
    q_probe: Tensor,
) -> SharedPrefill | None:
    """The plan for chunks ``i`` writing positions ``[starts[i], totals[i])`` of the
    sequence whose block table is ``tables[i]``, or None when no two chunks share a
    block of their pasts, when the fused CPU kernel is unavailable for queries like
    ``q_probe`` (the plan's partials need it), or when a shared run would reach into
    a chunk's own tokens (see the module docstring; never for the runner's tables)."""
    if len(tables) < 2 or not fused_prefill_available(q_probe):
        return None
    runs = decode_runs(tables, totals, block_size, share=True)
    shared = [r for r in runs if len(r.seqs) > 1]
    if not shared:
        return None
    covered = [0] * len(tables)
    for r in shared:
        for i in r.seqs:
            covered[i] += r.length
    if any(c > s for c, s in zip(covered, starts, strict=True)):
        return None
    device = q_probe.device
    offsets = [0]
    for s, t in zip(starts, totals, strict=True):
        offsets.append(offsets[-1] + t - s)
    privates = [
        _Private(
            slice(offsets[i], offsets[i + 1]),
            torch.tensor(
                list(tables[i][covered[i] // block_size : -(-totals[i] // block_size)]),
                dtype=torch.long,
                device=device,
            ),
            covered[i],
            totals[i],
            starts[i],
        )
        for i in range(len(tables))
    ]
    lane = torch.arange(block_size, device=device)
    plan_runs = [
        _SharedRun(
            torch.cat([torch.arange(offsets[i], offsets[i + 1], device=device) for i in r.seqs]),
            (torch.tensor(r.blocks, dtype=torch.long, device=device)[:, None] * block_size + lane).view(-1),
            len(r.seqs),
        )
        for r in shared
    ]
    return SharedPrefill(privates, plan_runs, offsets[-1], device)

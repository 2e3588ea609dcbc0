"""Attention of the prefill chunks that begin a sequence, batched into padded flash calls.

A chunk that starts at position 0 has no past: its queries read only its own
keys, causally, and those keys are the step's own new rows.  A step that admits
many new prompts (32 questions of an application's map stage, say) would
otherwise make one fused-attention call per chunk and per layer, each reading
its keys back from the paged cache.  Here the step's fresh chunks are grouped
by length (:func:`plan_fresh_chunks`, once per step) and each group runs as one
call of PyTorch's fused CPU flash kernel over a ``[B, H, n_max, D]`` batch:

* a chunk shorter than its group's longest is padded at the end with copies of
  its own last row.  Causality makes that exact: a real query ``i`` reads keys
  ``0..i``, all real, and the padded queries' outputs are dropped;
* the keys and values are the step's new rows rounded to the cache's dtype
  (the same values the per-chunk path reads back from the cache), so the
  result equals :func:`~parrot.engine.prefill_attention.prefill_attention` of
  each chunk up to the kernel's fp32 summation order.

The gather and scatter indices depend only on the step's slices, not on the
layer, so every layer reuses them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from parrot.engine.kernels.attention.torch_impl import cpu_flash_attention

__all__ = ["FreshGroup", "fresh_batching_available", "plan_fresh_chunks"]

# A group's shortest chunk is at least this share of its longest: the padded
# batch computes at most 1 / MIN_FILL times the real work of its chunks.
MIN_FILL = 0.8


@dataclass(frozen=True)
class FreshGroup:
    """One padded batch: ``gather`` [B * n_max] (the step rows that fill it, in
    chunk-major order, padding repeating each chunk's last row), ``valid`` [R] (the
    positions in that padded order that are real queries), ``dest`` [R] (the step
    rows those real queries' outputs go to)."""

    batch: int
    width: int
    gather: Tensor
    valid: Tensor
    dest: Tensor

    def attend(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> None:
        """q: [T, H, D], k, v: [T, KVH, D] (the step's rows, in the attention dtype);
        writes the group's real rows of ``out`` [T, H, D]."""
        heads, dim = q.shape[1], q.shape[2]
        group = heads // k.shape[1]
        shape = (self.batch, self.width)
        qb = q.index_select(0, self.gather).view(*shape, heads, dim).transpose(1, 2)  # [B, H, n, D]
        kb = k.index_select(0, self.gather).view(*shape, -1, dim).transpose(1, 2)  # [B, KVH, n, D]
        vb = v.index_select(0, self.gather).view(*shape, -1, dim).transpose(1, 2)
        if group > 1:  # the kernel wants a kv head per query head
            kb = kb.repeat_interleave(group, 1)
            vb = vb.repeat_interleave(group, 1)
        flash = cpu_flash_attention()
        assert flash is not None  # fresh_batching_available checked it
        ob, _ = flash(qb, kb, vb, 0.0, True, scale=1.0 / math.sqrt(dim))  # [B, H, n, D]
        rows = ob.transpose(1, 2).reshape(-1, heads, dim).index_select(0, self.valid)  # [R, H, D]
        out.index_copy_(0, self.dest, rows.to(out.dtype))


def fresh_batching_available(q: Tensor) -> bool:
    """Whether the batched path runs for queries like ``q`` (CPU, fp32 or bf16, and
    PyTorch's fused flash kernel present)."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and cpu_flash_attention() is not None
    )


def plan_fresh_chunks(rows: Sequence[slice], device: torch.device | str) -> list[FreshGroup]:
    """Group the fresh chunks whose step rows are ``rows`` (each a slice of length
    >= 2) into padded batches: sorted by length, a chunk joins the current group
    while the group's shortest chunk is at least ``MIN_FILL`` of it."""
    order = sorted(rows, key=lambda r: r.stop - r.start)
    groups: list[list[slice]] = []
    for r in order:
        n = r.stop - r.start
        if groups and (groups[-1][0].stop - groups[-1][0].start) >= MIN_FILL * n:
            groups[-1].append(r)
        else:
            groups.append([r])
    return [_group(members, device) for members in groups]


def _group(members: list[slice], device: torch.device | str) -> FreshGroup:
    width = max(r.stop - r.start for r in members)
    gather: list[int] = []
    valid: list[int] = []
    dest: list[int] = []
    for b, r in enumerate(members):
        n = r.stop - r.start
        real = list(range(r.start, r.stop))
        gather += real + [r.stop - 1] * (width - n)
        valid += range(b * width, b * width + n)
        dest += real
    as_long = {"dtype": torch.long, "device": device}
    return FreshGroup(
        len(members),
        width,
        torch.tensor(gather, **as_long),
        torch.tensor(valid, **as_long),
        torch.tensor(dest, **as_long),
    )

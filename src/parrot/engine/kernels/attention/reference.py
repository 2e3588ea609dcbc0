"""Float64 reference for paged decode attention: one sequence at a time, no tricks.

Used only by tests and benchmarks to check the fast paths; it is deliberately
slow (a Python loop over every token position) and independent of the fast
paths' index helpers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from parrot.engine.kernels.attention.segments import Segment

__all__ = ["reference_decode_attention"]


def reference_decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, segments: Sequence[Segment], *, scale: float | None = None
) -> Tensor:
    """Exact softmax attention of each decode query over its sequence's cached keys.

    q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D].
    Returns float64 [B, H, D].  Query head h reads kv head h // (H // KVH).
    """
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale

    rows: list[list[tuple[int, int]]] = [[] for _ in range(batch)]  # per seq: (block, row) of each key
    for seg in segments:
        blocks = [int(b) for b in seg.block_ids.tolist()]
        keys = [
            (blocks[(seg.start + i) // block_size], (seg.start + i) % block_size) for i in range(seg.length)
        ]
        for s in seg.seqs.tolist():
            rows[int(s)].extend(keys)

    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    for b in range(batch):
        if not rows[b]:
            raise ValueError(f"sequence {b} has no keys")
        blk = torch.tensor([r[0] for r in rows[b]])
        off = torch.tensor([r[1] for r in rows[b]])
        k = k_cache[blk, off].to("cpu", torch.float64)  # [L, KVH, D]
        v = v_cache[blk, off].to("cpu", torch.float64)
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        qb = q[b].to("cpu", torch.float64)  # [H, D]
        scores = torch.einsum("hd,lhd->hl", qb, k) * scale  # [H, L]
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", probs, v)
    return out

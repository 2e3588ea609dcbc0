"""Prefill attention over the paged bf16 KV cache in bf16 dot products (``csrc/prefill_bf16.c``).

A step's prompt chunks each attend causally to their sequence's keys.  PyTorch's
CPU flash kernel computes that at a fraction of the CPU's bf16 dot-product rate and
reads a gathered copy of the keys; the C kernel computes both products in bf16 dot
products and reads the cache blocks in place, all chunks of a step in one call per
layer.  :class:`PrefillPlan` holds the step's index arrays (the same for every
layer), built once per step.  Backends (:data:`BACKENDS`): ``amx`` (Intel AMX tiles,
where the build targets AMX-BF16 and Linux grants the tiles), ``avx512-bf16``
(vdpbf16ps: AMD Zen 4 and later, Intel Cooper Lake and later) and ``portable`` (plain
C, slower than PyTorch: the tests run it on every CPU); the fast two take head dims
that are multiples of 32.

The engine uses the fastest backend its options allow for bf16 caches
(:class:`~parrot.engine.kernels.kernel_set.KernelSet`'s ``bf16_prefill``).  Results:
queries rounded to bf16, products accumulated in fp32, probabilities rounded to bf16
before they weight the values, as in PyTorch's bf16 flash attention (each backend sums
in its own order).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from parrot.engine.kernels import native

__all__ = ["BACKENDS", "ChunkSpec", "PrefillPlan", "best"]

# By the number the C side gives each (parrot_prefill_bf16_best): slowest first.
BACKENDS = ("portable", "avx512-bf16", "amx")


def best(head_dim: int, lib: ctypes.CDLL | None = None) -> str:
    """The fastest backend that runs heads of ``head_dim`` here with ``lib`` (default: the
    selected build); ``portable`` without a library."""
    lib = lib or native.library()
    return "portable" if lib is None else BACKENDS[lib.parrot_prefill_bf16_best(head_dim)]


@dataclass(frozen=True)
class ChunkSpec:
    """One prompt chunk of a step: its queries are rows ``[row, row + n)`` of the step's
    tokens, at positions ``[start, start + n)``; ``blocks``: the cache blocks holding its
    sequence's positions ``[0, start + n)``, in order."""

    row: int
    n: int
    start: int
    blocks: Sequence[int]


class PrefillPlan:
    """The index arrays of one step's prompt chunks, for every layer's :meth:`attend` on
    ``backend`` (one of :data:`BACKENDS`, default the fastest for the heads it is given)."""

    def __init__(
        self, chunks: Sequence[ChunkSpec], block_size: int, lib: ctypes.CDLL, backend: str | None = None
    ):
        if not chunks:
            raise ValueError("PrefillPlan needs at least one chunk")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
        self.backend = backend
        for c in chunks:
            if c.n <= 0 or c.start < 0 or c.row < 0:
                raise ValueError(f"bad chunk {c}")
            if len(c.blocks) * block_size < c.start + c.n:
                raise ValueError(f"chunk {c} has too few blocks for {c.start + c.n} positions")
        self.lib = lib
        self.block_size = block_size
        self.chunks = len(chunks)
        self.first_row = min(c.row for c in chunks)
        self.end_row = max(c.row + c.n for c in chunks)
        self.q_row = torch.tensor([c.row for c in chunks], dtype=torch.long)
        self.n = torch.tensor([c.n for c in chunks], dtype=torch.long)
        self.start = torch.tensor([c.start for c in chunks], dtype=torch.long)
        offsets = [0]
        for c in chunks:
            offsets.append(offsets[-1] + len(c.blocks))
        self.blk_off = torch.tensor(offsets[:-1], dtype=torch.long)
        self.blocks = torch.tensor([b for c in chunks for b in c.blocks], dtype=torch.long)
        self.last_block = int(self.blocks.max()) if len(self.blocks) else -1
        if int(self.blocks.min()) < 0:
            raise ValueError("a chunk's block id is negative")

    def attend(self, q: Tensor, k_layer: Tensor, v_layer: Tensor, out: Tensor) -> None:
        """Write the chunks' rows of ``out`` [T, H, D] (fp32): causal attention of their
        rows of ``q`` [T, H, D] (fp32, unscaled) over one layer's cache ``k_layer``,
        ``v_layer`` [NB, BS, KVH, D] (bf16).  Other rows of ``out`` are left alone."""
        if q.dtype != torch.float32 or out.dtype != torch.float32:
            raise ValueError("prefill attention takes fp32 queries and writes fp32 rows")
        if k_layer.dtype != torch.bfloat16 or v_layer.dtype != torch.bfloat16:
            raise ValueError("prefill attention reads a bf16 cache")
        if q.dim() != 3 or out.shape != q.shape or q.shape[0] < self.end_row:
            raise ValueError(f"q and out must be [T >= {self.end_row}, H, D], got {tuple(q.shape)}")
        nb, bs, kv_heads, dim = k_layer.shape
        if v_layer.shape != k_layer.shape or bs != self.block_size or dim != q.shape[2]:
            raise ValueError("the cache's layout does not match the plan or the queries")
        if q.shape[1] % kv_heads:
            raise ValueError(f"{q.shape[1]} query heads are not a multiple of {kv_heads} kv heads")
        if self.last_block >= nb:
            raise ValueError("a chunk's block is outside the cache")
        heads = q.shape[1]
        backend = best(dim, self.lib) if self.backend is None else self.backend
        for t in (q, out):  # rows may lie apart (q: a view into the q/k/v GEMM's output)
            if t.stride(2) != 1 or t.stride(1) != dim or t.stride(0) < heads * dim:
                raise ValueError("prefill attention needs [T, H, D] rows of contiguous heads")
        if not (k_layer.is_contiguous() and v_layer.is_contiguous()):
            raise ValueError("prefill attention needs a contiguous cache layer")
        code = self.lib.parrot_prefill_attention(
            q.data_ptr(),
            q.stride(0),
            self.q_row.data_ptr(),
            self.n.data_ptr(),
            self.start.data_ptr(),
            self.chunks,
            k_layer.data_ptr(),
            v_layer.data_ptr(),
            self.blocks.data_ptr(),
            self.blk_off.data_ptr(),
            bs,
            kv_heads,
            heads // kv_heads,
            dim,
            1.0 / math.sqrt(dim),
            out.data_ptr(),
            out.stride(0),
            BACKENDS.index(backend),
            torch.get_num_threads(),
        )
        if code == 1:
            raise ValueError(f"the {backend} backend cannot run heads of {dim} here")
        if code != 0:
            raise MemoryError("prefill attention: could not allocate its scratch memory")

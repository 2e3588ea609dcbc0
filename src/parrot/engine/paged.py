"""Attention backend of one forward step over the paged KV cache.

A step's tokens are the concatenation of its slices' tokens: first every
*decode* slice (one new token), then every *prefill* chunk (several new
tokens of one sequence).  Everything that does not depend on the layer is
computed once in the constructor and reused by all layers:

- the slot mapping: the flat cache row of every new token, so that each layer
  writes all its new K and V with one ``index_copy_`` each;
- for the decode slices, the prefix tree of their block tables as
  :class:`~parrot.engine.kernels.attention.Segment` s (shared runs once, private tails
  per sequence; see :mod:`parrot.engine.core.prefix_tree`), read by
  :func:`~parrot.engine.kernels.attention.paged_decode_attention`, and on CPU their
  :class:`~parrot.engine.kernels.attention.DecodePlan` (token indices, padding; built
  by the first layer that runs, since it needs the layer's shapes); with the
  ``triton`` decode backend (the CUDA strategy) the segments stay on the host and
  their :class:`~parrot.engine.kernels.attention.triton_kernel.TritonDecodePlan`
  is uploaded once per step;
- for the prefill chunks, with ``prefill_lib`` (the CPU, a bf16 cache: see
  :mod:`parrot.engine.step_forward`), their
  :class:`~parrot.engine.kernels.prefill_bf16.PrefillPlan`: every layer's chunks then
  attend in one call of the C kernel (AMX tiles or AVX-512 BF16), which reads the
  cache blocks in place;
  otherwise, per chunk, the blocks holding its sequence's keys (one
  ``index_select`` per layer gathers them) and
  :func:`~parrot.engine.prefill_attention.prefill_attention` (causal from the
  chunk's start).  Chunks whose pasts share blocks take the shared prefill
  (:mod:`parrot.engine.prefill_sharing`) where it is faster (:func:`_sharing_pays`):
  before the C kernel only while they are short (:data:`KERNEL_SHARING_BREAK_EVEN_ROWS`),
  before PyTorch's per-chunk path on a bf16 cache only while the prefix is long against
  them (:data:`BF16_SHARING_BREAK_EVEN_KEYS_PER_ROW`), on other caches always.

Invariant (the caller's): before the step, every slice's context table covers
its new positions with blocks it may write (:meth:`ContextTable.reserve`, with
copy-on-write copies already done), and all positions before a slice's start
hold that sequence's KV.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from parrot.engine.core.prefix_tree import decode_runs
from parrot.engine.core.step_planner import SeqSlice
from parrot.engine.kernels.attention import DecodePlan, Segment, paged_decode_attention, plan_decode_attention
from parrot.engine.kernels.attention.triton_kernel import TritonDecodePlan, plan_triton_decode
from parrot.engine.kernels.prefill_bf16 import ChunkSpec, PrefillPlan
from parrot.engine.kv_store import PagedKVCache
from parrot.engine.prefill_attention import prefill_attention
from parrot.engine.prefill_sharing import SharedPrefill, plan_shared_prefill

KERNEL_SHARING_BREAK_EVEN_ROWS = 32.0
"""Where the C prompt kernel takes over from the shared prefill: the mean query rows a chunk
brings to a shared key (:attr:`~parrot.engine.prefill_sharing.SharedPrefill.rows_per_shared_key`)
at which both cost the same.  The AMX kernel reads a shared key once per chunk (about
14 us per chunk and key over SmolLM2's 30 layers, with the step's queries in 16-row
tiles) and then costs about 0.06 us per (row, key) pair; the shared plan reads the key
once for all chunks but its shared-row kernel costs about 0.5 us per pair, so it wins
only below ~14 / (0.5 - 0.06) ~ 32 rows per chunk: 32 questions of 20 tokens under a
2,000-token prompt (0.9 s against 1.15 s for their prefill), not 10 chain steps of 200
tokens under a 32-token template (1.07 s against 0.65 s), nor 32 of 50 tokens under
2,000 (2.0 s against 1.6 s).  Measured on a 2-core Xeon with AMX, bf16:
``python benchmarks/shared_prompt_steps.py --dtype bfloat16 --max-step-tokens 2048 ...``
(docs/engine.md, "Prompt attention under a shared prefix").  The AVX-512 BF16 backend
takes the same rule; its break-even has not been measured on its own."""

BF16_SHARING_BREAK_EVEN_KEYS_PER_ROW = 2.5
"""Without the C prompt kernel, on a bf16 cache on CPU: the shared prefix's length against the
chunks' (:attr:`~parrot.engine.prefill_sharing.SharedPrefill.shared_keys_per_row`) below
which attending chunk by chunk is faster than the shared prefill.  There the per-chunk path
is PyTorch's bf16 flash attention, cheaper per (row, key) pair than the shared-row kernel,
which pays off only by not gathering and reading the prefix once per chunk: a long prefix
under short chunks (a system prompt over questions), not a template of a few dozen tokens
over a chain step's or a map's chunk.  On an fp32 cache the two cost about the same and the
shared plan stays first.  Placed by runs of ``benchmarks/shared_prompt_steps.py`` on a 2-core
AMD EPYC (docs/engine.md, "Prompt attention under a shared prefix")."""


def _sharing_pays(
    shared: SharedPrefill, kernel: bool, cache_dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether a step's chunks should take the shared prefill ``shared`` rather than attend one by
    one (on the C prompt kernel where ``kernel``, else PyTorch's per-chunk path)."""
    if kernel:
        return shared.rows_per_shared_key < KERNEL_SHARING_BREAK_EVEN_ROWS
    if device.type == "cpu" and cache_dtype == torch.bfloat16:
        return shared.shared_keys_per_row >= BF16_SHARING_BREAK_EVEN_KEYS_PER_ROW
    return True


@dataclass
class _Chunk:
    rows: slice  # rows of the step's tokens
    blocks: torch.Tensor  # LongTensor: blocks holding positions [0, total)
    total: int  # keys the chunk's queries read (its sequence's length after the chunk)
    start: int  # absolute position of the chunk's first token


def decode_segments(
    tables: list[list[int]], lengths: list[int], block_size: int, share: bool, device: str
) -> list[Segment]:
    """The decode batch's prefix tree as Segments (index tensors built in two calls)."""
    runs = decode_runs(tables, lengths, block_size, share=share)
    flat_blocks = [b for r in runs for b in r.blocks]
    flat_seqs = [s for r in runs for s in r.seqs]
    blocks = torch.tensor(flat_blocks, dtype=torch.long, device=device).split([len(r.blocks) for r in runs])
    seqs = torch.tensor(flat_seqs, dtype=torch.long, device=device).split([len(r.seqs) for r in runs])
    return [Segment(b, r.start, r.length, s) for r, b, s in zip(runs, blocks, seqs, strict=True)]


def _prompt_chunks(slices: list[SeqSlice], first_row: int, block_size: int, device: str) -> list[_Chunk]:
    """The step's prompt chunks, one per slice in order, their rows following one another
    from ``first_row`` (after the decode rows); each with the blocks holding its
    sequence's positions up to the chunk's end."""
    chunks: list[_Chunk] = []
    row = first_row
    for s in slices:
        total = s.start + s.n
        blocks = torch.tensor(s.ctx.block_table[: -(-total // block_size)], dtype=torch.long, device=device)
        chunks.append(_Chunk(slice(row, row + s.n), blocks, total, s.start))
        row += s.n
    return chunks


def _kernel_prefill_plan(
    chunks: list[_Chunk],
    chunk_slices: list[SeqSlice],
    block_size: int,
    lib: ctypes.CDLL | None,
    backend: str | None,
) -> PrefillPlan | None:
    """The C prompt kernel's plan for a step's prompt chunks on ``backend`` (None without
    ``lib`` or chunks): each chunk's rows, its new tokens, where they start and the blocks
    of its sequence."""
    if lib is None or not chunks:
        return None
    specs = [
        ChunkSpec(c.rows.start, c.total - c.start, c.start, s.ctx.block_table[: -(-c.total // block_size)])
        for c, s in zip(chunks, chunk_slices, strict=True)
    ]
    return PrefillPlan(specs, block_size, lib, backend)


class PagedStepAttention:
    """The :class:`~parrot.engine.model.AttentionBackend` of one step."""

    def __init__(
        self,
        cache: PagedKVCache,
        slices: list[SeqSlice],
        slots: list[int],
        *,
        share_prefix: bool = True,
        decode_backend: str = "auto",
        prefill_lib: ctypes.CDLL | None = None,
        prefill_backend: str | None = None,
    ):
        """``decode_backend``: the ``backend`` of every layer's
        :func:`~parrot.engine.kernels.attention.paged_decode_attention` call;
        ``prefill_lib``: the C ops build whose prompt kernel runs the prefill chunks'
        attention (the caller has checked it applies: CPU, bf16 cache), on
        ``prefill_backend`` (None: the fastest the build has)."""
        bs, device = cache.block_size, cache.device
        self.cache = cache
        self.share = share_prefix
        self.decode_backend = decode_backend
        triton = decode_backend == "triton"
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        decodes = [s for s in slices if s.n == 1]
        self.num_decode = len(decodes)
        if any(s.n != 1 for s in slices[: self.num_decode]):
            raise ValueError("decode slices must come first")
        self.segments = (
            decode_segments(
                [s.ctx.block_table for s in decodes],
                [s.start + 1 for s in decodes],
                bs,
                share_prefix,
                "cpu" if triton else device,  # Triton plans them on the host
            )
            if decodes
            else []
        )
        self._plan: DecodePlan | TritonDecodePlan | None = None  # built by the first layer, reused
        chunk_slices = slices[self.num_decode :]
        self.chunks = _prompt_chunks(chunk_slices, self.num_decode, bs, device)
        # Chunks whose pasts share blocks attend to the shared runs once for all of them;
        # the plan is made by the first layer (it needs the queries' dtype and device).
        self._prefill_tables = [(s.ctx.block_table, s.start, s.start + s.n) for s in chunk_slices]
        self._shared_prefill: SharedPrefill | None = None
        self._prefill_planned = not share_prefix or len(self.chunks) < 2
        self._kernel_prefill = _kernel_prefill_plan(
            self.chunks, chunk_slices, bs, prefill_lib, prefill_backend
        )

    def decode_plan(self, q_probe: torch.Tensor) -> DecodePlan | TritonDecodePlan | None:
        """The decode slices' attention plan every layer of the step uses (made once, from
        the shapes of ``q_probe`` [num_decode, H, D] and the cache): the Triton plan for
        the triton backend, else on CPU the PyTorch plan, else None (each layer takes
        the segments)."""
        if self._plan is None and self.num_decode and self.decode_backend == "triton":
            self._plan = plan_triton_decode(
                self.segments,
                batch=self.num_decode,
                block_size=self.cache.block_size,
                group=q_probe.shape[1] // self.cache.k.shape[3],
                share=self.share,
                device=q_probe.device,
            )
        if self._plan is None and self.num_decode and q_probe.device.type == "cpu":
            self._plan = plan_decode_attention(
                self.segments, q_probe, self.cache.k[0], share=self.share, validate=False
            )
        return self._plan

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D]
        cache = self.cache
        rows_k, rows_v = cache.k_rows[layer], cache.v_rows[layer]
        rows_k.index_copy_(0, self.slots, k.to(rows_k.dtype))  # rounds to the cache's dtype
        rows_v.index_copy_(0, self.slots, v.to(rows_v.dtype))
        k_layer, v_layer = cache.k[layer], cache.v[layer]  # [NB, BS, KVH, D]
        nd = self.num_decode
        decoded = None
        if nd:
            qd = q[:nd] if self.chunks else q
            self.decode_plan(qd)
            decoded = paged_decode_attention(
                qd,
                k_layer,
                v_layer,
                self._plan or self.segments,
                share=self.share,
                backend=self.decode_backend,  # type: ignore[arg-type]
                validate=False,
            )
            if not self.chunks:
                return decoded
        out = torch.empty_like(q)
        if decoded is not None:
            out[:nd] = decoded
        kernel = self._kernel_prefill is not None and q.dtype == torch.float32
        if not self._prefill_planned:
            self._prefill_planned = True
            tables, starts, totals = zip(*self._prefill_tables, strict=True)
            shared = plan_shared_prefill(tables, starts, totals, cache.block_size, q)
            if shared is not None and not _sharing_pays(shared, kernel, k_layer.dtype, q.device):
                shared = None  # the chunks attend one by one, reading the prefix each
            self._shared_prefill = shared
        if self._shared_prefill is not None:
            out[nd:] = self._shared_prefill.attend(q[nd:], k_layer, v_layer)
            return out
        if kernel:
            self._kernel_prefill.attend(q, k_layer, v_layer, out)
            return out
        kv_heads, dim = k.shape[1], k.shape[2]
        # A bf16 cache on CPU: prefill attention runs in bf16 (the keys and values are
        # bf16 already; the queries are rounded): faster than widening them to fp32.
        adt = torch.bfloat16 if k_layer.dtype == torch.bfloat16 and q.device.type == "cpu" else q.dtype
        for c in self.chunks:
            kk = k_layer.index_select(0, c.blocks).view(-1, kv_heads, dim)[: c.total].to(adt)
            vv = v_layer.index_select(0, c.blocks).view(-1, kv_heads, dim)[: c.total].to(adt)
            out[c.rows] = prefill_attention(q[c.rows].to(adt), kk, vv, c.start)
        return out

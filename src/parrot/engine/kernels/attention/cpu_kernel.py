"""Single-query decode attention in C for CPU, reading the paged cache in place.

PyTorch has no paged attention op on CPU, so the PyTorch path gathers every
row's keys and values out of the cache (a copy as large as what attention then
reads) before one fused attention call.  ``parrot_decode_rows``
(``parrot/engine/kernels/csrc/decode_rows.c``, built by :mod:`parrot.engine.kernels.native`)
reads the cache rows in place instead: one pass over each sequence's K and V per
layer, with an online softmax, parallel over rows (and kv heads when rows are
few) on PyTorch's own OpenMP threads.  ``parrot_shared_rows``
(``csrc/shared_rows.c``) takes one shared prefix for all the queries under it,
reading each of its keys and values once per kv head (:func:`shared_row`).
Where the library is unavailable, :func:`supports` is False and attention keeps
the PyTorch path; where the shared kernel is not built for a layout (no AVX-512,
head dim not a multiple of 64), :func:`shared_built` is False and shared
prefixes keep PyTorch's matrix-matrix path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor

from parrot.engine.kernels import native

__all__ = ["decode_rows", "merge_lse", "shared_built", "shared_row", "supports"]


def supports(compute_dtype: torch.dtype, cache: Tensor) -> bool:
    """Whether :func:`decode_rows` runs attention computed in ``compute_dtype`` over
    ``cache`` (fp32 compute; a contiguous fp32 or bf16 cache on CPU) and the kernel
    is available."""
    return (
        compute_dtype == torch.float32
        and cache.device.type == "cpu"
        and cache.dtype in (torch.float32, torch.bfloat16)
        and cache.is_contiguous()
        and native.library() is not None
    )


def _checked_lib(name: str, lib: ctypes.CDLL | None, tensors: tuple[Tensor, ...]) -> ctypes.CDLL:
    """The library to call, after checking that every tensor is contiguous on CPU
    (the C side reads raw pointers)."""
    lib = native.require(lib)
    if not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors):
        raise ValueError(f"{name} needs contiguous CPU tensors")
    return lib


@dataclass(frozen=True)
class _Attention:
    """The checked library and the C arguments :func:`decode_rows` and :func:`shared_row`
    pass alike, in the groups of ``parrot_ops.h``'s prototypes: ``queries`` (q, q_stride,
    seqs), ``caches`` (k, v, kv_bf16, tok) and ``layout`` (kv_heads, group, dim).  The
    pointers are borrowed from tensors the caller holds for the call."""

    lib: ctypes.CDLL
    heads: int
    dim: int
    queries: tuple[int, int, int]
    caches: tuple[int, int, int, int]
    layout: tuple[int, int, int]


def _checked_attention(
    name: str,
    lib: ctypes.CDLL | None,
    qs: Tensor,
    seqs: Tensor,
    kf: Tensor,
    vf: Tensor,
    tok: Tensor,
    *rest: Tensor,
) -> _Attention:
    """The checks :func:`decode_rows` and :func:`shared_row` share: every tensor contiguous
    on CPU, ``qs`` fp32 [B, H, D], the caches alike and fp32 or bf16 [N, KVH, D], and H a
    multiple of KVH.  Each caller then checks its own operands' shapes and dtypes (``seqs``,
    ``tok`` and ``rest``)."""
    lib = _checked_lib(name, lib, (qs, seqs, kf, vf, tok, *rest))
    _, heads, dim = qs.shape
    _, kv_heads, _ = kf.shape
    if vf.shape != kf.shape or vf.dtype != kf.dtype:
        raise ValueError(f"{name}: mismatched cache shapes")
    if qs.dtype != torch.float32 or kf.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{name}: queries must be fp32 and the caches fp32 or bf16")
    if kf.shape[2] != dim or heads % kv_heads:
        raise ValueError(f"{name}: head dims or head counts do not match")
    return _Attention(
        lib,
        heads,
        dim,
        queries=(qs.data_ptr(), heads * dim, seqs.data_ptr()),
        caches=(kf.data_ptr(), vf.data_ptr(), int(kf.dtype == torch.bfloat16), tok.data_ptr()),
        layout=(kv_heads, heads // kv_heads, dim),
    )


def decode_rows(
    qs: Tensor,
    seqs: Tensor,
    kf: Tensor,
    vf: Tensor,
    tok: Tensor,
    lens: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    lib: ctypes.CDLL | None = None,
) -> bool:
    """Attention of ``R`` single-query rows, written into ``out`` [R, H, D] and ``lse`` [R, H].

    qs: [B, H, D] fp32, scaled; seqs: int64 [R], the q row of each row; kf, vf:
    [N, KVH, D] fp32/bf16 caches; tok: int64 [R, W], row r's key rows in its
    first ``lens[r]`` (>= 1) entries.  The caller checks shapes and index ranges
    (:class:`~parrot.engine.kernels.attention.torch_plan.TorchDecodePlan` builds them);
    this checks layouts, because the C side trusts them.  ``lib``: a library from
    :func:`parrot.engine.kernels.native.build` (default: :func:`~parrot.engine.kernels.native.library`).
    Returns whether the AVX-512 path ran.
    """
    a = _checked_attention("decode_rows", lib, qs, seqs, kf, vf, tok, lens, out, lse)
    rows, width = tok.shape
    if out.shape != (rows, a.heads, a.dim):
        raise ValueError("decode_rows: mismatched output shapes")
    if lse.shape != (rows, a.heads) or out.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError("decode_rows: out and lse must be fp32 [R, H, D] and [R, H]")
    if seqs.dtype != torch.int64 or tok.dtype != torch.int64 or lens.dtype != torch.int64:
        raise ValueError("decode_rows: seqs, tok and lens must be int64")
    if seqs.shape != (rows,) or lens.shape != (rows,):
        raise ValueError("decode_rows: row counts do not match")
    vector = a.lib.parrot_decode_rows(
        *a.queries,
        *a.caches,
        lens.data_ptr(),
        rows,
        width,
        *a.layout,
        out.data_ptr(),
        lse.data_ptr(),
        torch.get_num_threads(),
    )
    return bool(vector)


def shared_built(dim: int) -> bool:
    """Whether the loaded library has the shared kernel for head dim ``dim``
    (AVX-512, dim a multiple of 64); the caches must also pass :func:`supports`."""
    lib = native.library()
    return lib is not None and bool(lib.parrot_shared_rows_supported(dim))


def shared_row(
    qs: Tensor,
    seqs: Tensor,
    kf: Tensor,
    vf: Tensor,
    tok: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    lib: ctypes.CDLL | None = None,
) -> None:
    """Attention of the ``m`` queries ``qs[seqs]`` over one shared run of keys, written
    into ``out`` [m, H, D] (normalised) and ``lse`` [m, H].

    qs: [B, H, D] fp32, scaled; seqs: int64 [m]; kf, vf: [N, KVH, D] fp32/bf16
    caches; tok: int64 [L >= 1], the run's key rows.  Index ranges are the caller's
    (:class:`~parrot.engine.kernels.attention.torch_plan.TorchDecodePlan`); layouts, dtypes
    and counts are checked here, because the C side trusts them.
    """
    a = _checked_attention("shared_row", lib, qs, seqs, kf, vf, tok, out, lse)
    m = seqs.numel()
    if out.shape != (m, a.heads, a.dim) or lse.shape != (m, a.heads):
        raise ValueError("shared_row: out and lse must be [m, H, D] and [m, H]")
    if out.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError("shared_row: out and lse must be fp32")
    if seqs.dtype != torch.int64 or tok.dtype != torch.int64 or seqs.dim() != 1 or tok.dim() != 1:
        raise ValueError("shared_row: seqs and tok must be 1-D int64")
    if m < 1 or tok.numel() < 1:
        raise ValueError("shared_row: needs at least one query and one key")
    code = a.lib.parrot_shared_rows(
        *a.queries,
        m,
        *a.caches,
        tok.numel(),
        *a.layout,
        out.data_ptr(),
        lse.data_ptr(),
        torch.get_num_threads(),
    )
    if code != 0:
        raise MemoryError("shared_row: could not allocate its scratch memory")


def merge_lse(
    out: Tensor,
    lse: Tensor,
    starts: Tensor,
    slots: Tensor,
    result: Tensor,
    *,
    lib: ctypes.CDLL | None = None,
) -> None:
    """Merge normalised partials into ``result`` [B, H, D]: sequence b's partials are rows
    ``slots[starts[b]:starts[b + 1]]`` of ``out`` [S, H, D] and ``lse`` [S, H], weighted
    by ``exp(lse - max)`` (what :func:`~parrot.engine.kernels.attention.merge.merge_partials`
    computes with ``den = 1``, in one pass).  Index ranges are the caller's
    (:class:`~parrot.engine.kernels.attention.torch_plan.TorchDecodePlan`: every sequence has a
    partial); layouts, dtypes and counts are checked here."""
    lib = _checked_lib("merge_lse", lib, (out, lse, starts, slots, result))
    slot_count, heads, dim = out.shape
    batch = result.shape[0]
    if any(t.dtype != torch.float32 for t in (out, lse, result)):
        raise ValueError("merge_lse: out, lse and result must be fp32")
    if starts.dtype != torch.int64 or slots.dtype != torch.int64:
        raise ValueError("merge_lse: starts and slots must be int64")
    if lse.shape != (slot_count, heads) or result.shape[1:] != (heads, dim):
        raise ValueError("merge_lse: out [S, H, D], lse [S, H] and result [B, H, D] do not match")
    if starts.shape != (batch + 1,) or slots.dim() != 1:
        raise ValueError("merge_lse: starts must be [B + 1] and slots 1-D")
    lib.parrot_merge_lse(
        out.data_ptr(),
        lse.data_ptr(),
        starts.data_ptr(),
        slots.data_ptr(),
        batch,
        heads,
        dim,
        result.data_ptr(),
        torch.get_num_threads(),
    )

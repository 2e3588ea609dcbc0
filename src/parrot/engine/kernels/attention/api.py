"""Public entry point: input checks and backend dispatch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from parrot.engine.kernels.attention import cpu_kernel
from parrot.engine.kernels.attention.segments import Segment, validate_segments
from parrot.engine.kernels.attention.torch_impl import compute_dtype, torch_paged_decode_attention
from parrot.engine.kernels.attention.torch_plan import TorchDecodePlan
from parrot.engine.kernels.attention.triton_kernel import (
    TritonDecodePlan,
    interpret_requested,
    triton_paged_decode_attention,
)

__all__ = ["Backend", "DecodePlan", "paged_decode_attention", "plan_decode_attention", "triton_available"]

DecodePlan = TorchDecodePlan

Backend = Literal["auto", "torch", "triton"]
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def triton_available() -> bool:
    """True when triton can be imported (it is optional; nothing imports it eagerly)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _check_tensors(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, KVH, D]; "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    _, heads, dim = q.shape
    num_blocks, block_size, kv_heads, kdim = k_cache.shape
    if kdim != dim:
        raise ValueError(f"head dim mismatch: q has D={dim}, caches have D={kdim}")
    if num_blocks < 1 or block_size < 1 or kv_heads < 1 or dim < 1:
        raise ValueError(f"empty cache dimensions: {tuple(k_cache.shape)}")
    if heads % kv_heads:
        raise ValueError(f"H={heads} is not a multiple of KVH={kv_heads}")
    kv = k_cache.dtype
    narrow_cache = kv in _HALF_DTYPES and q.dtype in (torch.float32, torch.float64)
    if q.dtype not in _FLOAT_DTYPES or v_cache.dtype != kv or (kv != q.dtype and not narrow_cache):
        raise ValueError(
            "q, k_cache, v_cache must share one float dtype (or the caches one 16-bit dtype under "
            f"fp32/fp64 queries); got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(f"devices differ: q {q.device}, k_cache {k_cache.device}, v_cache {v_cache.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(0) != t.shape[1] * t.stride(1):
            raise ValueError(f"{name}: block and token dims must be mergeable (stride[0] == BS * stride[1])")


def _resolve_backend(backend: str, q: Tensor) -> str:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "auto":
        return "triton" if q.is_cuda and triton_available() else "torch"
    if backend == "triton" and not q.is_cuda and not interpret_requested():
        raise ValueError(
            "backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)"
        )
    return backend


def plan_decode_attention(
    segments: Sequence[Segment],
    q: Tensor,
    k_cache: Tensor,
    *,
    share: bool = True,
    validate: bool = True,
) -> DecodePlan:
    """Precompute the layer-independent work of :func:`paged_decode_attention` for one batch.

    ``q`` and ``k_cache`` only give shapes, dtype and device (any layer's).  Pass the
    plan as ``segments`` to :func:`paged_decode_attention` for every layer of the step:
    the same result as passing the segments, without re-deriving token indices and
    padding per layer.  The plan is valid while the segments are.
    """
    _check_tensors(q, k_cache, k_cache)
    if not isinstance(share, bool) or not isinstance(validate, bool):
        raise ValueError("share and validate must be bools")
    batch, heads, dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    if validate:
        validate_segments(segments, batch, num_blocks, block_size)
    return TorchDecodePlan(
        segments,
        batch=batch,
        block_size=block_size,
        kv_heads=kv_heads,
        dim=dim,
        group=heads // kv_heads,
        share=share,
        device=q.device,
        kernel=cpu_kernel.supports(compute_dtype(q.dtype), k_cache),
    )


def _checked_scale(scale: float | None, dim: int) -> float:
    """The softmax scale: ``scale`` as a float, 1/sqrt(dim) when None; ValueError unless finite."""
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    return float(scale)


def paged_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    segments: Sequence[Segment] | DecodePlan | TritonDecodePlan,
    *,
    scale: float | None = None,
    share: bool = True,
    backend: Backend = "auto",
    validate: bool = True,
) -> Tensor:
    """Decode-step attention over a paged KV cache whose sequences share prefix segments.

    q: [B, H, D] (one decode query per sequence); k_cache, v_cache: [num_blocks, block_size,
    KVH, D]; H % KVH == 0 (GQA: query head h reads kv head h // (H // KVH)).  Each sequence
    attends to the union of the segments that list it (all of its keys appear in exactly one
    of them — no causal mask needed for decode).  Returns [B, H, D] in q's dtype.  The caches
    may hold a 16-bit dtype under fp32/fp64 queries (torch backend): keys and values are then
    widened to q's dtype as they are read, and everything is computed in q's dtype.

    share=True: each segment is computed once for all its queries (matrix-matrix), partials
    merged by LSE.  share=False: plain per-sequence paged attention (each sequence gathers its
    own keys; no sharing) — the baseline.  Both agree up to fp rounding.

    backend: "auto" (triton for CUDA tensors when triton is importable, else torch),
    "torch", or "triton" (CUDA, or CPU under TRITON_INTERPRET=1).
    segments may be a :func:`plan_decode_attention` plan for this batch (its ``share``
    then wins), or for the triton backend a
    :func:`~parrot.engine.kernels.attention.triton_kernel.plan_triton_decode` plan.
    validate: run :func:`validate_segments` first (cheap: ~0.3 ms for 65 segments; the hot
    path may pass False — malformed segments then give unspecified results, e.g. NaN rows
    for sequences no segment lists).  Tensor shapes, dtypes and devices are always checked
    (no data access, no device sync).
    """
    _check_tensors(q, k_cache, v_cache)
    if not isinstance(share, bool) or not isinstance(validate, bool):
        raise ValueError("share and validate must be bools")
    batch, _, dim = q.shape
    num_blocks, block_size, _, _ = k_cache.shape
    scale = _checked_scale(scale, dim)
    which = _resolve_backend(backend, q)
    plan = segments if isinstance(segments, DecodePlan) else None
    if isinstance(segments, TritonDecodePlan):
        if which != "triton":
            raise ValueError("a Triton decode plan needs the triton backend")
    elif plan is not None:
        segments, share = plan.segments, plan.share  # validated when the plan was made
    elif validate:
        validate_segments(segments, batch, num_blocks, block_size)
    if batch == 0:
        return torch.empty_like(q)
    if which == "triton":
        if k_cache.dtype != q.dtype:
            raise ValueError(
                f"the triton backend needs q in the caches' dtype ({k_cache.dtype}), got {q.dtype}"
            )
        return triton_paged_decode_attention(q, k_cache, v_cache, segments, scale=scale, share=share)
    if plan is not None:
        return torch_paged_decode_attention(q, k_cache, v_cache, plan, scale=scale, share=share)
    return torch_paged_decode_attention(q, k_cache, v_cache, segments, scale=scale, share=share)

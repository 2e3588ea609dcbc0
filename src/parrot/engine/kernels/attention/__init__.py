"""Decode attention over a paged KV cache with prefix-tree sharing.

Public API: :class:`Segment`, :func:`validate_segments`, :func:`paged_decode_attention`
(torch backend everywhere; triton backend for CUDA, imported lazily) and the float64
:func:`reference_decode_attention`.  See docs/attention.md.
"""

from parrot.engine.kernels.attention.api import (
    Backend,
    DecodePlan,
    paged_decode_attention,
    plan_decode_attention,
    triton_available,
)
from parrot.engine.kernels.attention.reference import reference_decode_attention
from parrot.engine.kernels.attention.segments import Segment, validate_segments

__all__ = [
    "Backend",
    "DecodePlan",
    "Segment",
    "paged_decode_attention",
    "plan_decode_attention",
    "reference_decode_attention",
    "triton_available",
    "validate_segments",
]

"""An engine's options, in one place: ``parrot serve`` / ``parrot engine`` build one
:class:`EngineConfig` from their flags and it reaches the runner unchanged."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from parrot.engine.core.block_pool import DEFAULT_BLOCK_SIZE
from parrot.engine.core.latency_fit import LATENCY_FACTOR
from parrot.engine.core.step_planner import DEFAULT_MAX_STEP_TOKENS
from parrot.engine.device import DEVICES
from parrot.engine.kernels.options import KernelOptions

__all__ = ["DECODE_ATTENTION", "EngineConfig"]

DECODE_ATTENTION = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """``max_step_tokens`` — tokens of one forward step (decodes always go in; prompt
    chunks fill the rest); ``token_capacity`` — the most distinct KV tokens of running
    work admission allows (None: the KV pool's size, so memory is what binds; the
    runner's :meth:`~parrot.engine.runner.EngineRunner.set_token_capacity` changes it
    at run time); ``share_prefix`` — attention reads a shared prefix once for all
    sequences under it (False: plain per-sequence paged attention, for baselines);
    ``prefix_cache`` — reuse the KV of any earlier prompt's leading whole blocks
    (automatic prefix caching; False for request-level baselines without sharing);
    ``block_size`` and ``kv_cache_tokens`` / ``kv_cache_bytes`` — the KV pool (see
    :func:`~parrot.engine.kv_store.kv_cache_blocks`; default 2 GiB worth of tokens);
    ``prepack`` — run the projections through oneDNN-packed weights where possible
    (:mod:`~parrot.engine.kernels.packed_linear`); ``weight_dtype`` — pack them as this dtype
    (``torch.bfloat16``: bf16 GEMMs, opt-in) instead of the weights' own;
    ``kv_dtype`` — the KV cache's dtype (default: the weights'; ``torch.bfloat16``
    halves the bytes each decode step reads); ``latency_probe`` — time a few decode
    steps at start-up to size the latency cap at once (``LocalEngine``);
    ``latency_factor``, ``latency_target_ms``, ``latency_cap`` — how the engine sizes
    the latency cap it reports (:mod:`parrot.engine.latency_probe`; a fixed
    ``latency_cap`` needs no probe); ``kernels`` — which kernels it may use and which
    build of the C ops it loads (:class:`~parrot.engine.kernels.options.KernelOptions`;
    the CLI's defaults come from ``PARROT_*`` environment variables); ``step_log`` — a
    file to append one JSON line per step to (:mod:`parrot.engine.step_log`; None: no
    log); ``device`` —
    ``cpu``, ``cuda`` or ``auto`` and ``dtype`` — the model's dtype there
    (:mod:`parrot.engine.device`; on CUDA no packing and no C kernels);
    ``decode_attention`` — which decode attention the step strategy uses: ``auto``
    (the device's own: PyTorch / C kernels on the CPU, Triton on CUDA), ``torch`` or
    ``triton`` (CUDA, or the CPU under ``TRITON_INTERPRET=1``, to test the CUDA
    path)."""

    max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS
    token_capacity: int | None = None
    share_prefix: bool = True
    prefix_cache: bool = True
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_tokens: int | None = None
    kv_cache_bytes: int | None = None
    prepack: bool = True
    weight_dtype: torch.dtype | None = None
    kv_dtype: torch.dtype | None = None
    latency_probe: bool = True
    latency_factor: float = LATENCY_FACTOR
    latency_target_ms: float | None = None
    latency_cap: int | None = None
    kernels: KernelOptions = field(default_factory=KernelOptions)
    step_log: str | None = None
    device: str = "cpu"
    dtype: torch.dtype | None = None
    decode_attention: str = "auto"

    def __post_init__(self) -> None:
        if self.max_step_tokens < 1:
            raise ValueError("max_step_tokens must be >= 1")
        if self.weight_dtype is not None and not self.prepack:
            raise ValueError("weight_dtype needs prepack=True")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {self.device!r}")
        if self.decode_attention not in DECODE_ATTENTION:
            choices = ", ".join(DECODE_ATTENTION)
            raise ValueError(f"decode_attention must be one of {choices}, not {self.decode_attention!r}")

    @classmethod
    def of(cls, config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
        """``config`` with ``options`` (keyword arguments named as the fields) replacing
        its fields; the defaults when ``config`` is None.  An unknown name is a TypeError."""
        if config is None:
            return cls(**options)
        return dataclasses.replace(config, **options) if options else config

"""How the engine computes a step's hidden states: one strategy, chosen when it starts.

:func:`choose` looks at the model (packed or not, which C kernel copies its
projections have), the KV cache and the engine's kernels
(:class:`~parrot.engine.kernels.kernel_set.KernelSet`), once, and returns a
:class:`StepForward` with a name that the start-up log and the engine's stats
(``decode_path``) show:

* ``c-forward/f32``, ``c-forward/amx-bf16`` — a pure decode step within the
  kernels' row limit whose attention runs on the C kernels alone goes through
  one C call for all its layers (:mod:`parrot.engine.kernels.decode_forward`, with the
  fp32 or the AMX projection kernel); every other step (prefill chunks, larger
  batches, attention the C side does not cover) takes the model's forward.
  Both give the same bits;
* ``pytorch/fused`` — the model's forward with its elementwise steps in C
  (:mod:`parrot.engine.kernels.fused`) and oneDNN-packed projections;
* ``pytorch/packed`` — the model's forward with oneDNN-packed projections;
* ``pytorch`` — the model's plain forward (any device).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
from torch import Tensor

from parrot.engine.kernels import decode_forward, fused
from parrot.engine.kernels.kernel_set import KernelSet, for_options
from parrot.engine.kv_store import PagedKVCache
from parrot.engine.model import LlamaModel
from parrot.engine.paged import PagedStepAttention

__all__ = ["StepForward", "choose"]


@dataclass(frozen=True)
class StepForward:
    """``name``: what the stats show; ``c_forward``: try the C forward first, with
    ``lib`` (the engine's build of the C ops)."""

    name: str
    c_forward: bool
    lib: ctypes.CDLL | None = field(default=None, compare=False, repr=False)

    def __call__(
        self,
        model: LlamaModel,
        input_ids: Tensor,
        positions: Tensor,
        attn: PagedStepAttention,
        cache: PagedKVCache,
    ) -> Tensor:
        """The step's final hidden states [T, D]."""
        if self.c_forward:
            hidden = decode_forward.run(model, input_ids, positions, attn, cache, self.lib)
            if hidden is not None:
                return hidden
        return model(input_ids, positions, attn)


def choose(model: LlamaModel, cache: PagedKVCache, kernels: KernelSet | None = None) -> StepForward:
    """The strategy for this model and cache on ``kernels`` (default: every kernel
    allowed; see the module docstring)."""
    kernels = for_options() if kernels is None else kernels
    lib = kernels.lib
    mode = decode_forward.c_forward_mode(model, cache, lib) if kernels.c_forward else None
    if mode is not None:
        return StepForward(f"c-forward/{mode}", c_forward=True, lib=lib)
    packed = len(model.model.layers) > 0 and model.model.layers[0].self_attn.qkv is not None
    residual = model.model.embed_tokens.weight  # the residual stream has its dtype and device
    if packed and fused.applies(
        torch.empty(1, model.config.hidden_size, dtype=residual.dtype, device=residual.device)
    ):
        return StepForward("pytorch/fused", c_forward=False)
    return StepForward("pytorch/packed" if packed else "pytorch", c_forward=False)

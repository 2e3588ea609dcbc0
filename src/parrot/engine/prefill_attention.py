"""Attention of a prefill chunk: ``n`` new tokens of one sequence over all its keys.

The chunk's queries sit at absolute positions ``[start, start + n)`` and read
keys ``[0, start + n)``: every key before ``start`` fully, the chunk's own keys
causally.  A single masked attention over all ``start + n`` keys materialises
an ``[n, start + n]`` score matrix per head, which for long prompts costs more
than the attention itself.  On CPU this module instead makes two calls to
PyTorch's fused flash-attention kernel, which never materialises the scores and
also returns each row's log-sum-exp:

* the past, keys ``[0, start)``, with no mask, the G query heads that share a
  kv head stacked into one query block (so a long past is read in place, not
  repeated per query head);
* the chunk itself, keys ``[start, start + n)``, with ``is_causal`` (aligned
  top-left, which is right for a square block);

and merges them exactly: with ``m = max(lse_a, lse_b)``,
``out = (out_a e^(lse_a - m) + out_b e^(lse_b - m)) / (e^(lse_a - m) + e^(lse_b - m))``
(the same result up to fp32 rounding, several times faster on long prompts:
``docs/engine.md``, "Why the kernels exist").
Elsewhere (CUDA, other dtypes, a PyTorch without the kernel) it takes
:func:`sdpa_prefill_attention`: one call of PyTorch's
``scaled_dot_product_attention`` with grouped-query heads (``enable_gqa``, no
repeated keys) and, for a chunk with a past, the bottom-right-aligned causal
bias (``causal_lower_right``), which PyTorch's fused CUDA kernels (flash,
memory-efficient) take without materialising a mask; on the CPU it runs
PyTorch's reference path, which is how CI checks it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from parrot.engine.kernels.attention.torch_impl import cpu_flash_attention

__all__ = ["fused_prefill_available", "prefill_attention", "prefill_partial", "sdpa_prefill_attention"]


_flash_op = cpu_flash_attention  # looked up at call time (tests replace it)


def fused_prefill_available(q: Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and _flash_op() is not None


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
    """q: [n, H, D], the chunk's queries (positions start .. start + n - 1); k, v:
    [start + n, KVH, D], every key of the sequence up to the chunk's end; H a multiple
    of KVH.  Returns [n, H, D]: causal attention, scale 1/sqrt(D)."""
    _check_keys(q, k, start)
    if not fused_prefill_available(q):
        return sdpa_prefill_attention(q, k, v, start)
    if start == 0:  # no past: one causal call, whose output is already in q's dtype
        return _own_keys(q, k, v)[0][0].transpose(0, 1)
    out, _ = _fused(q, k, v, start)
    return out.to(q.dtype)


def sdpa_prefill_attention(q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
    """:func:`prefill_attention` as one ``scaled_dot_product_attention`` call (the CUDA
    path; any device and float dtype): causal for a chunk without a past, else causal
    aligned to the bottom right (query i sees keys ``[0, start + i]``).  Returns
    [n, H, D] in q's dtype."""
    _check_keys(q, k, start)
    n, total = q.shape[0], k.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    kh = k.transpose(0, 1).unsqueeze(0)  # [1, KVH, start + n, D]
    vh = v.transpose(0, 1).unsqueeze(0)
    if start == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        # Imported here: torch.nn.attention.bias imports torch._dynamo, 1.3 s at the start of
        # every engine process, and only this path (SDPA with a past) needs it.
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(n, total)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, enable_gqa=True)
    return out[0].transpose(0, 1)  # [n, H, D]


def prefill_partial(q: Tensor, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """:func:`prefill_attention` that also returns each query row's log-sum-exp, for
    an exact merge with attention over other keys (:mod:`parrot.engine.prefill_sharing`):
    (out [n, H, D] fp32, normalised; lse [n, H] fp32).  Needs
    :func:`fused_prefill_available`."""
    _check_keys(q, k, start)
    if not fused_prefill_available(q):
        raise ValueError("prefill_partial needs PyTorch's fused CPU attention kernel")
    return _fused(q, k, v, start)


def _check_keys(q: Tensor, k: Tensor, start: int) -> None:
    n, total = q.shape[0], k.shape[0]
    if total != start + n or start < 0:
        raise ValueError(f"keys must cover positions [0, start + n): {total} != {start} + {n}")


def _own_keys(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The chunk over its own keys (the last ``n`` of ``k``, ``v``), causal: (out [1, H, n, D]
    in q's dtype, lse [1, H, n]), as the flash kernel returns them."""
    n, heads, dim = q.shape
    group = heads // k.shape[1]
    # the kernel wants as many kv heads as query heads, so each of the chunk's own kv
    # heads is repeated G times (n keys: cheap)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    own = k.shape[0] - n  # where the chunk's keys begin
    kc = k[own:].transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)  # [1, H, n, D]
    vc = v[own:].transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)
    return _flash_op()(qh, kc, vc, 0.0, True, scale=1.0 / math.sqrt(dim))


def _fused(q: Tensor, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
    """The two flash calls and their merge: (out [n, H, D], lse [n, H]), both fp32."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    flash = _flash_op()
    scale = 1.0 / math.sqrt(dim)
    group = heads // kv_heads
    out_b, lse_b = _own_keys(q, k, v)  # [1, H, n, D], [1, H, n]
    if start == 0:
        return out_b[0].transpose(0, 1).float(), lse_b[0].transpose(0, 1).float()
    # The past, unmasked: the G query heads of a kv head read the same keys, so they
    # go in as one query block of G * n rows per kv head; the past's keys (possibly
    # thousands) are read in place, never repeated.  Row g * n + i of kv head j is
    # query i of head j * G + g.
    qg = q.view(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * n, dim)
    kp = k[:start].transpose(0, 1).unsqueeze(0)  # [1, KVH, start, D]
    vp = v[:start].transpose(0, 1).unsqueeze(0)
    out_a, lse_a = flash(qg, kp, vp, 0.0, False, scale=scale)  # [1, KVH, G * n, D], [1, KVH, G * n]
    out_a = out_a.reshape(1, heads, n, dim).float()  # [KVH, G, n] rows are heads j * G + g, in order
    lse_a = lse_a.reshape(1, heads, n).float()  # merged in fp32 whatever the inputs' dtype
    lse_b = lse_b.float()
    top = torch.maximum(lse_a, lse_b)
    w_a = (lse_a - top).exp_().unsqueeze(-1)  # [1, H, n, 1], each in (0, 1]
    w_b = (lse_b - top).exp_().unsqueeze(-1)
    den = w_a + w_b
    out = out_a.mul_(w_a).add_(out_b.float().mul_(w_b)).div_(den)
    lse = top.add_(den.squeeze(-1).log_())  # [1, H, n]
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)

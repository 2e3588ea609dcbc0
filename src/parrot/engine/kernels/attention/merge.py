"""Exact merge of unnormalised partial attention results (log-sum-exp algebra).

A *partial* is attention of one query row over a subset of its keys, kept
unnormalised: with scores ``s_j`` over the subset and ``mx = max_j s_j``,

    out_p = sum_j exp(s_j - mx) v_j,   den_p = sum_j exp(s_j - mx),   max_p = mx.

(``lse_p = max_p + log(den_p)``.)  For disjoint subsets covering all keys, with
``M = max_p max_p`` and ``w_p = exp(max_p - M)`` in (0, 1]:

    out = sum_p w_p out_p / sum_p w_p den_p.

Every partial covers >= 1 key, so ``max_p`` is finite for finite inputs and
``den_p >= 1``; hence the denominator is >= 1, ``exp`` only sees arguments <= 0,
and ``-inf - -inf`` never occurs.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["merge_partials"]


def merge_partials(
    part_out: Tensor, part_max: Tensor, part_den: Tensor, owner: Tensor, batch_size: int
) -> Tensor:
    """Merge partials into per-sequence outputs.

    part_out: [S, H, D]; part_max, part_den: [S, H]; owner: LongTensor [S] — the
    sequence each partial belongs to.  Returns [batch_size, H, D] in part_out's dtype.
    Scales part_out in place.  A sequence without any partial would get NaN (0 / 0);
    validated inputs never have one.
    """
    slots, heads, _ = part_out.shape
    idx = owner.view(slots, 1).expand(slots, heads)
    top = torch.full((batch_size, heads), -torch.inf, dtype=part_max.dtype, device=part_max.device)
    top.scatter_reduce_(0, idx, part_max, reduce="amax", include_self=True)
    w = (part_max - top.index_select(0, owner)).exp_()  # [S, H], each in (0, 1]
    den = torch.zeros_like(top).index_add_(0, owner, w * part_den)
    num = torch.zeros((batch_size, *part_out.shape[1:]), dtype=part_out.dtype, device=part_out.device)
    num.index_add_(0, owner, part_out.mul_(w.unsqueeze(-1)))
    return num.div_(den.unsqueeze(-1))

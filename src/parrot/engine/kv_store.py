"""KV storage per context and the attention backend that reads it.

Each context owns a tensor pair ``k, v: [num_layers, capacity, kv_heads,
head_dim]`` holding the KV of its *own* tokens; a child context reads its
ancestors' tensors in place (see :mod:`parrot.engine.contexts`), so a shared
prefix is stored once however many contexts fork from it.  Capacity grows by
doubling; only the context's own tokens are ever copied on growth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from parrot.engine.contexts import Context


class KVStore:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}

    def ensure(self, context_id: int, num_tokens: int) -> None:
        """Make room for ``num_tokens`` own tokens of ``context_id``."""
        k = self._k.get(context_id)
        cap = 0 if k is None else k.shape[1]
        if num_tokens <= cap:
            return
        new_cap = max(num_tokens, 2 * cap, 16)
        shape = (self.num_layers, new_cap, self.num_kv_heads, self.head_dim)
        new_k = torch.empty(shape, dtype=self.dtype, device=self.device)
        new_v = torch.empty(shape, dtype=self.dtype, device=self.device)
        if k is not None:
            new_k[:, :cap] = k
            new_v[:, :cap] = self._v[context_id]
        self._k[context_id] = new_k
        self._v[context_id] = new_v

    def release(self, context_id: int) -> None:
        self._k.pop(context_id, None)
        self._v.pop(context_id, None)

    def layer_kv(self, context_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k[context_id][layer], self._v[context_id][layer]

    def allocated_tokens(self) -> int:
        return sum(k.shape[1] for k in self._k.values())


@dataclass
class SeqSlice:
    """The new tokens of one sequence in a step: own positions [start, start + n)."""

    ctx: Context
    start: int
    n: int


class StepAttention:
    """Attention backend for one forward step over several sequences.

    The step's tokens are the concatenation of each slice's ``n`` tokens in
    order.  For every layer it writes the new K/V into each context's own
    storage and attends each query to its context's ancestors' visible tokens
    plus its own tokens up to and including itself (causal).
    """

    def __init__(self, store: KVStore, slices: list[SeqSlice]):
        self.store = store
        self.slices = slices
        self._lineages = [s.ctx.lineage()[:-1] for s in slices]
        self._masks: list[torch.Tensor | None] = []
        for s in slices:
            store.ensure(s.ctx.context_id, s.start + s.n)
            self._masks.append(
                _causal_mask(s.ctx.prefix_len + s.start, s.n, store.device) if s.n > 1 else None
            )

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D]
        out = torch.empty_like(q)
        offset = 0
        for s, lineage, mask in zip(self.slices, self._lineages, self._masks, strict=True):
            own_k, own_v = self.store.layer_kv(s.ctx.context_id, layer)  # [cap, KVH, D]
            own_k[s.start : s.start + s.n] = k[offset : offset + s.n]
            own_v[s.start : s.start + s.n] = v[offset : offset + s.n]
            keys = [self.store.layer_kv(c.context_id, layer)[0][:vis] for c, vis in lineage]
            vals = [self.store.layer_kv(c.context_id, layer)[1][:vis] for c, vis in lineage]
            keys.append(own_k[: s.start + s.n])
            vals.append(own_v[: s.start + s.n])
            kk = torch.cat(keys) if len(keys) > 1 else keys[0]  # [L, KVH, D]
            vv = torch.cat(vals) if len(vals) > 1 else vals[0]
            out[offset : offset + s.n] = grouped_attention(q[offset : offset + s.n], kk, vv, mask)
            offset += s.n
        return out


def _causal_mask(first_pos: int, n: int, device: str) -> torch.Tensor:
    """[n, first_pos + n] bool: query i (absolute position first_pos + i) sees keys <= its position."""
    keys = torch.arange(first_pos + n, device=device)
    queries = torch.arange(first_pos, first_pos + n, device=device)
    return keys[None, :] <= queries[:, None]


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Grouped-query attention of n queries over L keys.

    q: [n, H, D]; k, v: [L, KVH, D] with H a multiple of KVH (query head h
    reads kv head h // (H // KVH)); mask: [n, L] bool or None (all visible).
    Returns [n, H, D].
    """
    n, num_heads, dim = q.shape
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    qg = (
        q.view(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, dim)
    )  # [KVH, G*n, D]
    kt = k.transpose(0, 1)  # [KVH, L, D]
    vt = v.transpose(0, 1)
    attn_mask = None if mask is None else mask.repeat(group, 1)  # [G*n, L]
    o = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=attn_mask)  # [KVH, G*n, D]
    return o.view(kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, num_heads, dim)

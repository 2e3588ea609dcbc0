"""A LLaMA-family decoder in plain PyTorch (fp32 on the CPU; fp16/bf16 on CUDA).

Covers LLaMA 2/3, SmolLM2, Mistral and Qwen2-style q/k/v bias: token
embedding -> N x [RMSNorm -> grouped-query attention with RoPE -> residual ->
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head (optionally tied to
the embedding).  RoPE uses Hugging Face's "rotate_half" (neox) layout: the
first and second halves of each head's dimensions form the rotated pairs.

The model owns no KV cache.  Every step feeds the *new* tokens of all
sequences of a batch concatenated into one varlen batch of ``T`` tokens, each
with its absolute position, and attention is delegated to an injected
:class:`AttentionBackend` that stores K/V and attends to each sequence's past.
:class:`ContiguousKVAttention` (with :class:`ContiguousKVCache`) is the simple
reference backend.

Parameter names are Hugging Face's (``model.layers.0.self_attn.q_proj.weight``
...), so ``state_dict()`` of a :class:`LlamaModel` is a valid HF checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parrot.engine.kernels import fused
from parrot.engine.kernels.kernel_set import KernelSet, for_options
from parrot.engine.kernels.packed_linear import (
    PackedLinear,
    Projection,
    packed_linear_available,
    prepack_linears,
)
from parrot.engine.model_config import ModelConfig

__all__ = [
    "AttentionBackend",
    "ContiguousKVAttention",
    "ContiguousKVCache",
    "LlamaModel",
    "ModelConfig",
    "apply_rope",
    "random_init",
    "rope_cos_sin",
    "rope_inv_freq",
]


# --------------------------------------------------------------------------- attention protocol


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] — the T new tokens of this
        step for ALL sequences in the batch concatenated (varlen, no padding), RoPE already applied.
        The backend stores k, v into its cache and returns the attention output [T, num_heads, head_dim]
        (causal within each sequence, attending to that sequence's cached past)."""
        ...


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, D] -> [T, D]: x / sqrt(mean(x^2) + eps) * weight, as one fused op
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies [head_dim // 2] (fp32), with linear / llama3 scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # [D/2]
    inv_freq = 1.0 / (config.rope_theta**exponents)  # [D/2]
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor  # [D/2]
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)  # [D/2]
    smooth = (old_ctx / wavelen - low) / (high - low)  # [D/2]
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled  # [D/2]
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)  # [D/2] bool
    return torch.where(medium, smoothed, scaled)  # [D/2]


def rope_cos_sin(inv_freq: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin tables [T, head_dim] for absolute ``positions`` [T] (HF layout: halves repeated)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, 1] * [1, D/2] -> [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos(), emb.sin()  # [T, D], [T, D]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, H, D] by position: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [T, H, D/2] each
    rotated = torch.cat((-x2, x1), dim=-1)  # [T, H, D]
    return x * cos[:, None, :] + rotated * sin[:, None, :]  # [T, H, D] * [T, 1, D] -> [T, H, D]


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE.

    After :meth:`fuse` (called by :meth:`LlamaModel.prepack`), q, k and v come
    from one packed GEMM over the concatenated weights and RoPE rotates q and k
    in one call; the ``q_proj``/``k_proj``/``v_proj`` parameters stay the
    checkpoint's (the fused copy is derived from them, not registered).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = Projection(c.hidden_size, c.q_size, bias=c.attention_bias)
        self.k_proj = Projection(c.hidden_size, c.kv_size, bias=c.attention_bias)
        self.v_proj = Projection(c.hidden_size, c.kv_size, bias=c.attention_bias)
        self.o_proj = Projection(c.q_size, c.hidden_size, bias=False)
        self.qkv: PackedLinear | None = None  # set by fuse()

    def fuse(self, dtype: torch.dtype, kernels: KernelSet | None = None) -> None:
        """Pack q, k and v as one ``dtype`` weight [q_size + 2 * kv_size, hidden] (with
        the C kernel copies of ``kernels``, see :class:`PackedLinear`)."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([m.weight for m in parts])
        bias = None if self.q_proj.bias is None else torch.cat([m.bias for m in parts])
        self.qkv = PackedLinear(weight, bias, dtype=dtype, kernels=kernels)

    def forward(
        self, layer: int, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend, fused_ops: bool = False
    ) -> Tensor:
        """``fused_ops`` (needs :meth:`fuse`): RoPE rotates q and k inside the q/k/v GEMM's
        output in one C call (:func:`parrot.engine.kernels.fused.rope_`)."""
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv is not None and fused_ops:
            qkv = self.qkv(x)  # [T, D_model] -> [T, (H + 2 Hkv) * Dh], fp32
            fused.rope_(qkv, h + kvh, cos, sin)  # q and k heads rotated in place
            q = qkv[:, : h * d].view(t, h, d)  # [T, H, Dh]
            k = qkv[:, h * d : (h + kvh) * d].view(t, kvh, d)  # [T, Hkv, Dh]
            v = qkv[:, (h + kvh) * d :].view(t, kvh, d)  # [T, Hkv, Dh]
        elif self.qkv is not None:
            qkv = self.qkv(x)  # [T, D_model] -> [T, (H + 2 Hkv) * Dh]
            qk = apply_rope(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), cos, sin)  # [T, H + Hkv, Dh]
            q, k = qk[:, :h], qk[:, h:]  # [T, H, Dh], [T, Hkv, Dh]
            v = qkv[:, (h + kvh) * d :].view(t, kvh, d)  # [T, Hkv, Dh]
        else:
            q = apply_rope(self.q_proj(x).view(t, h, d), cos, sin)  # [T, D_model] -> [T, H, Dh]
            k = apply_rope(self.k_proj(x).view(t, kvh, d), cos, sin)  # [T, D_model] -> [T, Hkv, Dh]
            v = self.v_proj(x).view(t, kvh, d)  # [T, D_model] -> [T, Hkv, Dh]
        out = attn(layer, q, k, v)  # [T, H, Dh]
        if out.shape != q.shape:
            raise ValueError(
                f"attention backend returned shape {tuple(out.shape)}, expected {tuple(q.shape)}"
            )
        return self.o_proj(out.reshape(t, h * d))  # [T, H*Dh] -> [T, D_model]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)).

    After :meth:`fuse`, gate and up are one packed GEMM, and the MLP computes in
    the packed dtype: with bf16 weights its input is rounded to bf16 once and it
    returns bf16 (the caller's residual add promotes back to fp32).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Projection(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Projection(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Projection(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up: PackedLinear | None = None  # set by fuse()

    def fuse(self, dtype: torch.dtype, kernels: KernelSet | None = None) -> None:
        """Pack gate and up as one ``dtype`` weight [2 * intermediate, hidden] (with
        the C kernel copies of ``kernels``, see :class:`PackedLinear`)."""
        weight = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        self.gate_up = PackedLinear(weight, dtype=dtype, kernels=kernels)

    def forward(self, x: Tensor, fused_ops: bool = False) -> Tensor:
        """``fused_ops`` (needs :meth:`fuse`): ``silu(gate) * up`` in one C call
        (:func:`parrot.engine.kernels.fused.silu_mul`)."""
        if self.gate_up is not None:
            inter = self.gate_proj.out_features
            gu = self.gate_up(x.to(self.gate_up.dtype))  # [T, D] -> [T, 2I], in the packed dtype
            if fused_ops:
                return self.down_proj(fused.silu_mul(gu))  # [T, I] -> [T, D]
            return self.down_proj(F.silu(gu[:, :inter]) * gu[:, inter:])  # [T, I] -> [T, D]
        # x: [T, D] -> gate, up: [T, I] -> [T, I] -> [T, D]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, layer: int, h: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend) -> Tensor:
        h = h + self.self_attn(layer, self.input_layernorm(h), cos, sin, attn)  # [T, D]
        return h + self.mlp(self.post_attention_layernorm(h))  # [T, D]


class _Body(nn.Module):
    """Holds the ``model.*`` parameters (HF naming)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# --------------------------------------------------------------------------- model


class LlamaModel(nn.Module):
    """The decoder.  ``lm_head`` is ``None`` when embeddings are tied.

    ``forward`` is pure with respect to the module (all state lives in the
    attention backend), so one model can serve any number of batches.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Body(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Projection(config.hidden_size, config.vocab_size, bias=False)
        )
        self._inv_freq = rope_inv_freq(config)  # [Dh/2], plain attribute: not a checkpoint entry
        self._packed_logits: PackedLinear | None = None  # set by prepack()
        # what the C decode forward derives from the packed layers (its layer table), kept
        # with the model it describes; owned by parrot.engine.kernels.decode_forward
        self.decode_tables: object | None = None

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """Hidden states [T, hidden_size] (after the final norm) of the T new tokens."""
        self.check_inputs(input_ids, positions)
        inv_freq = self._inv_freq.to(input_ids.device)
        cos, sin = rope_cos_sin(inv_freq, positions)  # [T, Dh] each, fp32
        h = self.model.embed_tokens(input_ids)  # [T] -> [T, D]
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)  # q, k stay in the weights' dtype (fp16/bf16 on CUDA)
        if self.model.layers[0].self_attn.qkv is not None and fused.applies(h):
            return self._forward_fused(h, cos, sin, attn)
        for i, layer in enumerate(self.model.layers):
            h = layer(i, h, cos, sin, attn)  # [T, D]
        return self.model.norm(h)  # [T, D]

    def check_inputs(self, input_ids: Tensor, positions: Tensor) -> None:
        """Raise ValueError unless ``input_ids`` is a non-empty 1-D int64 tensor of ids in
        the vocabulary and ``positions`` an int64 tensor like it, within the context."""
        if input_ids.dim() != 1 or input_ids.dtype != torch.long:
            raise ValueError(
                f"input_ids must be a 1-D int64 tensor, got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        if positions.shape != input_ids.shape or positions.dtype != torch.long:
            raise ValueError("positions must be an int64 tensor shaped like input_ids")
        if input_ids.numel() == 0:
            raise ValueError("forward needs at least one token")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"token id out of range [0, {self.config.vocab_size}): {lo if lo < 0 else hi}")
        if int(positions.min()) < 0 or int(positions.max()) >= self.config.max_seq_len:
            raise ValueError(f"positions must lie in [0, {self.config.max_seq_len})")

    def _forward_fused(self, h: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend) -> Tensor:
        """The layers with their elementwise steps fused (:mod:`parrot.engine.kernels.fused`); the
        same function as the plain loop up to rounding order.  ``h`` (a fresh tensor) is
        the residual stream, updated in place: each residual add is fused with the
        RMSNorm that follows it (the MLP's with the next layer's input norm, the last
        one's with the final norm), which also casts for the next GEMM."""
        layers = self.model.layers
        first = layers[0].input_layernorm
        x = fused.add_rms_norm(h, None, first.weight, first.eps)  # [T, D]
        for i, layer in enumerate(layers):
            a = layer.self_attn(i, x, cos, sin, attn, fused_ops=True)  # [T, D]
            post, mlp = layer.post_attention_layernorm, layer.mlp
            mlp_dtype = torch.float32 if mlp.gate_up is None else mlp.gate_up.dtype
            x = fused.add_rms_norm(h, a, post.weight, post.eps, mlp_dtype)  # h += a; x = norm(h)
            m = mlp(x, fused_ops=True)  # [T, D]
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x = fused.add_rms_norm(h, m, nxt.weight, nxt.eps)  # h += m; x = norm(h)
        return x  # [T, D]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Logits [N, vocab_size] float32 from hidden states [N, hidden_size]."""
        if hidden.dim() != 2 or hidden.shape[1] != self.config.hidden_size:
            raise ValueError(f"hidden must be [N, {self.config.hidden_size}], got {tuple(hidden.shape)}")
        if self._packed_logits is not None:
            return self._packed_logits(hidden).float()
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [V, D]
        return F.linear(hidden, weight).float()  # [N, D] @ [D, V] -> [N, V]

    def prepack(self, dtype: torch.dtype | None = None, kernels: KernelSet | None = None) -> bool:
        """Run every projection (and the logits) through oneDNN-packed weights of ``dtype``
        (default: the weights' own) when this model's weights allow it (CPU, fp32/bf16),
        with the C kernel copies of ``kernels`` (default: every kernel allowed);
        see :mod:`parrot.engine.kernels.packed_linear`.  q/k/v and gate/up are packed fused
        (one GEMM each per layer); ``o_proj`` and ``down_proj`` alone.  Idempotent for one
        ``dtype``; returns whether the model now runs packed."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        want = weight.dtype if dtype is None else dtype
        if not packed_linear_available(weight, want):
            return False
        kernels = for_options() if kernels is None else kernels
        fused: list[nn.Module] = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv is None or attn.qkv.dtype != want or attn.qkv.key != kernels.linear_key():
                attn.fuse(want, kernels)
            if mlp.gate_up is None or mlp.gate_up.dtype != want or mlp.gate_up.key != kernels.linear_key():
                mlp.fuse(want, kernels)
            fused += [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        prepack_linears(self, dtype, exclude=fused, kernels=kernels)
        logits = self._packed_logits
        if logits is None or logits.dtype != want or logits.key != kernels.linear_key():
            self._packed_logits = PackedLinear(weight, dtype=want, kernels=kernels)
        return True

    # -- construction ------------------------------------------------------

    @classmethod
    def random_init(cls, config: ModelConfig, seed: int = 0) -> LlamaModel:
        """Deterministic random weights (same config + seed -> same weights), eval mode, no grads."""
        with torch.device("meta"):
            model = cls(config)
        gen = torch.Generator().manual_seed(seed)
        state = {}
        for name, p in model.named_parameters():
            t = torch.empty(p.shape, dtype=torch.float32)
            if name.endswith("norm.weight"):
                t.normal_(1.0, 0.1, generator=gen)  # not all-ones, so loaders are really tested
            else:
                t.normal_(0.0, 0.02, generator=gen)
            state[name] = t
        return cls.from_state_dict(config, state)

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state_dict: Mapping[str, Tensor]) -> LlamaModel:
        """Build from HF-named tensors; strict.

        Missing or unexpected keys, or shape mismatches, raise ValueError naming
        them.  Tolerated extras: ``*.rotary_emb.inv_freq`` buffers of old
        checkpoints, and ``lm_head.weight`` of a tied model when it equals the
        embedding.  Tensors are converted to fp32; the result is in eval mode
        with ``requires_grad=False``.
        """
        with torch.device("meta"):
            model = cls(config)
        expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
        given = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.tie_word_embeddings and "lm_head.weight" in given:
            head, emb = given.pop("lm_head.weight"), given.get("model.embed_tokens.weight")
            if emb is None or not torch.equal(head.float(), emb.float()):
                raise ValueError("unexpected key 'lm_head.weight': the model ties embeddings but it differs")
        missing = sorted(set(expected) - set(given))
        unexpected = sorted(set(given) - set(expected))
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing keys {missing}, unexpected keys {unexpected}")
        wrong = [
            f"{k}: expected {expected[k]}, got {tuple(given[k].shape)}"
            for k in expected
            if tuple(given[k].shape) != expected[k]
        ]
        if wrong:
            raise ValueError("state dict shape mismatch: " + "; ".join(wrong))
        tensors = {k: given[k].detach().to(device="cpu", dtype=torch.float32).contiguous() for k in expected}
        model.load_state_dict(tensors, strict=True, assign=True)
        model.requires_grad_(False)
        return model.eval()


def random_init(config: ModelConfig, seed: int = 0) -> LlamaModel:
    """See :meth:`LlamaModel.random_init`."""
    return LlamaModel.random_init(config, seed)


# --------------------------------------------------------------------------- reference backend


class ContiguousKVCache:
    """Per-sequence, per-layer contiguous K/V tensors: ``[len, num_kv_heads, head_dim]``.

    Invariant: every layer of a sequence holds the same number of tokens after a
    full forward step.
    """

    def __init__(self, num_layers: int) -> None:
        if num_layers <= 0:
            raise ValueError("num_layers must be positive")
        self.num_layers = num_layers
        self._k: dict[Hashable, list[Tensor | None]] = {}
        self._v: dict[Hashable, list[Tensor | None]] = {}

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._k

    def length(self, seq_id: Hashable) -> int:
        """Tokens cached for ``seq_id`` (in layer 0); 0 for unknown sequences."""
        ks = self._k.get(seq_id)
        return 0 if ks is None or ks[0] is None else ks[0].shape[0]

    def append(self, seq_id: Hashable, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k, v [n, Hkv, Dh] to a layer; return the full K, V [past + n, Hkv, Dh]."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        ks = self._k.setdefault(seq_id, [None] * self.num_layers)
        vs = self._v.setdefault(seq_id, [None] * self.num_layers)
        old_k, old_v = ks[layer], vs[layer]
        ks[layer] = k.clone() if old_k is None else torch.cat((old_k, k), dim=0)  # [S, Hkv, Dh]
        vs[layer] = v.clone() if old_v is None else torch.cat((old_v, v), dim=0)  # [S, Hkv, Dh]
        return ks[layer], vs[layer]  # type: ignore[return-value]

    def free(self, seq_id: Hashable) -> None:
        self._k.pop(seq_id, None)
        self._v.pop(seq_id, None)


class ContiguousKVAttention:
    """Reference :class:`AttentionBackend` for one step.

    Built per step with the sequences of the batch, in the order their new
    tokens are concatenated, and how many new tokens each has.  New tokens of a
    sequence are assumed to follow its cached tokens (positions ``past ..
    past + n - 1``).
    """

    def __init__(
        self, cache: ContiguousKVCache, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]
    ) -> None:
        if len(seq_ids) != len(num_new_tokens):
            raise ValueError("seq_ids and num_new_tokens differ in length")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a sequence appears twice in one step")
        if any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in num_new_tokens):
            raise ValueError("num_new_tokens must be positive integers")
        self.cache = cache
        self.seq_ids = list(seq_ids)
        self.num_new_tokens = list(num_new_tokens)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        total = sum(self.num_new_tokens)
        if q.shape[0] != total or k.shape[0] != total or v.shape[0] != total:
            raise ValueError(
                f"step has {total} new tokens but q/k/v have {q.shape[0]}/{k.shape[0]}/{v.shape[0]}"
            )
        n_heads, n_kv, head_dim = q.shape[1], k.shape[1], q.shape[2]
        if n_heads % n_kv:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        group = n_heads // n_kv
        outs = []
        for seq_id, q_s, k_s, v_s in zip(
            self.seq_ids,
            q.split(self.num_new_tokens),  # [n, H, Dh] each
            k.split(self.num_new_tokens),  # [n, Hkv, Dh] each
            v.split(self.num_new_tokens),
            strict=True,
        ):
            n = q_s.shape[0]
            keys, values = self.cache.append(seq_id, layer, k_s, v_s)  # [S, Hkv, Dh] each, S = past + n
            s = keys.shape[0]
            keys = keys.repeat_interleave(group, dim=1)  # [S, H, Dh]
            values = values.repeat_interleave(group, dim=1)  # [S, H, Dh]
            # query i sits at position past + i and sees keys 0 .. past + i
            q_pos = torch.arange(s - n, s, device=q.device)[:, None]  # [n, 1]
            mask = torch.arange(s, device=q.device)[None, :] <= q_pos  # [n, S] bool
            out = F.scaled_dot_product_attention(
                q_s.transpose(0, 1),  # [H, n, Dh]
                keys.transpose(0, 1),  # [H, S, Dh]
                values.transpose(0, 1),  # [H, S, Dh]
                attn_mask=mask,  # [n, S] broadcast over heads
                scale=1.0 / math.sqrt(head_dim),
            )  # [H, n, Dh]
            outs.append(out.transpose(0, 1))  # [n, H, Dh]
        return torch.cat(outs, dim=0)  # [T, H, Dh]

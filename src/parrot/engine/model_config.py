"""A LLaMA-family model's shape and options (:class:`ModelConfig`), read from and written
to Hugging Face ``config.json`` dictionaries.  No torch."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from parrot.protocol.tokenizer import TINY_VOCAB_SIZE

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_SCALING", "ModelConfig"]

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_SCALING = ("linear", "llama3")


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a decoder.

    Invariants (checked on construction): all sizes positive;
    ``num_heads % num_kv_heads == 0``; ``head_dim`` even; ``rope_scaling`` is
    ``None`` or a dict whose ``"rope_type"`` is ``"linear"`` (needs ``factor``)
    or ``"llama3"`` (needs ``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``).
    ``attention_bias`` means bias on q/k/v projections (Qwen2 style), never on o_proj.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_seq_len: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")
        object.__setattr__(self, "rope_scaling", _normalise_rope_scaling(self.rope_scaling))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def tiny(cls) -> ModelConfig:
        """The tiny random test model, sized for the byte-level tiny tokenizer."""
        return cls(
            vocab_size=TINY_VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_seq_len=2048,
        )

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """From a Hugging Face ``config.json`` dict (Llama / Mistral / Qwen2)."""
        if not isinstance(cfg, Mapping):
            raise ValueError("from_hf_config takes the config.json dict")
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        model_type = SUPPORTED_ARCHITECTURES[arch] if arch else cfg.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(
                f"unsupported architecture {archs or model_type!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only 'silu')")
        if model_type != "qwen2" and cfg.get("attention_bias"):
            raise ValueError("attention_bias on a Llama/Mistral model (biased o_proj) is not supported")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias is not supported")

        def need(key: str) -> Any:
            if key not in cfg:
                raise ValueError(f"config.json lacks {key!r}")
            return cfg[key]

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else None
        rope_theta = (rope or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = rope if rope is not None else cfg.get("rope_scaling")
        max_len = cfg.get("max_position_embeddings", 2048)
        window = cfg.get("sliding_window")
        if window and (model_type == "mistral" or cfg.get("use_sliding_window")):
            max_len = min(max_len, window)  # within the window, full attention is exact
        head_dim = cfg.get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else 0)
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=dict(scaling) if scaling else None,
            max_seq_len=max_len,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2",
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict; ``from_hf_config(c.to_hf_config()) == c``."""
        qwen = self.attention_bias
        cfg: dict[str, Any] = {
            "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "float32",
        }
        cfg.update({"use_sliding_window": False} if qwen else {"attention_bias": False, "mlp_bias": False})
        return cfg

    def replace(self, **changes: Any) -> ModelConfig:
        data = {f.name: getattr(self, f.name) for f in fields(self)} | changes
        return ModelConfig(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _normalise_rope_scaling(scaling: Any) -> dict[str, Any] | None:
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise ValueError(f"rope_scaling must be a dict or None, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in SUPPORTED_ROPE_SCALING:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {SUPPORTED_ROPE_SCALING}")
    keys = ("factor",) + (
        ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if kind == "llama3"
        else ()
    )
    out: dict[str, Any] = {"rope_type": kind}
    for key in keys:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"rope_scaling {kind!r} needs a positive {key!r}, got {value!r}")
        out[key] = value
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("rope_scaling llama3 needs high_freq_factor > low_freq_factor")
    return out

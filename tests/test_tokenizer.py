"""TextTokenizer: builders, chat formats, transport as a dict, incremental decoding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parrot.protocol.tokenizer import (
    TINY_VOCAB_SIZE,
    ChatFormat,
    IncrementalDecoder,
    TextTokenizer,
    detect_chat_format,
)

UNICODE = "naïve café — 日本語のテキスト 🦜🇫🇷 Ωμέγα ∑x² 𝔘𝔫𝔦"


@pytest.fixture(scope="module")
def tiny() -> TextTokenizer:
    return TextTokenizer.byte_level_tiny()


@pytest.fixture(scope="module")
def smol() -> TextTokenizer:
    from gguf import GGUFReader

    from parrot.engine.loader import smollm2_gguf_path

    return TextTokenizer.from_gguf_metadata(GGUFReader(str(smollm2_gguf_path())))


def _stream(tok: TextTokenizer, ids: list[int], **kw: bool) -> list[str]:
    dec = IncrementalDecoder(tok, **kw)
    return [dec.push(i) for i in ids] + [dec.flush()]


def test_module_import_is_cheap() -> None:
    code = "import sys, parrot.protocol.tokenizer; print('tokenizers' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# --------------------------------------------------------------------------- tiny byte-level


def test_byte_level_tiny(tiny: TextTokenizer) -> None:
    assert tiny.vocab_size == TINY_VOCAB_SIZE == 259
    text = "Hi! " + UNICODE
    assert tiny.encode(text) == list(text.encode("utf-8"))
    assert tiny.decode(tiny.encode(text)) == text
    specials = [tiny.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    assert specials == [256, 257, 258]
    assert tiny.eos_token_ids[0] == 256 and 258 in tiny.eos_token_ids
    assert tiny.encode("a<|im_start|>b") == [97, 257, 98]
    assert tiny.decode([97, 257, 98]) == "ab"
    assert tiny.decode([97, 257, 98], skip_special_tokens=False) == "a<|im_start|>b"
    assert tiny.is_special(257) and not tiny.is_special(97)
    assert tiny.bos_token_id is None and not tiny.add_bos
    assert tiny.chat == ChatFormat.chatml()


def test_encode_decode_validate(tiny: TextTokenizer) -> None:
    with pytest.raises(ValueError, match="string"):
        tiny.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token id"):
        tiny.decode([TINY_VOCAB_SIZE])
    with pytest.raises(ValueError, match="token id"):
        tiny.decode([-1])


def test_dict_round_trip_through_json(tiny: TextTokenizer) -> None:
    data = json.loads(json.dumps(tiny.to_dict()))
    copy = TextTokenizer.from_dict(data)
    text = "<|im_start|>user\n" + UNICODE
    assert copy.encode(text) == tiny.encode(text)
    assert (copy.eos_token_ids, copy.bos_token_id, copy.add_bos, copy.chat, copy.vocab_size) == (
        tiny.eos_token_ids,
        tiny.bos_token_id,
        tiny.add_bos,
        tiny.chat,
        tiny.vocab_size,
    )
    assert copy.chat_template == tiny.chat_template and "im_start" in (copy.chat_template or "")


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d.pop("format"), "format"),
        (lambda d: d.update(tokenizer_json="{not json"), r"tokenizer\.json"),
        (lambda d: d.update(eos_token_ids=[10_000]), "eos_token_ids"),
        (lambda d: d.update(add_bos=True), "bos_token_id"),
        (lambda d: d.update(chat={"user_prefix": "x"}), "chat"),
        (lambda d: d.update(chat_template=["not", "a", "string"]), "chat_template"),
    ],
)
def test_from_dict_rejects(tiny: TextTokenizer, mutate, needle: str) -> None:
    data = tiny.to_dict()
    mutate(data)
    with pytest.raises(ValueError, match=needle):
        TextTokenizer.from_dict(data)


# --------------------------------------------------------------------------- chat formats


def test_chatml_wrap() -> None:
    before, between = ChatFormat.chatml().wrap("What?")
    assert (before, between) == ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    before, between = ChatFormat.chatml("Be brief.").wrap("What?")
    assert before == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    assert between == "<|im_end|>\n<|im_start|>assistant\n"
    assert ChatFormat.chatml().wrap() == ChatFormat.chatml().wrap("anything")


def test_llama3_and_inst_wrap() -> None:
    before, between = ChatFormat.llama3("S").wrap("p")
    assert before == (
        "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
    )
    assert between == "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    assert ChatFormat.inst().wrap("p") == ("[INST] ", " [/INST]")


def test_detect_chat_format() -> None:
    smol_template = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
        " + '<|im_end|>' + '\n'}}{% endfor %}"
    )
    chat = detect_chat_format(["a", "<|im_start|>"], smol_template)
    assert chat == ChatFormat.chatml("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
    assert detect_chat_format(["<|im_start|>"]) == ChatFormat.chatml()
    assert detect_chat_format(["<|start_header_id|>", "<|eot_id|>"]) == ChatFormat.llama3()
    assert detect_chat_format(["[INST]"]) == ChatFormat.inst()
    assert (
        detect_chat_format(["<s>"], "{{ '[INST] ' + message['content'] + ' [/INST]' }}") == ChatFormat.inst()
    )
    assert detect_chat_format(["a", "b"]) is None


def test_chat_format_validates() -> None:
    with pytest.raises(ValueError, match="user_prefix"):
        ChatFormat(system_prefix="", user_prefix=None, assistant_prefix="", turn_end="")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- HF folder


def test_from_hf_dir(tmp_path: Path, tiny: TextTokenizer) -> None:
    (tmp_path / "tokenizer.json").write_text(tiny.to_dict()["tokenizer_json"], encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|im_start|>"},
                "eos_token": "<|endoftext|>",
                "add_bos_token": True,
                "chat_template": "{{ '<|im_start|>system\\nBe nice.<|im_end|>\\n' }}",
            }
        ),
        encoding="utf-8",
    )
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [256, 65]}), encoding="utf-8"
    )
    tok = TextTokenizer.from_hf_dir(tmp_path)
    assert tok.bos_token_id == 257 and tok.add_bos
    assert tok.eos_token_ids == (256, 65, 258)  # config eos, generation eos, ChatML turn end
    assert tok.chat == ChatFormat.chatml("Be nice.")
    assert tok.encode("hi") == [104, 105]  # encode never adds BOS; callers prepend it once


def test_from_hf_dir_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        TextTokenizer.from_hf_dir(tmp_path)


# --------------------------------------------------------------------------- incremental decoding


def test_incremental_decoder_unicode_tiny(tiny: TextTokenizer) -> None:
    ids = tiny.encode(UNICODE)
    assert len(ids) > len(UNICODE)  # really multi-byte
    deltas = _stream(tiny, ids)
    assert "".join(deltas) == tiny.decode(ids) == UNICODE
    assert all("\ufffd" not in d for d in deltas)
    assert "🦜" in deltas  # a 4-byte character comes out whole, once complete
    assert deltas.count("") >= len(ids) - len(UNICODE)  # partial characters were held back


def test_incremental_decoder_truncated_character(tiny: TextTokenizer) -> None:
    ids = tiny.encode("ok 🦜")[:-2]  # cut inside the parrot's 4 bytes
    deltas = _stream(tiny, ids)
    assert deltas[-1] == tiny.decode(ids)[3:] and "\ufffd" in deltas[-1]  # only flush() emits it
    assert "".join(deltas) == tiny.decode(ids)


def test_incremental_decoder_specials(tiny: TextTokenizer) -> None:
    ids = tiny.encode("a<|im_end|>é")
    assert "".join(_stream(tiny, ids)) == "aé"
    assert "".join(_stream(tiny, ids, skip_special_tokens=False)) == "a<|im_end|>é"


# --------------------------------------------------------------------------- SmolLM2's GGUF tokenizer


@pytest.mark.slow
def test_gguf_tokenizer_round_trips(smol: TextTokenizer) -> None:
    assert smol.vocab_size == 49152
    for text in (
        "The quick brown fox jumps over the lazy dog.",
        "In 2024, 1234567 + 89 = 1234656.",
        UNICODE,
        "  leading spaces,\ttabs\nand newlines\n\n",
    ):
        ids = smol.encode(text)
        assert smol.decode(ids) == text
        assert "".join(_stream(smol, ids)) == text
    english = smol.encode("The quick brown fox jumps over the lazy dog.")
    assert len(english) < 15  # real BPE merges, not bytes
    digits = [smol.id_to_token(i) for i in smol.encode("year 2024")]
    assert digits[-4:] == ["2", "0", "2", "4"]  # SmolLM splits digits individually


@pytest.mark.slow
def test_gguf_tokenizer_specials_and_chat(smol: TextTokenizer) -> None:
    im_start = smol.encode("<|im_start|>")
    assert im_start == [1] and smol.is_special(1)
    assert smol.encode("<|im_start|>user\nHi<|im_end|>")[0] == 1
    assert smol.encode("<|im_start|>user\nHi<|im_end|>")[-1] == 2
    assert 2 in smol.eos_token_ids and smol.bos_token_id == 1 and not smol.add_bos
    assert smol.chat is not None and smol.chat.user_prefix == "<|im_start|>user\n"
    assert smol.chat.default_system and "SmolLM" in smol.chat.default_system
    copy = TextTokenizer.from_dict(json.loads(json.dumps(smol.to_dict())))
    assert copy.encode(UNICODE) == smol.encode(UNICODE) and copy.chat == smol.chat
    assert (
        smol.chat_template and "im_start" in smol.chat_template and copy.chat_template == smol.chat_template
    )

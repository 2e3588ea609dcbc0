"""Deterministic English-like filler text of a controlled token length.

The evaluation suite needs long documents, system prompts and user queries of
known sizes, without downloading data sets and without loading a tokenizer at
run time.  Text here is built from short sentence patterns filled with words
from small fixed vocabularies, so its token count is, to a few percent, a fixed
multiple of its word count (:data:`TOKENS_PER_WORD`).

Invariants:

* every function is a pure function of its arguments; an ``int`` seed and a
  ``random.Random`` seeded with it give the same text, and a passed-in
  ``random.Random`` is advanced (so successive calls give different text);
* ``filler(rng, n)`` has exactly ``words_for_tokens(n)`` words, hence
  ``estimate_tokens(filler(rng, n))`` is within one word's worth of ``n``;
* the text contains no ``{{`` or ``}}``, so it is safe inside a Parrot template.
"""

from __future__ import annotations

import math
import random

__all__ = ["TOKENS_PER_WORD", "estimate_tokens", "filler", "make_rng", "words_for_tokens"]

#: SmolLM2 tokens per whitespace-separated word of :func:`filler` output, punctuation included.
#: Measured once with SmolLM2-135M-Instruct's tokenizer
#: (``parrot.engine.loader.load_model("smollm2").tokenizer.encode``, no BOS) over
#: ``filler(seed, 2000)`` for seeds 0..49 (about 89,000 words): mean 1.1283 tokens/word, per-text
#: range 1.121–1.138; texts of 256-1,500 target tokens came out within 1% of the target.
#: Rerun ``python -m benchmarks.suite.textgen`` to re-measure after changing the vocabularies.
TOKENS_PER_WORD = 1.128

# fmt: off
_ADJECTIVES = (
    "small", "large", "early", "late", "simple", "complex", "local", "global", "public", "private",
    "recent", "common", "general", "special", "new", "old", "main", "final", "basic", "clear", "strong",
    "weak", "high", "low", "long", "short", "open", "free", "full", "major", "minor", "real", "natural",
    "social", "human", "political", "economic", "financial", "legal", "medical", "technical", "modern",
    "central", "national", "different", "similar", "important", "possible", "available", "current",
    "physical", "personal", "single", "various"
)
_NOUNS = (
    "system", "model", "method", "result", "study", "process", "problem", "question", "answer", "report",
    "market", "company", "policy", "program", "network", "data", "value", "group", "table", "paper",
    "theory", "effect", "level", "change", "growth", "service", "product", "design", "project", "research",
    "energy", "water", "city", "country", "government", "team", "student", "teacher", "school", "family",
    "history", "story", "building", "machine", "engine", "signal", "image", "record", "price", "cost",
    "rate", "plan", "goal", "field", "region", "community", "computer", "language", "structure", "function",
    "section", "chapter", "period", "season", "river", "mountain"
)
_VERBS = (
    "describes", "improves", "changes", "supports", "reduces", "increases", "shows", "explains", "follows",
    "creates", "requires", "measures", "provides", "includes", "affects", "compares", "builds", "reaches",
    "uses", "covers", "finds", "keeps", "moves", "opens", "leads", "controls", "produces", "replaces",
    "tests", "reports"
)
_ADVERBS = (
    "quickly", "slowly", "often", "rarely", "clearly", "directly", "usually", "finally", "largely", "mostly"
)
_PREPOSITIONS = (
    "in", "on", "for", "with", "from", "about", "across", "during", "under", "near", "within", "without"
)
_CONNECTIVES = (
    "However,", "Moreover,", "In practice,", "As a result,", "For example,", "Later,", "Meanwhile,"
)
_DETERMINERS = ("the", "the", "a", "this", "each", "every", "one", "our")
# fmt: on


def make_rng(seed_or_rng: int | random.Random) -> random.Random:
    """A ``random.Random``: the one given, or a fresh one seeded with the given int."""
    if isinstance(seed_or_rng, random.Random):
        return seed_or_rng
    if isinstance(seed_or_rng, bool) or not isinstance(seed_or_rng, int):
        raise TypeError(f"expected an int seed or random.Random, got {type(seed_or_rng).__name__}")
    return random.Random(seed_or_rng)


def words_for_tokens(n_tokens: int) -> int:
    """Number of filler words whose expected token count is ``n_tokens`` (at least 1 for ``n >= 1``)."""
    if n_tokens < 0:
        raise ValueError(f"token count must be >= 0, got {n_tokens}")
    if n_tokens == 0:
        return 0
    return max(1, round(n_tokens / TOKENS_PER_WORD))


def estimate_tokens(text: str) -> int:
    """Estimated SmolLM2 token count of filler-like ``text`` (word count times :data:`TOKENS_PER_WORD`)."""
    return math.ceil(len(text.split()) * TOKENS_PER_WORD)


def _noun_phrase(rng: random.Random) -> list[str]:
    words = [rng.choice(_DETERMINERS)]
    if rng.random() < 0.6:
        words.append(rng.choice(_ADJECTIVES))
    words.append(rng.choice(_NOUNS))
    return words


def _sentence(rng: random.Random) -> list[str]:
    """One sentence as a list of words; the first is capitalised and the last ends with '.'."""
    words: list[str] = []
    if rng.random() < 0.2:
        words += rng.choice(_CONNECTIVES).split()
    words += _noun_phrase(rng)
    if rng.random() < 0.3:
        words.append(rng.choice(_ADVERBS))
    words.append(rng.choice(_VERBS))
    words += _noun_phrase(rng)
    if rng.random() < 0.7:
        words.append(rng.choice(_PREPOSITIONS))
        words += _noun_phrase(rng)
    words[0] = words[0][0].upper() + words[0][1:]
    words[-1] += "."
    return words


def filler(seed_or_rng: int | random.Random, n_tokens: int) -> str:
    """English-like text of about ``n_tokens`` SmolLM2 tokens (exactly ``words_for_tokens(n)`` words).

    The last sentence may be cut short to hit the word count; the text always
    ends with a period when it is non-empty.
    """
    rng = make_rng(seed_or_rng)
    target = words_for_tokens(n_tokens)
    words: list[str] = []
    while len(words) < target:
        words += _sentence(rng)
    words = words[:target]
    if words and not words[-1].endswith("."):
        words[-1] = words[-1].rstrip(",") + "."
    return " ".join(words)


def _measure(n_texts: int = 50, n_tokens: int = 2000) -> None:  # pragma: no cover - needs the model
    """Print the measured tokens/word ratio of :func:`filler` (loads the SmolLM2 tokenizer)."""
    from parrot.engine.loader import load_model

    tok = load_model("smollm2").tokenizer
    ratios = []
    for seed in range(n_texts):
        text = filler(seed, n_tokens)
        ratios.append(len(tok.encode(text)) / len(text.split()))
    mean = sum(ratios) / len(ratios)
    print(f"tokens/word over {n_texts} texts: mean {mean:.4f}, min {min(ratios):.4f}, max {max(ratios):.4f}")


if __name__ == "__main__":  # pragma: no cover
    _measure()

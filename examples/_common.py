"""Shared helpers for the examples: arguments, chunking, printing the result.

Not an example itself; the example apps import it.
"""

import argparse
import itertools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _two_ways import DEFAULT_DELAY_MS, Comparison, report

import parrot as P

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_FILE = DATA_DIR / "lighthouses.txt"
DEFAULT_URL = "http://127.0.0.1:9000"
DEFAULT_CHUNK_WORDS = 350
DEFAULT_MAX_TOKENS = 90

_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def base_parser(description: str) -> argparse.ArgumentParser:
    """The options every example takes: ``--url`` and ``--delay-ms``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default=DEFAULT_URL, help=f"Parrot server URL (default {DEFAULT_URL})")
    parser.add_argument(
        "--delay-ms",
        type=float,
        default=DEFAULT_DELAY_MS,
        help="emulated network round trip per HTTP request, paid by both ways "
        f"(default {DEFAULT_DELAY_MS:g})",
    )
    return parser


def check_base_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.delay_ms < 0:
        parser.error("--delay-ms cannot be negative")


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The summarisation apps' command line: ``--url``, ``--delay-ms``, ``--file``,
    ``--chunk-words``, ``--max-tokens``."""
    parser = base_parser(description)
    parser.add_argument(
        "--file",
        type=Path,
        default=DEFAULT_FILE,
        help="text file to summarise; paragraphs separated by blank lines (default: the lighthouse essay)",
    )
    parser.add_argument(
        "--chunk-words",
        type=int,
        default=DEFAULT_CHUNK_WORDS,
        help=f"target chunk size in words, split on paragraph boundaries (default {DEFAULT_CHUNK_WORDS})",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"max tokens generated per summary (default {DEFAULT_MAX_TOKENS})",
    )
    args = parser.parse_args(argv)
    check_base_args(parser, args)
    if args.chunk_words < 1:
        parser.error("--chunk-words must be positive")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be positive")
    return args


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def paragraphs(text: str) -> list[str]:
    """Paragraphs of ``text`` (separated by blank lines), whitespace normalised, empties dropped."""
    return [" ".join(p.split()) for p in _PARAGRAPH_BREAK.split(text) if p.strip()]


def _split_long(paragraph: str, chunk_words: int) -> list[str]:
    """Split a paragraph longer than ``chunk_words`` on sentence boundaries (a sentence is never cut)."""
    pieces: list[str] = []
    current: list[str] = []
    count = 0
    for sentence in _SENTENCE_END.split(paragraph):
        n = len(sentence.split())
        if current and count + n > chunk_words:
            pieces.append(" ".join(current))
            current, count = [], 0
        current.append(sentence)
        count += n
    if current:
        pieces.append(" ".join(current))
    return pieces


def chunk_text(text: str, chunk_words: int = DEFAULT_CHUNK_WORDS) -> list[str]:
    """Split ``text`` into chunks of about ``chunk_words`` words on paragraph boundaries.

    The number of chunks is the total word count over ``chunk_words``, rounded
    (at least one); paragraphs are then grouped, in order, so that the chunk sizes
    are as even as possible (least squared deviation from the mean), so no tiny
    leftover chunk trails at the end.  A single paragraph longer than
    ``chunk_words`` is first split on sentence boundaries.  Paragraphs inside a
    chunk stay separated by a blank line.
    """
    if chunk_words < 1:
        raise ValueError("chunk_words must be positive")
    units: list[str] = []
    for p in paragraphs(text):
        units.extend(_split_long(p, chunk_words) if len(p.split()) > chunk_words else [p])
    if not units:
        return []
    sizes = [len(u.split()) for u in units]
    n_chunks = min(len(units), max(1, round(sum(sizes) / chunk_words)))
    bounds = _even_partition(sizes, n_chunks)
    return ["\n\n".join(units[a:b]) for a, b in itertools.pairwise(bounds)]


def _even_partition(sizes: list[int], k: int) -> list[int]:
    """Boundaries ``0 = b0 < b1 < ... < bk = len(sizes)`` splitting ``sizes`` into ``k`` contiguous
    groups whose sums deviate least (squared) from their mean; dynamic programming."""
    n = len(sizes)
    prefix = [0]
    for x in sizes:
        prefix.append(prefix[-1] + x)
    mean = prefix[-1] / k
    inf = float("inf")
    # cost[j][i]: best cost of putting the first i units into j groups; back[j][i]: start of the last group.
    cost = [[inf] * (n + 1) for _ in range(k + 1)]
    back = [[0] * (n + 1) for _ in range(k + 1)]
    cost[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for start in range(i - 1, j - 2, -1):
                c = cost[j - 1][start] + (prefix[i] - prefix[start] - mean) ** 2
                if c < cost[j][i]:
                    cost[j][i], back[j][i] = c, start
                if prefix[i] - prefix[start] > 3 * mean:  # longer groups only get worse
                    break
    bounds = [n]
    for j in range(k, 0, -1):
        bounds.append(back[j][bounds[-1]])
    return bounds[::-1]


def word_count(text: str) -> int:
    return len(text.split())


def print_result(comparison: Comparison, what: str) -> None:
    """What every app prints at the end: the final value (both, if they differ), then the comparison."""
    parrot, request_level = comparison.parrot.value, comparison.request_level.value
    print()
    if comparison.equal:
        print(f"{what} (both ways):")
        print(parrot)
    else:
        print(f"{what} (Parrot):")
        print(parrot)
        print()
        print(f"{what} (request level):")
        print(request_level)
    print()
    print(report(comparison), flush=True)


def build_summarise(max_tokens: int) -> Callable[..., Any]:
    """The semantic function both apps start from: summarise one chunk in two sentences.

    The instruction comes after the text: SmolLM2-135M follows it far more
    reliably there than before a long passage."""

    @P.semantic_function(chat=True)
    def summarise(
        chunk: P.Input,
        summary: P.Output(max_tokens=max_tokens, temperature=0.0, transform=P.transforms.strip()),
    ):
        """{{chunk}}

        Summarise the text above in two sentences.
        {{summary}}"""

    return summarise

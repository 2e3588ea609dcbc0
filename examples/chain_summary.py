"""Chain summarisation with Parrot.

The text is split into chunks of about ``--chunk-words`` words on paragraph
boundaries.  The first chunk is summarised; every later chunk *refines* the
summary so far:

    summary_1 = summarise(chunk_1)
    summary_k = refine(summary_{k-1}, chunk_k)

Every call is submitted up front: each returns a semantic-variable future at
once, and passing a future into the next call wires the dependency on the
server, so the whole chain runs there without a client round trip between
steps.  Only the final summary is fetched.

The script runs the application twice on the same server and compares
(see ``_two_ways.py``): once as above, and once as a request-level client
that renders every prompt itself and sends one ``POST /v1/completions`` per
call, waiting for each answer before sending the call that needs it; every
HTTP request of both pays the same emulated network delay (``--delay-ms``).

Run (with a server up, e.g. ``parrot serve`` in another terminal)::

    python examples/chain_summary.py
    python examples/chain_summary.py --file my.txt --chunk-words 300 --max-tokens 100
"""

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # so `_common` imports however we are run
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import build_summarise, chunk_text, parse_args, print_result, read_text, word_count
from _two_ways import Comparison, compare

import parrot as P


def build_functions(max_tokens: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The two semantic functions of the chain, generating at most ``max_tokens`` each."""

    @P.semantic_function(chat=True)
    def refine(
        summary: P.Input,
        chunk: P.Input,
        new_summary: P.Output(max_tokens=max_tokens, temperature=0.0, transform=P.transforms.strip()),
    ):
        """{{summary}}

        {{chunk}}

        Summarise the text above in three sentences.
        {{new_summary}}"""

    return build_summarise(max_tokens), refine


def chain(summarise: Callable[..., Any], refine: Callable[..., Any], chunks: list[str]) -> Any:
    """The application: summarise the first chunk, refine with each next one.

    With the semantic functions themselves, each call returns a future at
    once and passing it on wires the dependency on the server; the returned
    summary is the only value fetched."""
    summary = summarise(chunks[0])
    for chunk in chunks[1:]:
        summary = refine(summary=summary, chunk=chunk)
    return summary


def main(argv: list[str] | None = None) -> Comparison:
    args = parse_args(
        "Chain summarisation: summarise the first chunk, then refine with each next chunk.", argv
    )
    text = read_text(args.file)
    chunks = chunk_text(text, args.chunk_words)
    if not chunks:
        sys.exit(f"{args.file}: no text to summarise")
    print(f"{args.file.name}: {word_count(text)} words in {len(chunks)} chunks", flush=True)

    summarise, refine = build_functions(args.max_tokens)
    comparison = compare(lambda way: chain(way(summarise), way(refine), chunks), args.url, args.delay_ms)
    print_result(comparison, "Final summary")
    return comparison


if __name__ == "__main__":
    main()

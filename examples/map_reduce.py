"""Map-reduce summarisation with Parrot.

The text is split into chunks of about ``--chunk-words`` words on paragraph
boundaries.  Map: every chunk is summarised independently, so the server can
run all of them at once.  Reduce: one call reads every chunk summary and
writes the final summary.

The reduce prompt needs one input per chunk, and a template's placeholders are
fixed, so it is built at run time with ``P.template_function`` from
``{{input:s0}}``, ``{{input:s1}}``, ... and ``{{output:summary}}``.  All calls
are submitted before anything is fetched; the reduce call depends on the map
outputs on the server, and only its output is fetched.

The script runs the application twice on the same server and compares
(see ``_two_ways.py``): once as above, and once as a request-level client
that renders every prompt itself and sends one ``POST /v1/completions`` per
call (the map calls concurrently, the reduce once their answers are back);
every HTTP request of both pays the same emulated network delay
(``--delay-ms``).

Run (with a server up, e.g. ``parrot serve`` in another terminal)::

    python examples/map_reduce.py
    python examples/map_reduce.py --file my.txt --chunk-words 300 --max-tokens 100
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


def reduce_template(n_parts: int) -> str:
    """The reduce prompt for ``n_parts`` chunk summaries: inputs ``s0``..``s{n-1}``, output ``summary``."""
    parts = "\n\n".join(f"{{{{input:s{i}}}}}" for i in range(n_parts))
    return f"{parts}\n\nSummarise the text above in four sentences.\n{{{{output:summary}}}}"


def build_reduce(n_parts: int, max_tokens: int) -> Callable[..., Any]:
    """The reduce step, with one input per chunk summary."""
    return P.template_function(
        reduce_template(n_parts),
        name=f"reduce_{n_parts}",
        chat=True,
        summary=P.Output(max_tokens=max_tokens, temperature=0.0, transform=P.transforms.strip()),
    )


def map_reduce(summarise: Callable[..., Any], reduce: Callable[..., Any], chunks: list[str]) -> Any:
    """The application: summarise every chunk (independent calls), then combine.

    With the semantic functions themselves, the map calls are submitted back
    to back and none is awaited; the reduce call is wired to every map output
    on the server, and its output is the only value fetched."""
    partials = [summarise(chunk) for chunk in chunks]
    return reduce(**{f"s{i}": v for i, v in enumerate(partials)})


def main(argv: list[str] | None = None) -> Comparison:
    args = parse_args("Map-reduce summarisation: summarise every chunk in parallel, then combine.", argv)
    text = read_text(args.file)
    chunks = chunk_text(text, args.chunk_words)
    if not chunks:
        sys.exit(f"{args.file}: no text to summarise")
    print(f"{args.file.name}: {word_count(text)} words in {len(chunks)} chunks", flush=True)

    summarise = build_summarise(args.max_tokens)
    reduce = build_reduce(len(chunks), args.max_tokens + args.max_tokens // 4)
    comparison = compare(lambda way: map_reduce(way(summarise), way(reduce), chunks), args.url, args.delay_ms)
    print_result(comparison, "Final summary")
    return comparison


if __name__ == "__main__":
    main()

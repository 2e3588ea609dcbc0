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

from _common import Timer, build_summarise, chunk_text, parse_args, print_result, read_text, word_count

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


def main() -> None:
    args = parse_args("Map-reduce summarisation: summarise every chunk in parallel, then combine.")
    text = read_text(args.file)
    chunks = chunk_text(text, args.chunk_words)
    if not chunks:
        sys.exit(f"{args.file}: no text to summarise")
    print(f"{args.file.name}: {word_count(text)} words in {len(chunks)} chunks", flush=True)

    summarise = build_summarise(args.max_tokens)
    reduce = build_reduce(len(chunks), args.max_tokens + args.max_tokens // 4)
    with Timer() as timer, P.connect(args.url):
        # Map: independent calls, submitted back to back; none is awaited.
        partials = [summarise(chunk) for chunk in chunks]
        # Reduce: wired to every map output on the server.
        final_var = reduce(**{f"s{i}": v for i, v in enumerate(partials)})
        # The only fetch.
        final = final_var.get(P.LATENCY)

    print_result(final, len(chunks), timer.elapsed)


if __name__ == "__main__":
    main()

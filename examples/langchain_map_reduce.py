"""A LangChain map-reduce summariser, run two ways on one Parrot server.

The summariser is plain LCEL: a map chain (prompt | chat model | parser) applied to
every chunk with ``.map()``, a lambda joining the chunk summaries, and a reduce chain.
Nothing in it knows about Parrot except the model class, ``ParrotChatModel`` (any
LangChain chat model speaking the OpenAI API would do for the first way).

**Request level**: ``summariser.invoke(chunks)``, as LangChain runs it: one
``POST /v1/chat/completions`` per chunk (LangChain sends the map calls concurrently
from a thread pool, here as large as the number of chunks), then one for the reduce
once every chunk summary is back.

**One Parrot DAG**: ``invoke_as_dag(summariser, chunks)`` walks the same pipeline once
on the client, records every model call as a Parrot semantic-function call in one
batch request, and fetches only the final summary; the chunk summaries flow into the
reduce prompt on the server.

Before either way is timed, the summariser runs once, untimed (request level), so both
find the same engine and prefix-cache state.  Greedy decoding makes the two final
summaries comparable; the script says whether they are equal.

Run (with a server up, e.g. ``parrot serve`` in another terminal)::

    pip install 'parrot-serve[langchain]'
    python examples/langchain_map_reduce.py --url http://127.0.0.1:9000
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # so `_common` imports however we are run
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DEFAULT_CHUNK_WORDS, DEFAULT_FILE, DEFAULT_MAX_TOKENS, DEFAULT_URL, chunk_text, word_count
from _two_ways import equality_line
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda

from parrot.integrations.langchain import ParrotChatModel, invoke_as_dag


def build_summariser(model: Any) -> Runnable:
    """The LCEL map-reduce summariser: summarise every chunk, join, summarise the summaries."""
    map_prompt = ChatPromptTemplate.from_messages(
        [("human", "{chunk}\n\nSummarise the text above in two sentences.")]
    )
    reduce_prompt = ChatPromptTemplate.from_messages(
        [("human", "{summaries}\n\nSummarise the text above in four sentences.")]
    )
    map_chain = map_prompt | model | StrOutputParser()
    join = RunnableLambda(lambda summaries: "\n\n".join(s.strip() for s in summaries))
    reduce_chain = reduce_prompt | model | StrOutputParser()
    return {"summaries": map_chain.map() | join} | reduce_chain


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A LangChain map-reduce summariser, request level and DAG.")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"Parrot server URL (default {DEFAULT_URL})")
    parser.add_argument("--file", type=Path, default=DEFAULT_FILE, help="text file to summarise")
    parser.add_argument("--chunk-words", type=int, default=DEFAULT_CHUNK_WORDS, help="chunk size in words")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens per summary")
    args = parser.parse_args(argv)
    if args.chunk_words < 1:
        parser.error("--chunk-words must be positive")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be positive")
    return args


def timed(run: Callable[[], str]) -> tuple[str, float]:
    start = time.perf_counter()
    value = run()
    return value, time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    text = args.file.read_text(encoding="utf-8")
    chunks = chunk_text(text, args.chunk_words)
    if not chunks:
        sys.exit(f"{args.file}: no text to summarise")
    print(f"{args.file.name}: {word_count(text)} words in {len(chunks)} chunks", flush=True)

    model = ParrotChatModel(base_url=args.url, max_tokens=args.max_tokens, temperature=0.0)
    summariser = build_summariser(model)
    # Request level sends every map call at once (LangChain's default pool has min(32, CPUs + 4) threads).
    config: RunnableConfig = {"max_concurrency": len(chunks)}
    summariser.invoke(chunks, config)  # untimed: both ways then find the same engine state
    dag, dag_s = timed(lambda: invoke_as_dag(summariser, chunks, url=args.url))
    plain, plain_s = timed(lambda: summariser.invoke(chunks, config))

    print("\nFinal summary (one Parrot DAG):")
    print(dag)
    if plain != dag:
        print("\nFinal summary (request level):")
        print(plain)
    print()
    print(f"request level (LangChain .invoke):   {plain_s:6.2f} s, {len(chunks) + 1} chat completions")
    print(f"one Parrot DAG (invoke_as_dag):      {dag_s:6.2f} s, one batch request")
    print(f"request level / DAG: {plain_s / dag_s:.2f}x")
    print(equality_line(dag, plain), flush=True)
    return {"dag": dag, "plain": plain, "dag_s": dag_s, "plain_s": plain_s, "chunks": len(chunks)}


if __name__ == "__main__":
    main()

"""Five short questions and answers in a chain: each step reads the previous one.

    question  = ask(topic)
    answer    = reply(question)
    question2 = follow_up(answer)
    answer2   = reply(question2)         # the same semantic function again
    recap     = summarise(answer, answer2)

Every answer is a sentence, so each call is short and, for a client that
sends one request per call and waits for its answer before the next, the
network round trips between the steps weigh as much as the model's work.
With Parrot the five calls are submitted at once, each value flows to the
next call inside the server, and only the recap is fetched.

Run (with a server up, e.g. ``parrot serve`` in another terminal)::

    python examples/qa_chain.py
    python examples/qa_chain.py --topic "honey bees"
"""

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # so `_common` imports however we are run
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import base_parser, check_base_args, print_result
from _two_ways import Comparison, compare

import parrot as P

DEFAULT_TOPIC = "lighthouses"


def _sentence(max_tokens: int) -> P.Output:
    """A short greedy answer, reduced to its first non-blank line."""
    return P.Output(max_tokens=max_tokens, temperature=0.0, transform=P.transforms.first_line())


# The model tends to wrap its question in a sentence ('One question is: "Why ...?"'):
# on the server, before the value flows on, the transforms keep the first line and,
# when it quotes something, the quoted part (never failing: at worst the line is empty).
_QUESTION = P.Output(
    max_tokens=24,
    temperature=0.0,
    transform=P.transforms.first_line() + P.transforms.regex(r'^(?:[^"]*")?([^"]*)'),
)


@P.semantic_function(chat=True)
def ask(topic: P.Input, question: _QUESTION):
    """Ask one short question about {{topic}}.
    {{question}}"""


@P.semantic_function(chat=True)
def reply(question: P.Input, answer: _sentence(40)):
    """{{question}} Answer in one sentence.
    {{answer}}"""


@P.semantic_function(chat=True)
def follow_up(answer: P.Input, question: _QUESTION):
    """{{answer}}

    Ask one short question about the text above.
    {{question}}"""


@P.semantic_function(chat=True)
def summarise(answer: P.Input, answer2: P.Input, recap: _sentence(40)):
    """{{answer}} {{answer2}}

    Summarise the text above in one sentence.
    {{recap}}"""


FUNCTIONS = SimpleNamespace(ask=ask, reply=reply, follow_up=follow_up, summarise=summarise)


def qa_chain(f: Any, topic: str) -> Any:
    """The application; ``f`` holds its four functions (the semantic functions,
    or their request-level stand-ins).  Returns the recap."""
    question = f.ask(topic)
    answer = f.reply(question)
    question2 = f.follow_up(answer)
    answer2 = f.reply(question2)
    return f.summarise(answer=answer, answer2=answer2)


def main(argv: list[str] | None = None) -> Comparison:
    parser = base_parser("A chain of five short calls: question, answer, follow-up, answer, recap.")
    parser.add_argument(
        "--topic", default=DEFAULT_TOPIC, help=f"what to ask about (default {DEFAULT_TOPIC!r})"
    )
    args = parser.parse_args(argv)
    check_base_args(parser, args)
    print(f"topic: {args.topic} (5 calls in a chain)", flush=True)

    def app(way: Any) -> Any:
        return qa_chain(SimpleNamespace(**{k: way(fn) for k, fn in vars(FUNCTIONS).items()}), args.topic)

    comparison = compare(app, args.url, args.delay_ms)
    print_result(comparison, "Recap")
    return comparison


if __name__ == "__main__":
    main()

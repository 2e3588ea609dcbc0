"""What the model sees does not change: a semantic function's prompt is the tokens of its
rendered string, exactly what a request-level client sends to ``/v1/completions``.

On SmolLM2 (a real byte-level BPE, where a space or newline next to a placeholder
merges with its neighbours), with natural templates: spaces and punctuation next to
placeholders, values with leading or trailing whitespace and newlines, non-ASCII text,
and ``chat=True``.  Greedy outputs and prompt token counts must be equal both ways, and
a system prompt shared by many calls is still computed once.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

import parrot as P
from parrot.engine.loader import LoadedModel, load_model
from parrot.engine.local import LocalEngine
from parrot.manager.service import Manager
from tests.conftest import LiveServer, start_server

pytestmark = pytest.mark.slow

MAX_TOKENS = 12

# (template, inputs, chat)
CORPUS: list[tuple[str, dict[str, str], bool]] = [
    ("Debate topic: {{topic}}\nFirst speaker:{{out}}", {"topic": "Should cities ban cars?"}, False),
    ("Debate topic: {{topic}} \n\nOpening statement: {{out}}", {"topic": "Homework is optional\n"}, False),
    ("{{doc}}\n\nSummarise the text above:{{out}}", {"doc": "Tides rise twice a day.\n"}, False),
    ("Q:{{q}}A:{{out}}", {"q": "  What is two plus two?  "}, False),
    ("Translate into English: «{{text}}» ->{{out}}", {"text": "Café au lait, s'il vous plaît"}, False),
    ("Notes:{{notes}}\nAnswer, in a word:{{out}}", {"notes": "\n- ships\n- harbours\n"}, False),
    ("Name: {{name}}, age: {{age}}. A one-line bio:{{out}}", {"name": "Zoë Ådahl", "age": "42"}, False),
    ("List three {{thing}}s:\n1.{{out}}", {"thing": "fruit"}, False),
    (
        "Give a {{adjective}} title for a story about {{subject}}.\n{{out}}",
        {"adjective": " short", "subject": "a lighthouse keeper "},
        True,
    ),
    ("{{question}}\n{{out}}", {"question": "What is the capital of France?"}, True),
]


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2")


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel) -> Iterator[LiveServer]:
    # no latency probe (seconds; test_smollm2 runs it on SmolLM2): no assertion here depends on the cap
    engine = LocalEngine(smollm2, latency_probe=False)
    manager = Manager()
    manager.pool.register(engine, name="smollm2")
    live = start_server(manager)
    yield live
    live.stop()
    engine.close()


def rendered_string(template: str, inputs: dict[str, str], chat: bool, smollm2: LoadedModel) -> str:
    """The prompt text a request-level client sends for the same call (documented rendering:
    the text before the output, with chat=True wrapped in the model's chat markup after
    dropping whitespace at the edges of the user's text)."""
    text = template.split("{{out}}")[0]
    for name, value in inputs.items():
        text = text.replace("{{" + name + "}}", value)
    if not chat:
        return text
    before, between = smollm2.tokenizer.chat.wrap()
    return before + text.strip() + between


def completion(url: str, prompt: str) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120, trust_env=False)
    response.raise_for_status()
    return response.json()


@pytest.mark.parametrize(("template", "inputs", "chat"), CORPUS)
def test_semantic_function_sees_the_tokens_of_the_rendered_string(server, smollm2, template, inputs, chat):
    fn = P.template_function(template, out=P.Output(max_tokens=MAX_TOKENS, temperature=0.0), chat=chat)
    with P.connect(server.url) as session:
        out = fn(**inputs)
        value = out.get(timeout=120)
        (call,) = server.manager.sessions[session.session_id].calls.values()
    prompt = rendered_string(template, inputs, chat, smollm2)
    request = completion(server.url, prompt)
    # piecewise tokenization gave other counts here (e.g. 14 against 13 for the first template)
    assert call.prompt_tokens == request["usage"]["prompt_tokens"] == len(smollm2.tokenizer.encode(prompt))
    assert value == request["choices"][0]["text"]
    assert value.strip(), "greedy decoding produced nothing to compare"


def test_a_system_prompt_is_still_computed_once_for_many_calls(server, smollm2):
    system = (
        "You are the archivist of a maritime museum. You answer questions about ships, "
        "harbours, lighthouses and the people who worked on them, briefly and precisely. "
    ) * 4
    ask = P.template_function(
        system + "Question: {{q}}\nAnswer:{{a}}", a=P.Output(max_tokens=4, temperature=0.0)
    )
    engine = server.manager.pool.candidates(None)[0]
    before = server.run_on_loop(engine.api.stats())
    with P.connect(server.url) as session:
        with session.batch():
            outs = [ask(f"question {i}: who kept the light?") for i in range(8)]
        for o in outs:
            o.get(timeout=120)
    after = server.run_on_loop(engine.api.stats())
    whole = len(smollm2.tokenizer.encode(system + "Question: question")) // after.kv_block_size
    assert after.cached_tokens - before.cached_tokens >= 7 * whole * after.kv_block_size

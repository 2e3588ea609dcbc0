"""The default model, SmolLM2-135M-Instruct, through the whole stack."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator

import pytest

import parrot as P
from parrot.engine.loader import LoadedModel, load_model
from parrot.engine.local import LocalEngine
from parrot.manager.service import Manager
from parrot.protocol.sampling import SamplingParams
from tests.conftest import LiveServer, start_server

pytestmark = pytest.mark.slow
_ctx = itertools.count(1_000_000)


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2")


@pytest.fixture(scope="module")
def engine(smollm2: LoadedModel) -> Iterator[LocalEngine]:
    e = LocalEngine(smollm2)
    yield e
    e.close()


@pytest.fixture
def server(engine: LocalEngine) -> Iterator[LiveServer]:
    manager = Manager()
    manager.pool.register(engine, name="smollm2")
    live = start_server(manager)
    yield live
    live.stop()


def test_chat_answer_is_real_english(server):
    @P.semantic_function(chat=True)
    def ask(question: P.Input, answer: P.Output(max_tokens=24, temperature=0.0)):
        """{{question}}
        {{answer}}"""

    with P.connect(server.url):
        answer = ask("What is the capital of France?").get(timeout=120)
    assert "Paris" in answer


def test_chain_passes_real_text_downstream(server):
    @P.semantic_function(chat=True)
    def capital(country: P.Input, city: P.Output(max_tokens=12, temperature=0.0, stop=["\n"])):
        """What is the capital of {{country}}? Answer with the city name only.
        {{city}}"""

    @P.semantic_function(chat=True)
    def country(city: P.Input, name: P.Output(max_tokens=24, temperature=0.0)):
        """In which country is the city of {{city}}? Answer in one short sentence.
        {{name}}"""

    with P.connect(server.url):
        city = capital("France")
        answer = country(city).get(timeout=120)
        city_value = city.get(timeout=5)
    assert "Paris" in city_value
    assert "France" in answer


def test_forked_child_generates_exactly_like_one_context(engine, smollm2):
    tok = smollm2.tokenizer
    system = tok.encode("<|im_start|>system\nYou are a helpful assistant who answers briefly.<|im_end|>\n")
    user = tok.encode(
        "<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\n"
    )
    greedy = SamplingParams(max_tokens=20, temperature=0.0)

    async def gen(ctx, parent=None):
        out = []
        async for chunk in engine.generate(greedy, ctx, parent):
            out.extend(chunk.token_ids)
        return out

    async def run():
        one = next(_ctx)
        await engine.fill(system + user, one)
        expected = await gen(one)
        parent, child = next(_ctx), next(_ctx)
        await engine.fill(system, parent)
        await engine.fill(user, child, parent)
        got = await gen(child)
        for c in (one, child, parent):
            await engine.free_context(c)
        return expected, got

    expected, got = asyncio.run(run())
    assert len(expected) > 3
    assert got == expected


RUBRIC = {
    "type": "object",
    "properties": {
        "dimension": {"enum": ["clarity", "accuracy", "style"]},
        "score": {"type": "integer", "minimum": 1, "maximum": 10},
        "passed": {"type": "boolean"},
        "reason": {"type": "string", "maxLength": 40},
    },
    "required": ["dimension", "score", "passed", "reason"],
    "additionalProperties": False,
}


def test_json_schema_outputs_always_parse_and_validate(server):
    """The issue's rubric case: every dimension's score is JSON that validates, greedy
    and sampled (at most 40 characters of reason, so 100 tokens always finish it)."""
    import jsonschema

    @P.semantic_function(chat=True)
    def score(essay: P.Input, dim: P.Input, verdict: P.Output(max_tokens=100, json_schema=RUBRIC)):
        """Grade this essay on {{dim}} from 1 to 10 and answer in JSON.
        Essay: {{essay}}
        {{verdict}}"""

    @P.semantic_function(chat=True)
    def score_sampled(
        essay: P.Input,
        dim: P.Input,
        verdict: P.Output(max_tokens=100, temperature=0.8, seed=11, json_schema=RUBRIC),
    ):
        """Grade this essay on {{dim}} from 1 to 10. Reply with JSON only.
        Essay: {{essay}}
        {{verdict}}"""

    essays = ["Cats are nice. They sleep a lot.", "The French Revolution began in 1789 and changed Europe."]
    with P.connect(server.url):
        dims = ("clarity", "accuracy", "style")
        outs = [f(e, d) for f in (score, score_sampled) for e in essays for d in dims]
        values = [o.get(timeout=300) for o in outs]
    for value in values:
        jsonschema.validate(json.loads(value), RUBRIC)
        assert list(json.loads(value)) == list(RUBRIC["properties"])  # in the schema's order

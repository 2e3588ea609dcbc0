"""Structured outputs below the manager's API: constraints, the engine's grammar masks,
constrained decoding in the tiny engine (random weights still obey), forks, continuous
batching with unconstrained rows, the engine HTTP protocol, and OpenAI-compatible
backends' request bodies."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import threading
from typing import Any

import pytest
import torch

import parrot as P
from parrot.engine.grammar import GrammarCache
from parrot.engine.http_app import create_engine_app
from parrot.engine.loader import LoadedModel
from parrot.engine.local import LocalEngine
from parrot.manager.backends.openai_backend import BackendOptions, OpenAIBackend, _Context
from parrot.manager.backends.remote_engine import RemoteEngine
from parrot.protocol import constraint as C
from parrot.protocol.constraint import Constraint, InvalidConstraint, check_compiles
from parrot.protocol.errors import BadRequest, InvalidSampling, NotFound
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.tokenizer import TextTokenizer
from tests.conftest import LiveServer, serve_asgi

TINY = TextTokenizer.byte_level_tiny()
_ids = itertools.count(5_000_000)

SCHEMA = {
    "type": "object",
    "properties": {
        "grade": {"enum": ["low", "high"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["grade", "ok", "n"],
    "additionalProperties": False,
}
DIGITS = r"[a-c]{2}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe so"]


# ------------------------------------------------------------------ constraints
def test_constraints_are_canonical_and_round_trip_through_sampling() -> None:
    a = Constraint.json_schema({"b": 1, "a": {"type": "object"}})
    b = Constraint.json_schema('{"b": 1,\n "a": {"type": "object"}}')
    assert a == b and hash(a) == hash(b)  # one cache entry for equal schemas
    assert a.spec == '{"b":1,"a":{"type":"object"}}'  # key order kept: it is the generation order
    for c in (a, Constraint.regex(DIGITS), Constraint.choice(CHOICES)):
        sp = SamplingParams(max_tokens=9, constraint=c)
        wire = json.loads(json.dumps(sp.to_dict()))
        assert wire["constraint"] == c.to_dict()
        assert SamplingParams.from_dict(wire) == sp
    assert "constraint" not in SamplingParams().to_dict()  # older engines still take it
    assert SamplingParams(constraint={"choices": ["x", "y"]}).constraint == Constraint.choice(["x", "y"])


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: Constraint.json_schema([1]), "invalid json_schema: a JSON schema must be an object"),
        (lambda: Constraint.json_schema("{nope"), "invalid json_schema: not valid JSON"),
        (lambda: Constraint.regex(""), "invalid regex: a regex must be a non-empty string"),
        (lambda: Constraint.regex("a" * (C.MAX_REGEX_CHARS + 1)), f"the limit is {C.MAX_REGEX_CHARS}"),
        (
            lambda: Constraint.json_schema({"enum": ["x" * C.MAX_SCHEMA_CHARS]}),
            f"the limit is {C.MAX_SCHEMA_CHARS}",
        ),
        (lambda: Constraint.choice([]), "invalid choices: choices must be a non-empty list"),
        (lambda: Constraint.choice(["a", 3]), "each choice must be a non-empty string"),
        (lambda: Constraint.choice(["a"] * (C.MAX_CHOICES + 1)), f"the limit is {C.MAX_CHOICES}"),
        (lambda: Constraint.of(json_schema={}, regex="a"), "at most one of json_schema, regex, choices"),
        (lambda: Constraint.from_dict({"grammar": "x"}), "exactly one of 'json_schema', 'regex', 'choices'"),
        (lambda: check_compiles(Constraint.regex("a(b")), "invalid regex: "),
        (lambda: check_compiles(Constraint.json_schema({"type": "objectx"})), "invalid json_schema: "),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(make: Any, needle: str) -> None:
    with pytest.raises(InvalidConstraint, match=re.escape(needle)) as info:
        make()
    assert info.value.status == 400 and info.value.code == "invalid_constraint"
    assert isinstance(info.value, ValueError)  # the Python API's ValueError too


def test_output_takes_at_most_one_constraint_and_checks_it_at_definition() -> None:
    out = P.Output(max_tokens=5, regex=DIGITS)
    assert out.binding("x")["sampling"]["constraint"] == {"regex": DIGITS}
    assert P.Output(choices=CHOICES).sampling.constraint == Constraint.choice(CHOICES)
    with pytest.raises(
        ValueError, match="at most one of json_schema, regex, choices may be given, got json_schema, regex"
    ):
        P.Output(json_schema=SCHEMA, regex="a")
    with pytest.raises(ValueError, match=r"(?s)invalid regex: .*unclosed group"):
        P.Output(regex="a(b")
    with pytest.raises(ValueError, match="invalid choices"):
        P.Output(choices="yes")  # a bare string is not a list of choices


# ------------------------------------------------------------------ masks
def test_the_mask_allows_exactly_the_grammars_next_tokens_and_leaves_other_rows_alone() -> None:
    cache = GrammarCache(TINY, model_vocab=300)
    m = cache.matcher(Constraint.regex("ab|ac"))
    logits = torch.randn(3, 300)
    masked = cache.mask(logits, [None, m, None])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [ord("a")]
    assert cache.mask(logits, [None, None, None]) is logits  # no constrained row: no copy
    assert m.consume_token(ord("a"))
    allowed = torch.isfinite(cache.mask(logits, [m])[0:1]).nonzero()[:, 1].tolist()
    assert allowed == [ord("b"), ord("c")]
    assert m.consume_token(ord("c")) and m.is_stopped()
    # compiled once per constraint, one matcher per sequence
    again = cache.matcher(Constraint.regex("ab|ac"))
    assert cache.compiles == 1 and not again.is_stopped()


def test_eos_is_allowed_only_where_the_grammar_may_end() -> None:
    cache = GrammarCache(TINY, model_vocab=300)
    m = cache.matcher(Constraint.regex("a+"))
    eos = TINY.eos_token_ids[0]
    logits = torch.zeros(1, 300)
    assert not torch.isfinite(cache.mask(logits, [m])[0, eos])  # nothing generated yet
    assert m.consume_token(ord("a"))
    row = cache.mask(logits, [m])[0]
    assert torch.isfinite(row[eos]) and torch.isfinite(row[ord("a")])
    assert not torch.isfinite(row[259:]).any()  # the model's padding ids past the tokenizer


# ------------------------------------------------------------------ the engine
async def _generate(engine: Any, sp: SamplingParams, ctx: int, parent: int | None = None) -> tuple[str, str]:
    text, reason = [], None
    try:
        async for chunk in engine.generate(sp, ctx, parent):
            text.append(chunk.text)
            reason = chunk.finish_reason
    finally:  # freed (if it was made): the session's tiny engine is shared with later tests
        with contextlib.suppress(NotFound):
            await engine.free_context(ctx)
    return "".join(text), str(reason)


async def _prompt(engine: Any, text: str) -> int:
    ctx = next(_ids)
    await engine.fill(TINY.encode(text), ctx)
    return ctx


def _sampled(c: Constraint, seed: int, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, constraint=c)


def test_random_weights_obey_regexes_and_choices_greedy_and_sampled(tiny_engine: LocalEngine) -> None:
    async def run() -> list[tuple[str, str]]:
        parent = await _prompt(tiny_engine, "Answer: ")
        jobs = [
            _generate(tiny_engine, _sampled(Constraint.regex(DIGITS), s), next(_ids), parent)
            for s in range(4)
        ]
        jobs += [
            _generate(tiny_engine, _sampled(Constraint.choice(CHOICES), s), next(_ids), parent)
            for s in range(4)
        ]
        greedy = SamplingParams(max_tokens=40, constraint=Constraint.choice(CHOICES))
        jobs.append(_generate(tiny_engine, greedy, next(_ids), parent))
        out = await asyncio.gather(*jobs)
        await tiny_engine.free_context(parent)
        return out

    out = asyncio.run(run())
    for text, reason in out[:4]:
        assert re.fullmatch(DIGITS, text) and reason == "stop", (text, reason)
    for text, reason in out[4:]:
        assert text in CHOICES and reason == "stop", (text, reason)


def test_forks_each_follow_their_own_matcher_in_a_batch_with_unconstrained_rows(
    tiny_engine: LocalEngine,
) -> None:
    """Forks of one prompt, each constrained, decode in the same steps as unconstrained
    generates; the unconstrained outputs equal what they are alone (their rows untouched)."""
    free = SamplingParams(max_tokens=12, ignore_eos=True)

    async def run() -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
        parent = await _prompt(tiny_engine, "Grade it: ")
        alone = [await _generate(tiny_engine, free, next(_ids), parent) for _ in range(1)]
        forks = [
            _generate(tiny_engine, _sampled(Constraint.json_schema(SCHEMA), s, 80), next(_ids), parent)
            for s in range(3)
        ]
        plain = [_generate(tiny_engine, free, next(_ids), parent) for _ in range(2)]
        got = await asyncio.gather(*forks, *plain)
        await tiny_engine.free_context(parent)
        return alone, got[:3], got[3:]

    alone, forks, plain = asyncio.run(run())
    for text, reason in forks:
        assert reason == "stop", text
        value = json.loads(text)
        assert set(value) == {"grade", "ok", "n"} and value["grade"] in ("low", "high")
        assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 99
    assert plain == alone * 2


def test_a_constraint_that_does_not_compile_fails_its_generate_only(tiny_engine: LocalEngine) -> None:
    bad = SamplingParams(max_tokens=5, constraint=Constraint.json_schema({"type": "objectx"}))

    async def run() -> tuple[Any, tuple[str, str]]:
        parent = await _prompt(tiny_engine, "x")
        results = await asyncio.gather(
            _generate(tiny_engine, bad, next(_ids), parent),
            _generate(tiny_engine, SamplingParams(max_tokens=3, ignore_eos=True), next(_ids), parent),
            return_exceptions=True,
        )
        await tiny_engine.free_context(parent)
        return results

    failed, ok = asyncio.run(run())
    assert isinstance(failed, InvalidConstraint) and "Invalid type: objectx" in failed.message
    assert isinstance(ok, tuple) and ok[1] == "length"


def test_masks_are_computed_on_the_engine_worker_thread(
    tiny_engine: LocalEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    real = GrammarCache.mask

    def spy(self: GrammarCache, logits: torch.Tensor, matchers: Any) -> torch.Tensor:
        if any(m is not None for m in matchers):
            threads.append(threading.current_thread().name)
        return real(self, logits, matchers)

    monkeypatch.setattr(GrammarCache, "mask", spy)

    async def run() -> tuple[str, str]:
        parent = await _prompt(tiny_engine, "t")
        out = await _generate(tiny_engine, _sampled(Constraint.regex(DIGITS), 0), next(_ids), parent)
        await tiny_engine.free_context(parent)
        return out

    text, _ = asyncio.run(run())
    assert re.fullmatch(DIGITS, text)
    assert len(threads) == len(TINY.encode(text)) and set(threads) == {"parrot-engine"}  # one mask per token


# ------------------------------------------------------- over the engine protocol
@pytest.fixture
def engine_server(tiny_engine: LocalEngine) -> Any:
    live = serve_asgi(
        create_engine_app(tiny_engine, cluster_secret="s3cret"), LiveServer(url="", manager=None)
    )  # type: ignore[arg-type]
    yield live
    live.stop()


def test_the_constraint_travels_to_a_remote_engine(
    engine_server: LiveServer, tiny_model: LoadedModel
) -> None:
    async def run() -> list[tuple[str, str]]:
        remote = await RemoteEngine.connect(engine_server.url, cluster_secret="s3cret")
        try:
            parent = await _prompt(remote, "Say: ")
            out = [
                await _generate(remote, _sampled(Constraint.regex(DIGITS), 7), next(_ids), parent),
                await _generate(remote, _sampled(Constraint.choice(CHOICES), 8), next(_ids), parent),
            ]
            try:
                await _generate(remote, SamplingParams(constraint=Constraint.regex("(")), next(_ids), parent)
            except BadRequest as exc:
                out.append(("error", exc.message))
            await remote.free_context(parent)
            return out
        finally:
            await remote.close()

    regex_out, choice_out, error = asyncio.run(run())
    assert re.fullmatch(DIGITS, regex_out[0]) and choice_out[0] in CHOICES
    assert error[0] == "error" and "invalid regex" in error[1]


# ------------------------------------------------------- OpenAI-compatible backends
def test_a_vllm_backend_gets_structured_outputs_and_others_refuse_constraints() -> None:
    ids = TINY.encode("abc")
    vllm = OpenAIBackend("http://127.0.0.1:9", BackendOptions(kind="vllm", model="m"), "m", 100, TINY)
    cases = [
        (Constraint.json_schema(SCHEMA), "json", SCHEMA),
        (Constraint.regex(DIGITS), "regex", DIGITS),
        (Constraint.choice(CHOICES), "choice", CHOICES),
    ]
    guided = {"guided_json", "guided_regex", "guided_choice"}  # vLLM 0.32 answers these unconstrained
    for c, field, value in cases:
        body = vllm._body(_Context(ids, ""), SamplingParams(constraint=c), 5, stream=True)
        assert body["structured_outputs"] == {field: value} and not guided & set(body)
    assert "structured_outputs" not in vllm._body(_Context(ids, ""), SamplingParams(), 5, stream=True)
    for kind in ("openai", "sglang"):
        other = OpenAIBackend("http://127.0.0.1:9", BackendOptions(kind=kind, model="m"), "m", 100, TINY)
        with pytest.raises(BadRequest, match=f"kind '{kind}'.* cannot enforce a regex constraint") as info:
            other._body(_Context(ids, ""), SamplingParams(constraint=Constraint.regex("a")), 5, stream=True)
        assert info.value.code == "constraint_unsupported"


def test_invalid_sampling_dicts_name_the_constraint_field() -> None:
    with pytest.raises(InvalidSampling, match="unknown field"):
        SamplingParams.from_dict({"guided_regex": "a"})
    with pytest.raises(InvalidConstraint, match="invalid constraint: must be an object with exactly one"):
        SamplingParams.from_dict({"constraint": {"regex": "a", "choices": ["b"]}})

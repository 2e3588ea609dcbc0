"""The built-in engine's API: fill / generate / free_context with forked contexts."""

from __future__ import annotations

import asyncio
import random

import pytest

from parrot.engine.local import LocalEngine
from parrot.protocol.errors import BadRequest, ContextTooLong, NotFound
from parrot.protocol.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
_ids = iter(range(10_000, 10**9))


def new_ctx() -> int:
    return next(_ids)


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


async def collect(engine: LocalEngine, sampling: SamplingParams, ctx: int, parent: int | None = None):
    tokens: list[int] = []
    text = []
    last = None
    async for chunk in engine.generate(sampling, ctx, parent):
        tokens.extend(chunk.token_ids)
        text.append(chunk.text)
        last = chunk
    assert last is not None and last.done
    return tokens, "".join(text), last.finish_reason


async def from_scratch(engine: LocalEngine, tokens: list[int], sampling=GREEDY):
    ctx = new_ctx()
    await engine.fill(tokens, ctx)
    out = await collect(engine, sampling, ctx)
    await engine.free_context(ctx)
    return out[0]


def test_child_of_filled_parent_generates_exactly_what_one_context_does(tiny_engine):
    vocab = tiny_engine.loaded.config.vocab_size
    full = prompt(1, 90, vocab)
    shared, rest = full[:57], full[57:]

    async def run():
        expected = await from_scratch(tiny_engine, full)
        parent = new_ctx()
        await tiny_engine.fill(shared, parent)
        child = new_ctx()
        await tiny_engine.fill(rest, child, parent)
        got_fill_child = (await collect(tiny_engine, GREEDY, child))[0]
        # generate straight from a fresh child of a parent holding the whole prompt
        parent2, child2 = new_ctx(), new_ctx()
        await tiny_engine.fill(full, parent2)
        got_gen_child = (await collect(tiny_engine, GREEDY, child2, parent2))[0]
        for c in (child, parent, child2, parent2):
            await tiny_engine.free_context(c)
        return expected, got_fill_child, got_gen_child

    expected, a, b = asyncio.run(run())
    assert len(expected) == GREEDY.max_tokens
    assert a == expected
    assert b == expected


def test_concurrent_generations_equal_each_run_alone(tiny_engine):
    vocab = tiny_engine.loaded.config.vocab_size
    prompts = [prompt(10 + i, 20 + 37 * i, vocab) for i in range(5)]

    async def run():
        alone = [await from_scratch(tiny_engine, p) for p in prompts]
        together = await asyncio.gather(*(from_scratch(tiny_engine, p) for p in prompts))
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert together == alone
    assert len({tuple(x) for x in alone}) > 1  # different prompts, different outputs


def test_seeded_sampling_reproduces_and_seeds_differ(tiny_engine):
    vocab = tiny_engine.loaded.config.vocab_size
    p = prompt(3, 30, vocab)

    def sp(seed):
        return SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)

    async def run():
        return [await from_scratch(tiny_engine, p, sp(s)) for s in (7, 7, 8)]

    a, b, c = asyncio.run(run())
    assert a == b
    assert a != c


def test_sibling_forks_share_the_parent_without_interfering(tiny_engine):
    vocab = tiny_engine.loaded.config.vocab_size
    shared = prompt(4, 40, vocab)
    tails = [prompt(40 + i, 8, vocab) for i in range(3)]

    async def run():
        expected = [await from_scratch(tiny_engine, shared + t) for t in tails]
        parent = new_ctx()
        await tiny_engine.fill(shared, parent)
        kids = [new_ctx() for _ in tails]
        await asyncio.gather(*(tiny_engine.fill(t, k, parent) for t, k in zip(tails, kids, strict=False)))
        got = await asyncio.gather(*(collect(tiny_engine, GREEDY, k) for k in kids))
        before_free = (await tiny_engine.stats()).kv_tokens_used
        for k in kids:
            await tiny_engine.free_context(k)
        await tiny_engine.free_context(parent)
        return expected, [g[0] for g in got], before_free

    expected, got, used = asyncio.run(run())
    assert got == expected
    # the shared prefix is stored once, not once per child
    assert used < 2 * len(shared) + 3 * (8 + GREEDY.max_tokens)


def test_stop_strings_and_max_tokens(tiny_engine):
    vocab = tiny_engine.loaded.config.vocab_size
    p = prompt(5, 20, vocab)

    async def run():
        ctx = new_ctx()
        await tiny_engine.fill(p, ctx)
        free_text = await collect(tiny_engine, GREEDY, ctx)
        await tiny_engine.free_context(ctx)
        return free_text

    tokens, text, reason = asyncio.run(run())
    assert reason == "length" and len(tokens) == GREEDY.max_tokens
    if len(text) >= 4:
        stop = text[2:4]
        sp = SamplingParams(max_tokens=24, ignore_eos=True, stop=(stop,))

        async def again():
            ctx = new_ctx()
            await tiny_engine.fill(p, ctx)
            out = await collect(tiny_engine, sp, ctx)
            await tiny_engine.free_context(ctx)
            return out

        _, stopped_text, stopped_reason = asyncio.run(again())
        assert stopped_reason == "stop"
        assert stopped_text == text[: text.find(stop)]


def test_errors_are_specific_and_leave_the_engine_serving(tiny_engine):
    vocab = tiny_engine.loaded.config.vocab_size
    max_len = tiny_engine.max_seq_len

    async def run():
        with pytest.raises(NotFound):
            await tiny_engine.fill([1, 2], new_ctx(), parent_context_id=123456789)
        with pytest.raises(BadRequest, match="outside the vocabulary"):
            await tiny_engine.fill([vocab + 5], new_ctx())
        with pytest.raises(ContextTooLong):
            await tiny_engine.fill([5] * (max_len + 1), new_ctx())
        with pytest.raises(BadRequest, match="no tokens"):
            await collect(tiny_engine, GREEDY, new_ctx())
        with pytest.raises(NotFound):
            await tiny_engine.free_context(987654321)
        return await from_scratch(tiny_engine, prompt(6, 10, vocab))

    assert len(asyncio.run(run())) == GREEDY.max_tokens


def test_cancelling_a_stream_stops_generation_and_frees(tiny_engine):
    vocab = tiny_engine.loaded.config.vocab_size

    async def run():
        before = await tiny_engine.stats()
        ctx = new_ctx()
        await tiny_engine.fill(prompt(7, 10, vocab), ctx)
        stream = tiny_engine.generate(SamplingParams(max_tokens=500, ignore_eos=True), ctx)
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                break
        await stream.aclose()
        await tiny_engine.free_context(ctx)
        await asyncio.sleep(0.05)
        after = await tiny_engine.stats()
        return before, after

    before, after = asyncio.run(run())
    assert after.num_running == 0
    assert after.generated_tokens - before.generated_tokens < 500
    assert after.num_contexts == before.num_contexts


def test_generate_on_unknown_context_leaves_nothing_behind(tiny_engine):
    async def run():
        before = (await tiny_engine.stats()).num_contexts
        with pytest.raises(BadRequest, match="no tokens"):
            await collect(tiny_engine, GREEDY, new_ctx())
        return before, (await tiny_engine.stats()).num_contexts

    before, after = asyncio.run(run())
    assert after == before


def test_vanishing_temperature_is_greedy_not_nan(tiny_engine):
    vocab = tiny_engine.loaded.config.vocab_size
    p = prompt(8, 25, vocab)
    tiny_temp = SamplingParams(max_tokens=24, temperature=1e-30, ignore_eos=True, seed=1)

    async def run():
        return await from_scratch(tiny_engine, p), await from_scratch(tiny_engine, p, tiny_temp)

    greedy, tiny = asyncio.run(run())
    assert tiny == greedy


def test_penalties_change_greedy_output_only_from_its_first_repeat(tiny_engine):
    """Penalties lower only tokens already generated, so a penalised greedy run agrees
    with the plain one until the plain one first repeats a token; for this seeded model a
    frequency penalty of 2 then picks another token, and the run repeats less."""
    p = tiny_engine.tokenizer.encode("The quick brown fox")

    async def go():
        plain = await from_scratch(tiny_engine, p, GREEDY)
        pen = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=2.0)
        penalised = await from_scratch(tiny_engine, p, pen)
        again = await from_scratch(tiny_engine, p, pen)
        # the same penalised row next to unpenalised ones: the batch does not matter
        both = await asyncio.gather(from_scratch(tiny_engine, p, pen), from_scratch(tiny_engine, p, GREEDY))
        return plain, penalised, again, both

    plain, penalised, again, both = asyncio.run(go())
    first_repeat = next(i for i, t in enumerate(plain) if t in plain[:i])
    assert penalised[:first_repeat] == plain[:first_repeat]
    assert penalised[first_repeat] != plain[first_repeat]
    assert len(set(penalised)) > len(set(plain))
    assert again == penalised and both == [penalised, plain]

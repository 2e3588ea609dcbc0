"""Automatic prefix caching: the block pool's cached state, and the engine reusing the
KV of earlier prompts' leading blocks.

Greedy outputs are the oracle, as in test_paged_engine: with or without hits, under
memory pressure or with many calls arriving together, every sequence generates
exactly what an engine without a prefix cache generates for it.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from parrot.engine.core.block_pool import BlockPool
from parrot.engine.core.prefix_cache import ROOT, PrefixCache, block_digest
from parrot.engine.local import LocalEngine
from parrot.engine.runner import StepInfo
from parrot.protocol.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
_ids = itertools.count(70_000)


def prompt(seed: int, n: int, vocab: int = 259) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


# ---------------------------------------------------------------- the pool


def test_a_retained_block_is_cached_when_released_and_evicted_last_listed_first():
    pool = BlockPool(4, block_size=2)
    evicted: list[int] = []
    pool.on_evict = evicted.append
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    pool.retain(0)
    pool.retain(1)
    assert pool.decref(a) == [0, 1, 2]
    # 0 and 1 keep their content (cached), 2 is free; all count as obtainable
    assert pool.num_cached == 2 and pool.num_free == 4 and pool.num_used == 0
    assert pool.is_cached(0) and pool.is_cached(1) and not pool.is_cached(2)
    # free blocks go first, then the cached ones: the table's tail (1) before its head (0)
    assert pool.allocate(2) == [2, 3] and evicted == []
    assert pool.allocate(1) == [1] and evicted == [1]
    assert pool.num_cached == 1 and pool.num_free == 1


def test_incref_makes_a_cached_block_used_again_and_unretain_frees_it():
    pool = BlockPool(3, block_size=2)
    evicted: list[int] = []
    pool.on_evict = evicted.append
    (b,) = pool.allocate(1)
    pool.retain(b)
    pool.decref([b])
    pool.incref([b])  # a prefix-cache hit
    assert pool.refcount(b) == 1 and not pool.is_cached(b) and pool.num_free == 2
    pool.decref([b])
    pool.unretain(b)  # forgotten by its owner: free at once, without an eviction call
    assert not pool.is_cached(b) and pool.num_free == 3 and evicted == []
    assert pool.allocate(1) == [b]


def test_the_cache_stays_within_its_budget_evicting_the_oldest_to_be_reused_first():
    pool = BlockPool(6, block_size=2, max_cached=2)
    evicted: list[int] = []
    pool.on_evict = evicted.append
    blocks = pool.allocate(4)
    for b in blocks:
        pool.retain(b)
    pool.decref(blocks[:2])  # 0 and 1 cached: at the budget, nothing evicted
    assert pool.num_cached == 2 and evicted == []
    pool.decref(blocks[2:])  # two more: the two least recently cached (1, then 0) go now
    assert pool.num_cached == 2 and sorted(evicted) == [0, 1]
    assert pool.is_cached(2) and pool.is_cached(3) and not pool.is_cached(0)
    assert pool.num_free == 6 and pool.num_used == 0
    # the evicted blocks (memory already written) come back before never-used 4 and 5
    assert sorted(pool.allocate(2)) == [0, 1]
    assert pool.allocate(2) == [4, 5]


def test_a_zero_cache_budget_frees_at_once_and_a_bad_budget_is_refused():
    pool = BlockPool(2, block_size=2, max_cached=0)
    evicted: list[int] = []
    pool.on_evict = evicted.append
    (b,) = pool.allocate(1)
    pool.retain(b)
    pool.decref([b])
    assert pool.num_cached == 0 and evicted == [b] and pool.num_free == 2
    for bad in (-1, True):
        with pytest.raises(ValueError, match="max_cached"):
            BlockPool(2, max_cached=bad)


def test_pool_misuse_with_cached_blocks_raises():
    pool = BlockPool(2, block_size=2)
    with pytest.raises(ValueError, match="retain of unused"):
        pool.retain(0)
    (b,) = pool.allocate(1)
    pool.retain(b)
    pool.decref([b])
    with pytest.raises(ValueError, match="decref of free"):
        pool.decref([b])  # cached: no reference to drop
    pool.unretain(b)
    with pytest.raises(ValueError, match="incref of free"):
        pool.incref([b])


def test_digests_chain_so_equal_blocks_after_different_prefixes_differ():
    first = block_digest(ROOT, [1, 2])
    assert block_digest(ROOT, [1, 2]) == first
    assert block_digest(first, [3, 4]) != block_digest(block_digest(ROOT, [9, 2]), [3, 4])
    assert block_digest(ROOT, [1, 2]) != block_digest(ROOT, [2, 1])


def test_the_cache_forgets_evicted_blocks():
    pool = BlockPool(2, block_size=2)
    cache = PrefixCache(pool)
    (b,) = pool.allocate(1)
    digest = block_digest(ROOT, [5, 6])
    assert cache.add(digest, b)
    assert not cache.add(digest, b)  # one block per digest
    pool.decref([b])
    assert cache.lookup(digest) == b  # cached, still found
    pool.allocate(2)  # needs the cached block too: evicted
    assert cache.lookup(digest) is None and len(cache) == 0


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def engines(tiny_model):
    made: dict[str, LocalEngine] = {}

    def get(name: str, **kwargs) -> LocalEngine:
        if name not in made:
            made[name] = LocalEngine(tiny_model, **kwargs)
        return made[name]

    yield get
    for e in made.values():
        e.close()


async def complete(engine: LocalEngine, tokens: list[int], sp: SamplingParams = GREEDY) -> list[int]:
    ctx = next(_ids)
    await engine.fill(tokens, ctx)
    out: list[int] = []
    async for chunk in engine.generate(sp, ctx):
        out.extend(chunk.token_ids)
    await engine.free_context(ctx)
    return out


def cached_tokens(engine: LocalEngine) -> int:
    return asyncio.run(engine.stats()).cached_tokens


def test_a_repeated_prompt_reuses_its_whole_blocks_and_generates_the_same(engines, tiny_model):
    vocab = tiny_model.config.vocab_size
    eng = engines("cache", kv_cache_tokens=4096)
    plain = engines("plain", prefix_cache=False, kv_cache_tokens=4096)
    p = prompt(1, 200, vocab)
    expected = asyncio.run(complete(plain, p))
    before = cached_tokens(eng)
    assert asyncio.run(complete(eng, p)) == expected  # first time: nothing to reuse
    assert cached_tokens(eng) == before
    assert asyncio.run(complete(eng, p)) == expected
    # 12 whole blocks of 16; the block holding the last token is computed again
    assert cached_tokens(eng) - before == 192
    # a prompt that shares only its first 40 tokens reuses their 2 whole blocks
    q = p[:40] + prompt(2, 60, vocab)
    assert asyncio.run(complete(eng, q)) == asyncio.run(complete(plain, q))
    assert cached_tokens(eng) - before == 192 + 32
    assert cached_tokens(plain) == 0


def test_equal_blocks_after_a_different_first_block_are_not_reused(engines, tiny_model):
    vocab = tiny_model.config.vocab_size
    eng = engines("cache2", kv_cache_tokens=4096)
    p = prompt(3, 100, vocab)
    asyncio.run(complete(eng, p))
    before = cached_tokens(eng)
    q = [p[0] % (vocab - 3) + 3 if p[0] + 1 >= vocab else p[0] + 1, *p[1:]]  # only token 0 differs
    asyncio.run(complete(eng, q))
    assert cached_tokens(eng) == before


def test_calls_arriving_together_under_one_prompt_compute_it_once(engines, tiny_model):
    """Six calls submitted at once share a 300-token prompt: the oldest computes it chunk by
    chunk (64 tokens a step) and the others take its blocks at planning time.  Only the
    step that finishes the oldest's prompt gives its spare budget to the next call, which
    computes a block or two the oldest computes in that same step; the other 16 of the
    prompt's 18 whole blocks are taken from the cache by all five other calls."""
    vocab = tiny_model.config.vocab_size
    eng = engines("together", kv_cache_tokens=8192, max_step_tokens=64)
    plain = engines("plain-together", prefix_cache=False, kv_cache_tokens=8192, max_step_tokens=64)
    shared = prompt(4, 300, vocab)
    prompts = [shared + prompt(10 + i, 5, vocab) for i in range(6)]

    async def all_at_once(engine: LocalEngine) -> list[list[int]]:
        return list(await asyncio.gather(*(complete(engine, p) for p in prompts)))

    expected = asyncio.run(all_at_once(plain))
    before = cached_tokens(eng)
    assert asyncio.run(all_at_once(eng)) == expected
    assert cached_tokens(eng) - before >= 5 * 16 * 16


def test_calls_arriving_together_under_a_prompt_shorter_than_a_step_compute_it_once(engines, tiny_model):
    """With a 100-token prompt and 512 tokens a step, all six prompts would fit in the first
    step and each would compute the shared part; instead the later ones wait one step and
    take its 6 whole blocks from the cache."""
    vocab = tiny_model.config.vocab_size
    eng = engines("together-short", kv_cache_tokens=8192, max_step_tokens=512)
    plain = engines("plain-together", prefix_cache=False, kv_cache_tokens=8192, max_step_tokens=64)
    shared = prompt(5, 100, vocab)
    prompts = [shared + prompt(30 + i, 5, vocab) for i in range(6)]

    async def all_at_once(engine: LocalEngine) -> list[list[int]]:
        return list(await asyncio.gather(*(complete(engine, p) for p in prompts)))

    expected = asyncio.run(all_at_once(plain))
    before = cached_tokens(eng)
    assert asyncio.run(all_at_once(eng)) == expected
    assert cached_tokens(eng) - before == 5 * 6 * 16


def test_a_short_shared_block_before_a_long_private_part_does_not_hold_a_prompt_back(engines, tiny_model):
    """Two prompts sharing one whole block and then 200 tokens each: waiting a step to reuse
    16 tokens would leave most of the step unused, so both are computed in the first step."""
    vocab = tiny_model.config.vocab_size
    eng = engines("short-shared", kv_cache_tokens=8192, max_step_tokens=512)
    shared = prompt(6, 16, vocab)
    prompts = [shared + prompt(40 + i, 200, vocab) for i in range(2)]
    steps: list[StepInfo] = []

    async def both() -> None:
        eng.runner.on_step = steps.append
        try:
            await asyncio.gather(*(complete(eng, p) for p in prompts))
        finally:
            eng.runner.on_step = None

    asyncio.run(both())
    assert steps[0].num_tokens == 2 * 216


def test_under_memory_pressure_cached_blocks_are_evicted_and_outputs_stay_right(engines, tiny_model):
    """A pool of 12 blocks (192 tokens) cycles through prompts of 100 tokens: blocks cached by
    one prompt are evicted to make room for the next, and a prompt that comes back is
    computed again where its blocks are gone."""
    vocab = tiny_model.config.vocab_size
    eng = engines("tight", kv_cache_tokens=192)
    plain = engines("plain-tight", prefix_cache=False, kv_cache_tokens=192)
    prompts = [prompt(20 + i, 100, vocab) for i in range(3)]
    for p in [*prompts, *prompts, prompts[0], prompts[0]]:
        assert asyncio.run(complete(eng, p)) == asyncio.run(complete(plain, p))
        stats = asyncio.run(eng.stats())
        assert stats.kv_blocks_used + stats.kv_blocks_cached <= stats.kv_blocks_total
    # prompts[0] twice in a row: the second reuses the head of its 6 blocks that the cache
    # budget (a quarter of the pool: 3 blocks) kept
    assert cached_tokens(eng) >= 48

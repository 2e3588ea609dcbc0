"""The engine pool's version: it changes exactly when what the scheduler reads of the pool
changes, so the longest-context engine asked for by every call, and the executor's scan
of the pool per round, are computed again only then (a pool of a thousand engines)."""

from __future__ import annotations

from parrot.manager.backends.pool import EnginePool
from parrot.protocol.schemas import EngineStats
from parrot.protocol.tokenizer import TextTokenizer
from tests.fake_engine import GatedEngine


def test_the_pool_version_and_the_longest_context_follow_every_change_that_matters():
    pool = EnginePool()
    tokenizer = TextTokenizer.byte_level_tiny()
    v0 = pool.version
    short = pool.register(GatedEngine(tokenizer, max_seq_len=2048))
    assert pool.version > v0 and pool.longest_context("fake") is short
    remote = pool.register(GatedEngine(tokenizer, max_seq_len=8192), url="http://engine")
    assert pool.longest_context("fake") is remote and pool.longest_context("other") is None

    v = pool.version
    pool.heartbeat(remote.engine_id, EngineStats(token_capacity=4096))  # new capacity: a change
    assert pool.version > v
    v = pool.version
    pool.heartbeat(remote.engine_id, EngineStats(token_capacity=4096, running=3))  # same for scheduling
    assert pool.version == v

    pool.suspect(remote.engine_id, "timed out")
    assert pool.version > v and pool.longest_context("fake") is short
    v = pool.version
    pool.suspect(remote.engine_id, "timed out again")  # already down: nothing new
    assert pool.version == v
    pool.heartbeat(remote.engine_id, EngineStats(token_capacity=4096))  # answers again
    assert pool.version > v and pool.longest_context("fake") is remote

    v = pool.version
    pool.drop(remote.engine_id, "test")
    assert pool.version > v and pool.longest_context("fake") is short

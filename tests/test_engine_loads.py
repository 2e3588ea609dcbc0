"""The manager's load accounting per engine (parrot.manager.sched.engine_loads): a shared
prefix counts once while a call with it runs there, and the load returns to exactly
zero however the calls that share it estimated its tokens and in whatever order they
end (a negative load made every scheduling round fail, so calls waited for ever)."""

from __future__ import annotations

import itertools

from parrot.manager.backends.pool import EnginePool
from parrot.manager.dag.prefix import PrefixIndex
from parrot.manager.sched.engine_loads import EngineLoads, PlacedShare
from parrot.protocol.tokenizer import TextTokenizer


def _loads() -> EngineLoads:
    return EngineLoads(EnginePool(), PrefixIndex(), default_capacity=32768)


def test_a_shared_prefix_counts_once_and_leaves_with_the_tokens_it_brought():
    # three calls under one start, each estimating its tokens from its own prompt
    shares = [PlacedShare(40, ("k", n), "latency", None) for n in (475, 480, 471)]
    for order in itertools.permutations(range(3)):
        loads = _loads()
        for share in shares:
            loads.account("e1", share, +1)
        assert loads.usage["e1"].load == 475 + 3 * 40  # the first call's estimate, once
        assert loads.prefix_running("k")
        for i in order:
            loads.account("e1", shares[i], -1)
        assert loads.usage["e1"].load == 0 and not loads.prefix_running("k")
        assert loads.usage["e1"].prefixes == {} and loads.usage["e1"].prefix_tokens == {}


def test_the_prefix_is_brought_again_after_every_call_with_it_left():
    loads = _loads()
    a, b = PlacedShare(10, ("k", 300), "throughput", "g"), PlacedShare(12, ("k", 310), "throughput", "g")
    loads.account("e1", a, +1)
    loads.account("e1", a, -1)
    loads.account("e1", b, +1)  # brings it again, with its own estimate
    assert loads.usage["e1"].load == 322
    loads.account("e1", b, -1)
    assert loads.usage["e1"].load == 0 and loads.usage["e1"].groups == {}


def test_a_load_below_zero_is_logged_and_scheduled_as_zero(caplog):
    """Should the accounting ever go wrong, rounds go on (a snapshot with a negative load is
    refused, which failed every round) and the log says which engine."""
    loads = _loads()
    handle = loads.pool.register(_Idle())
    loads.account(handle.engine_id, PlacedShare(5, None, "latency", None), +1)
    loads.account(handle.engine_id, PlacedShare(10, None, "latency", None), -1)  # a mismatched share
    with caplog.at_level("ERROR", logger="parrot.manager.sched.engine_loads"):
        snap = loads.snapshot(handle)
    assert snap.token_load == 0 and "fell to -5" in caplog.text


class _Idle:
    """An engine that is never asked to do anything here."""

    model_name = "fake"
    max_seq_len = 4096

    def __init__(self) -> None:
        self.tokenizer = TextTokenizer.byte_level_tiny()

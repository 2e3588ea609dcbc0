"""A bug that surfaces while one queued call is scheduled fails that call, and only it:
scheduling rounds go on, and every other call completes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import parrot as P
from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol.tokenizer import TextTokenizer
from tests.conftest import start_server
from tests.fake_engine import GatedEngine, GatedServer

WAIT = 10.0


class BrokenTokenizer(TextTokenizer):
    """Raises ``StopIteration`` (not a ParrotError) on any text that contains ``BOOM``."""

    def encode(self, text: str) -> list[int]:
        if "BOOM" in text:
            raise StopIteration
        return super().encode(text)


@pytest.fixture
def server() -> Iterator[GatedServer]:
    engine = GatedEngine(BrokenTokenizer.from_dict(TextTokenizer.byte_level_tiny().to_dict()))
    manager = Manager(ManagerConfig())
    manager.pool.register(engine, name="broken-tokenizer")
    live = start_server(manager, record=False)
    yield GatedServer(live, engine)
    live.stop()


def test_a_call_whose_render_raises_fails_alone_and_rounds_go_on(server):
    out = P.Output(max_tokens=1)
    bad_fn = P.template_function("Say BOOM {{input:g}} =>{{output:o}}", name="bad", o=out)
    good_fn = P.template_function("Say fine {{input:g}} =>{{output:o}}", name="good", o=out)
    with P.connect(server.live.url, timeout=WAIT) as s:
        gate = s.variable(name="g")  # nothing renders at submit: the input is unknown
        bad, good = bad_fn(g=gate), good_fn(g=gate)
        gate.set("go")  # both are queued at once, for the same scheduling round
        assert good.get(timeout=WAIT) == "A"
        with pytest.raises(P.CallFailed) as failed:
            bad.get(timeout=WAIT)
        # later calls are scheduled too
        assert good_fn(g="again").get(timeout=WAIT) == "A"
    message = failed.value.message
    bad_id = failed.value.detail.get("call_id")
    assert "StopIteration" in message and bad_id is not None and bad_id in message
    assert server.state(lambda m: not m.executor._queue and not m.executor._placed)

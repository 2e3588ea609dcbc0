"""A call whose transform backtracks catastrophically fails alone, within its budget, while
the manager keeps answering everyone else."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

import parrot as P
from parrot.manager.service import Manager, ManagerConfig
from parrot.protocol import transforms as T
from parrot.protocol.sampling import SamplingParams
from parrot.protocol.schemas import GenerateChunk
from parrot.protocol.template import MAX_PLACEHOLDERS
from tests.api_client import STALL_LIMIT_S, healthz_stalls
from tests.conftest import start_server
from tests.fake_engine import GatedEngine

EVIL_OUTPUT = "a" * 40 + "!"


class FixedTextEngine(GatedEngine):
    """Answers every generate with :data:`EVIL_OUTPUT`."""

    async def generate(
        self,
        sampling: SamplingParams,
        context_id: int,
        parent_context_id: int | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[GenerateChunk]:
        yield GenerateChunk(token_ids=[97], text=EVIL_OUTPUT, done=True, finish_reason="length")


@pytest.mark.timing
def test_a_backtracking_transform_fails_its_call_and_never_stalls_the_manager() -> None:
    live = start_server(Manager(ManagerConfig()))
    live.manager.pool.register(FixedTextEngine(), name="fixed")
    try:
        with healthz_stalls(live.url) as stalls:
            backtracking = P.Output(max_tokens=4, transform=P.transforms.regex(r"(a|aa)+$"))
            evil = P.template_function("x {{input:a}} {{output:b}}", b=backtracking)
            plain = P.template_function("y {{input:a}} {{output:b}}", b=P.Output(max_tokens=4))
            with P.connect(live.url):
                started = time.monotonic()
                bad = [evil(a=str(i)) for i in range(3)]
                good = plain(a="fine")
                assert good.get(timeout=30) == EVIL_OUTPUT
                for out in bad:
                    with pytest.raises(P.TransformFailed, match="budget"):
                        out.get(timeout=30)
                assert time.monotonic() - started < 3 * T.MAX_REGEX_SECONDS + 5
    finally:
        live.stop()
    assert stalls and max(stalls) < STALL_LIMIT_S, max(stalls)


def many_placeholders(count: int) -> tuple[str, list[dict]]:
    """A template of ``count`` input placeholders over 1,023 names (each bound to a value)
    and one output, and its bindings."""
    names = [f"v{i}" for i in range(1023)]
    template = "".join(f"{{{{input:{names[i % len(names)]}}}}}" for i in range(count - 1)) + "{{output:o}}"
    bindings = [{"name": n, "direction": "input", "value": "x"} for n in names]
    bindings.append({"name": "o", "direction": "output", "sampling": {"max_tokens": 2}})
    return template, bindings


@pytest.mark.timing
def test_a_template_of_many_placeholders_is_checked_in_linear_time(raw, bystander) -> None:
    """The most placeholders a template may have, over 1,023 names: answered at once (a
    per-name scan of the placeholders took ~a minute at 66,000); one more is refused
    before it is parsed."""
    template, bindings = many_placeholders(MAX_PLACEHOLDERS)
    with healthz_stalls(str(raw.http.base_url)) as stalls:
        started = time.monotonic()
        resp = raw.submit(template, bindings)
        elapsed = time.monotonic() - started
        # the rendered prompt (4,095 tokens) is longer than the engine's context: a 400 saying so
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_too_long", resp.text
        assert elapsed < 3.0, elapsed  # ~0.03 s alone; up to ~1 s with the whole suite's threads about
        resp = raw.submit(*many_placeholders(66_000))
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_template", resp.text
        assert f"more than {MAX_PLACEHOLDERS} placeholders" in resp.json()["error"]["message"]
    assert stalls and max(stalls) < STALL_LIMIT_S, max(stalls)
    assert raw.graph() == {"calls": [], "variables": []}
    bystander.finish()

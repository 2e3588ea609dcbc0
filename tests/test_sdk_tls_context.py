"""Opening a session costs no TLS set-up of its own: the SDK's HTTP clients share one
context (:func:`parrot.protocol.tls.tls_context`), built once per process.

httpx builds a verifying context per client unless given one, loading the whole CA
bundle each time; an application that opens a session per request (the suite's
clients, a web handler per user request) paid that CPU on every request.
"""

import asyncio
import ssl
from collections.abc import Iterator

import pytest

import parrot as P
from parrot.integrations.langchain import ParrotLLM
from parrot.protocol.tls import tls_context

WAIT = 60.0


@pytest.fixture
def ca_loads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many times a CA bundle is loaded from now on (a fresh process's view)."""
    loads: list[int] = []
    load = ssl.SSLContext.load_verify_locations

    def counting(self: ssl.SSLContext, *args: object, **kwargs: object) -> None:
        loads.append(1)
        load(self, *args, **kwargs)

    tls_context.cache_clear()
    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counting)
    yield loads
    tls_context.cache_clear()


def test_many_sessions_load_the_ca_bundle_once_and_still_work(live, ca_loads: list[int]) -> None:
    echo = P.template_function("Say: {{input:word}}{{output:answer}}", answer=P.Output(max_tokens=2))
    values = []
    for _ in range(3):
        with P.connect(live.url, timeout=WAIT):
            values.append(echo("hi").get())

    async def async_sessions() -> list[str]:
        out = []
        for _ in range(3):
            async with P.aconnect(live.url, timeout=WAIT, defer_open=True):
                out.append(await echo("hi").aget())
        return out

    values += asyncio.run(async_sessions())
    assert len(ca_loads) == 1, f"{len(ca_loads)} CA bundle loads for six sessions"
    assert len(values) == 6 and all(isinstance(v, str) for v in values)
    assert len(set(values)) == 1, "the same greedy call gave different answers across sessions"


def test_the_langchain_model_reuses_the_context_across_calls(live, ca_loads: list[int]) -> None:
    llm = ParrotLLM(base_url=live.url, max_tokens=2, temperature=0.0)
    answers = [llm.invoke("Say hi") for _ in range(3)]
    assert len(ca_loads) == 1, f"{len(ca_loads)} CA bundle loads for three requests"
    assert len(set(answers)) == 1

"""A streamed completion of several choices never sleeps through a change: every change to
a choice made after the stream last read it ends the stream's wait (the stream is
:func:`parrot.manager.openai.response._stream`; each test fails with a 20-30 s stall, caught
by its 5 s limit, when a change is lost)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from parrot.manager.dag.graph import Variable
from parrot.manager.openai.response import _stream, _wait_any


def _set_ready(var: Variable, value: str) -> None:
    var.value, var.state = value, "ready"
    var.notify()


def test_a_change_before_the_waits_first_step_ends_the_wait() -> None:
    """The wait for any of several variables is registered when it is called, not when its
    inner tasks first run: a change in between (another task finishing a choice) counts."""

    async def main() -> tuple[float, int]:
        a, b = Variable("v-a", "s"), Variable("v-b", "s")
        loop = asyncio.get_running_loop()
        start = loop.time()
        waiting = asyncio.ensure_future(_wait_any([a, b], 20.0))
        await asyncio.sleep(0)  # the wait has taken its first step, and no more
        b.notify()
        await asyncio.wait_for(waiting, 5.0)
        return loop.time() - start, len(a._waiters or []) + len(b._waiters or [])

    took, left = asyncio.run(main())
    assert took < 5.0
    assert left == 0  # the wait leaves no future behind on either variable


class _Completion:
    """What ``_stream`` reads of a completion: its choices, their chunks, their calls' ends."""

    chat = False

    def __init__(self, variables: list[Variable]) -> None:
        outs = [SimpleNamespace(var=v, logprobs=[]) for v in variables]
        self.choices = [
            SimpleNamespace(index=i, call=f"call-{i}", out=o, var=o.var) for i, o in enumerate(outs)
        ]

    def chunk(self, index: int, text: str, finish: str | None, **_: Any) -> dict[str, Any]:
        return {"index": index, "text": text, "finish_reason": finish}

    async def wait_call(self, calls: list[str] | None = None) -> None:
        await asyncio.sleep(0)

    def finish_reason(self, choice: Any) -> str:
        return "stop"

    def logprobs(self, choice: Any, entries: list[Any], chars: int) -> None:
        return None

    def tokenizer(self, call: str) -> None:
        return None

    def close(self) -> None:
        pass


def test_a_choice_ending_while_another_is_sent_is_not_slept_through() -> None:
    """Choice 1 is ready first; while its text goes out, choice 0 ends too.  The stream has
    read choice 0 (pending) before that, so it must read it again before it waits."""

    async def main() -> list[dict[str, Any]]:
        first, second = Variable("v-0", "s"), Variable("v-1", "s")
        _set_ready(second, "b")
        stream = _stream(_Completion([first, second]), include_usage=False)  # type: ignore[arg-type]
        sent = [await stream.__anext__()]  # choice 1's text; choice 0 was read pending
        _set_ready(first, "a")  # nobody is waiting on it yet
        sent += [chunk async for chunk in stream]
        return [json.loads(c[len(b"data: ") :]) for c in sent if c != b"data: [DONE]\n\n"]

    chunks = asyncio.run(asyncio.wait_for(main(), 5.0))
    assert {(c["index"], c["text"]) for c in chunks if c["text"]} == {(0, "a"), (1, "b")}
    assert sorted(c["index"] for c in chunks if c["finish_reason"] == "stop") == [0, 1]

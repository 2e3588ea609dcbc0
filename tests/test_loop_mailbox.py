"""The worker-to-event-loop handoff of the local engine (parrot.engine.local._LoopMailbox)."""

from __future__ import annotations

import asyncio
import threading

from parrot.engine.local import _LoopMailbox


class _Counting(_LoopMailbox):
    drains = 0

    def _drain(self) -> None:
        self.drains += 1
        super()._drain()


def _post_from_thread(box: _LoopMailbox, deliver: object, items: range) -> threading.Thread:
    t = threading.Thread(target=lambda: [box.post(deliver, i) for i in items])  # type: ignore[arg-type]
    t.start()
    return t


def test_a_batch_posted_while_the_loop_is_busy_arrives_in_one_wakeup() -> None:
    async def main() -> tuple[list[int], int]:
        box = _Counting(asyncio.get_running_loop())
        got: list[int] = []
        _post_from_thread(box, got.append, range(3200)).join()  # the loop is blocked meanwhile
        while len(got) < 3200:
            await asyncio.sleep(0.001)
        return got, box.drains

    got, drains = asyncio.run(main())
    assert got == list(range(3200)) and drains == 1


def test_items_posted_while_the_loop_runs_arrive_once_in_order() -> None:
    async def main() -> list[int]:
        box = _LoopMailbox(asyncio.get_running_loop())
        got: list[int] = []
        t = _post_from_thread(box, got.append, range(20_000))
        while len(got) < 20_000:
            await asyncio.sleep(0)
        t.join()
        await asyncio.sleep(0.01)  # nothing more arrives
        return got

    assert asyncio.run(main()) == list(range(20_000))


def test_items_posted_during_a_step_wake_the_loop_once_after_it() -> None:
    """A step's tokens (posted while ``defer`` accepts the wake-up, as the runner's
    after_step does inside a step) wake the loop once, when the step ends, not mid-step."""

    async def main() -> tuple[list[int], list[int], int]:
        deferred: list = []
        stepping = True
        box = _Counting(asyncio.get_running_loop(), lambda fn: stepping and (deferred.append(fn) or True))
        got: list[int] = []
        _post_from_thread(box, got.append, range(50)).join()
        await asyncio.sleep(0.01)
        during = list(got)  # the loop ran, but no wake-up was scheduled yet
        assert len(deferred) == 1
        stepping = False
        deferred.pop()()  # the step ends
        while len(got) < 50:
            await asyncio.sleep(0.001)
        box.post(got.append, 50)  # outside a step: at once
        while len(got) < 51:
            await asyncio.sleep(0.001)
        return during, got, box.drains

    during, got, drains = asyncio.run(main())
    assert during == [] and got == list(range(51)) and drains == 2

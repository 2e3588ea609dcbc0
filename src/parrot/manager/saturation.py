"""How many latency calls an engine should batch when they queue for it.

The latency cap (:mod:`parrot.manager.scheduler`) keeps an engine's per-token
latency within 25 % of its unloaded value: it is the load at which a decode step
takes 1.25 times an unloaded one (:mod:`parrot.engine.latency_probe`).  That is
the right bound while latency calls find room.  Once they queue, each queued
call's latency is mostly its wait, and the question becomes which batch size
finishes the waiting calls soonest on average.

*Model.*  ``N`` latency calls compete for an engine; each has ``P`` prompt
tokens of its own to prefill and ``O`` tokens to generate.  Served in batches of
``k``, one batch takes ``k * P * p + O * (a + c * k)`` seconds: prefill does not
batch (its cost is per token, ``p``), decoding does (a step costs ``a``
unloaded plus ``c`` per sequence in it).  The batches finish one after another,
so the mean completion time is ``(N / k + 1) / 2`` batches, and it is smallest at

    k* = sqrt(N * O * a / (P * p + O * c))

In units of an unloaded decode step ``a``: ``P * p / a = P / prefill_tokens_per_step``
(how many prompt tokens cost one unloaded decode step: 16-29 on this project's
2-core Xeon, ``docs/engine.md``; a few hundred on a GPU), and, from the cap's own
definition (a load of ``cap`` tokens makes a step 1.25 times slower),
``c / a = 0.25 * T / cap`` for a call holding ``T`` KV tokens on average over
its life (``P + O / 2``).

Prompt-heavy calls (a chain's step over a fresh chunk) get ``k*`` near what the
cap admits already; calls that decode much after a short prompt of their own
(requests under one cached system prompt) get larger batches: the decode steps
they share cost little more than one.  With one call waiting, ``k*`` is below
the cap and nothing changes.
"""

from __future__ import annotations

import math

__all__ = ["CAP_SLOWDOWN", "batch_tokens"]

CAP_SLOWDOWN = 0.25
"""How much slower than an unloaded one a decode step is at the latency cap (1.25x)."""


def batch_tokens(
    competing: float,
    own_tokens: int,
    new_tokens: int,
    shared_tokens: int,
    latency_cap: int,
    prefill_tokens_per_step: float,
) -> int:
    """The token load up to which an engine should take latency calls like this one
    when ``competing`` of them compete for it (running there or queued): room for
    ``k*`` calls of ``own_tokens`` KV tokens each (``new_tokens`` of them generated)
    next to the ``shared_tokens`` of a prefix they share.  Never below
    ``latency_cap``; the caller bounds it by the engine's token capacity."""
    out = min(max(new_tokens, 0), own_tokens)
    if competing <= 1 or out <= 0 or latency_cap <= 0 or prefill_tokens_per_step <= 0:
        return latency_cap
    prompt = own_tokens - out
    mean_held = prompt + out / 2
    per_call_cost = prompt / prefill_tokens_per_step + out * CAP_SLOWDOWN * mean_held / latency_cap
    if per_call_cost <= 0:
        return latency_cap
    k = math.sqrt(competing * out / per_call_cost)
    return max(latency_cap, shared_tokens + int(k * own_tokens))

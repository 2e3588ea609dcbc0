"""How many latency calls an engine should batch when they queue for it.

The latency cap (:mod:`parrot.manager.sched.scheduler`) keeps an engine's per-token
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
(how many prompt tokens cost one unloaded decode step: each engine measures it,
:mod:`parrot.engine.latency_probe`; tens on a 2-core CPU, a few hundred on a GPU),
and, from the cap's own
definition (a load of ``cap`` tokens makes a step 1.25 times slower),
``c / a = 0.25 * T / cap`` for a call holding ``T`` KV tokens on average over
its life (``P + O / 2``).

Prompt-heavy calls (a chain's step over a fresh chunk) get ``k*`` near what the
cap admits already; calls that decode much after a short prompt of their own
(requests under one cached system prompt) get larger batches: the decode steps
they share cost little more than one.  With one call waiting, ``k*`` is below
what the cap admits and nothing changes.

``k*`` is a number of calls, not of tokens: an engine's load also holds the
prefixes its calls share (several system prompts, say), which the batch does
not grow with.  For the same reason ``P`` leaves out a call's shared prefix (a
system prompt no engine runs at the moment, so the scheduler counts it in the
call's tokens): the prefix is computed once per engine (by the first call that
brings it, if the engine's prefix cache does not hold it already) and then read
from the prefix cache, so over the calls sharing it it is load, not prompt work of
any one call.  (Where two system prompts fill an engine's latency cap, as on the
suite's fig. 17 with one-thread engines, a call counted whole would look
prompt-heavy and wait for a running call to end even at a low rate.)
"""

from __future__ import annotations

import math

__all__ = ["CAP_SLOWDOWN", "batch_calls"]

CAP_SLOWDOWN = 0.25
"""How much slower than an unloaded one a decode step is at the latency cap (1.25x)."""


def batch_calls(
    competing: float,
    own_tokens: int,
    new_tokens: int,
    latency_cap: int,
    prefill_tokens_per_step: float,
    shared_tokens: int = 0,
) -> float:
    """``k*``: how many latency calls like this one (``own_tokens`` KV tokens of its own,
    ``new_tokens`` of them generated) an engine should run at once when ``competing`` of
    them compete for it (running there or queued); 0 when nothing argues for a batch
    (one call competing, nothing to generate).  The caller admits a call past the cap
    while the engine runs fewer than ``k*`` latency calls, within its token capacity.

    ``shared_tokens`` of the prompt are a shared prefix (a system prompt that no engine
    runs at the moment): they count in what the call holds (its steps read them), but
    not in its prompt cost ``P``: a shared prefix is computed at most once per engine and
    read from the prefix cache by the calls after, so its cost is not any one call's."""
    out = min(max(new_tokens, 0), own_tokens)
    if competing <= 1 or out <= 0 or latency_cap <= 0 or prefill_tokens_per_step <= 0:
        return 0.0
    prompt = own_tokens - out
    computed = max(prompt - max(shared_tokens, 0), 0)
    mean_held = prompt + out / 2
    per_call_cost = computed / prefill_tokens_per_step + out * CAP_SLOWDOWN * mean_held / latency_cap
    return math.sqrt(competing * out / per_call_cost)

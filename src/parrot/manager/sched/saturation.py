"""How many latency calls an engine should batch when they queue for it.

Once latency calls queue, their latency is mostly their wait, and the batch size that
finishes them soonest on average is ``k* = sqrt(N * O * a / (P * p + O * c))`` for ``N``
calls competing per engine, ``P`` prompt tokens of their own and ``O`` to generate
(:func:`batch_calls`, in units of an unloaded decode step).  The model, its terms and
why a shared prefix is left out of ``P``: docs/scheduling.md, "Saturation batching:
the batch size".
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

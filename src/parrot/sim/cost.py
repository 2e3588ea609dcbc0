"""How long one engine step takes, as a function of what the step computes.

A step (:mod:`parrot.engine.step_planner`) computes some prompt tokens (prefill)
and one token for each decoding sequence, and its attention reads KV tokens.  The
model is linear in those quantities::

    seconds = base + prefill_tokens * per_prefill_token
                   + decode_seqs * per_decode_seq
                   + kv_tokens_read * per_kv_token

``kv_tokens_read`` counts the KV tokens of the step's sequences; with
``share_prefix`` a block that several sequences share is read once (the
shared-prefix attention), else once per sequence (per-sequence attention).  The
parameters of one engine are a :class:`StepCost`; :data:`SMOLLM2_BF16_XEON2`
is the built-in engine on this project's 2-core Xeon.

The model is a first-order one: it has no term for attention's quadratic cost in
long prompts nor for batching efficiency changing with the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SMOLLM2_BF16_XEON2", "StepCost"]


@dataclass(frozen=True)
class StepCost:
    base: float  # seconds of a step whatever it computes (reading the weights once)
    per_prefill_token: float
    per_decode_seq: float
    per_kv_token: float

    def __post_init__(self) -> None:
        for name in ("base", "per_prefill_token", "per_decode_seq", "per_kv_token"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"StepCost.{name} must be >= 0, got {value!r}")

    def seconds(self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: int) -> float:
        return (
            self.base
            + prefill_tokens * self.per_prefill_token
            + decode_seqs * self.per_decode_seq
            + kv_tokens_read * self.per_kv_token
        )

    def latency_cap(self, factor: float, capacity: int) -> int:
        """The KV load at which a decode step of one sequence takes ``factor`` times its
        unloaded time (the engine's latency cap, :mod:`parrot.engine.latency_probe`),
        at most ``capacity``."""
        unloaded = self.base + self.per_decode_seq
        if self.per_kv_token <= 0:
            return capacity
        return max(1, min(capacity, int((factor - 1.0) * unloaded / self.per_kv_token)))


SMOLLM2_BF16_XEON2 = StepCost(
    base=0.0120,
    per_prefill_token=0.00060,
    per_decode_seq=0.0003,
    per_kv_token=0.0000012,
)
"""SmolLM2-135M, bf16 weights and KV cache, on the 2-core Xeon: a decode step of one
sequence ~12.8 ms and of 64 sequences of 250-token contexts ~52.6 ms; prefill about
1,300-2,250 tokens/s (``docs/engine.md``, "Prefill and decode against batch size",
``python benchmarks/batch_steps.py --dtype bfloat16``).  A first fit by hand from
that table, not a calibration."""

"""How long one engine step takes, as a function of what the step computes.

A step (:mod:`parrot.engine.core.step_planner`) computes some prompt tokens (prefill)
and one token for each decoding sequence, and its attention reads KV tokens.  The
model is linear in those quantities::

    seconds = base + prefill_tokens * per_prefill_token
                   + decode_seqs * per_decode_seq
                   + kv_tokens_read * per_kv_token
                   + prefill_pairs * per_prefill_pair
                   + (per_prompt_step if prefill_tokens else 0)

* ``kv_tokens_read`` counts the KV tokens of the step's sequences; with
  ``share_prefix`` a block that several sequences share is read once (the
  shared-prefix attention), else once per sequence (per-sequence attention).
  It is the memory side of attention (what a decode step streams).
* ``prefill_pairs`` counts (query, key) pairs of the prompt chunks' causal
  attention: a chunk of ``n`` tokens starting at position ``s`` has
  ``n * s + n * (n + 1) / 2``.  It is the compute side, quadratic in prompt length.
* ``per_prompt_step`` is what a step that computes prompt tokens costs beyond
  the rest: on the CPU engine a decode-only step runs the C forward
  (:mod:`parrot.engine.step_forward`), any other the model's PyTorch forward,
  whose fixed cost per step is higher.  Without it, served steps mixing prompt
  chunks with decodes came out at 0.82x of their time (``docs/simulation.md``).

:func:`~parrot.engine.core.step_work.step_work` computes the four quantities from a
planned step, the same way for the simulated engine, for the calibration that
times the real one (``python -m benchmarks.sim.calibrate``) and for the real
engine's step log (:mod:`parrot.engine.step_log`).  A :class:`CostProfile` is one
engine's parameters with the KV cache size of its hardware; the built-in ones are
in :data:`PROFILES` (GPU ones in :mod:`parrot.sim.gpu_cost`), and
:func:`load_profile` also reads a calibration's JSON file.

The model has no term for batching efficiency changing with the batch size nor
for the overlap of compute and memory traffic (it adds them).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from parrot.engine.core.latency_fit import StepFit, cap_from_fit
from parrot.engine.core.step_work import StepWork, step_work

__all__ = ["SMOLLM2_BF16_XEON2", "CostProfile", "StepCost", "StepWork", "load_profile", "step_work"]

FORMAT = "parrot-step-cost/1"
"""The ``format`` field of a cost JSON file (:meth:`CostProfile.to_json`)."""


@dataclass(frozen=True)
class StepCost:
    """Seconds per unit of each term of the model; every parameter is >= 0."""

    base: float  # seconds of a step whatever it computes (reading the weights once)
    per_prefill_token: float
    per_decode_seq: float
    per_kv_token: float
    per_prefill_pair: float = 0.0
    per_prompt_step: float = 0.0  # a step with prompt tokens, beyond the other terms

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or not value >= 0 or value == float("inf"):
                raise ValueError(f"StepCost.{f.name} must be a finite number >= 0, got {value!r}")

    def seconds(
        self, prefill_tokens: int, decode_seqs: int, kv_tokens_read: int, prefill_pairs: int = 0
    ) -> float:
        return (
            self.base
            + prefill_tokens * self.per_prefill_token
            + decode_seqs * self.per_decode_seq
            + kv_tokens_read * self.per_kv_token
            + prefill_pairs * self.per_prefill_pair
            + (self.per_prompt_step if prefill_tokens else 0.0)
        )

    def step_seconds(self, work: StepWork) -> float:
        return self.seconds(work.prefill_tokens, work.decode_seqs, work.kv_tokens_read, work.prefill_pairs)

    def prefill_tokens_per_decode_step(self) -> float:
        """How many prompt tokens cost one unloaded decode step of one sequence (two
        significant digits, as the engine reports it: :mod:`parrot.engine.core.latency_fit`);
        0 when prompt tokens cost nothing here."""
        if self.per_prefill_token <= 0:
            return 0.0
        return float(f"{(self.base + self.per_decode_seq) / self.per_prefill_token:.2g}")

    def latency_cap(self, factor: float, capacity: int) -> int:
        """The KV load at which a decode step of one sequence takes ``factor`` times its
        unloaded time: the cap the built-in engine's probe would fit to these step
        times, through the same :func:`~parrot.engine.core.latency_fit.cap_from_fit` (so
        within ``[min(MIN_LATENCY_CAP_TOKENS, capacity), capacity]``, as the engine's)."""
        fit = StepFit(self.base + self.per_decode_seq, max(0.0, self.per_kv_token), buckets=2, steps=0)
        return cap_from_fit(fit, capacity, factor=factor)


@dataclass(frozen=True)
class CostProfile:
    """An engine's step cost and the KV cache its hardware holds (``kv_cache_tokens``;
    None: the simulated engine's default).  ``meta`` says where the numbers come from
    (for a calibration: machine, commit, model, points and errors)."""

    name: str
    cost: StepCost
    kv_cache_tokens: int | None = None
    meta: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_tokens is not None and (
            not isinstance(self.kv_cache_tokens, int) or self.kv_cache_tokens < 1
        ):
            raise ValueError(f"kv_cache_tokens must be a positive integer, got {self.kv_cache_tokens!r}")

    def to_json(self) -> str:
        body = {"format": FORMAT, "name": self.name, "cost": asdict(self.cost)}
        body["kv_cache_tokens"] = self.kv_cache_tokens
        body["meta"] = self.meta or {}
        return json.dumps(body, indent=1)

    @classmethod
    def from_json(cls, text: str, origin: str = "cost file") -> CostProfile:
        """Parse :meth:`to_json`'s output; a ValueError naming ``origin`` and the fault otherwise."""
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{origin}: not JSON ({exc})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ValueError(f"{origin}: not a step-cost file (its 'format' must be {FORMAT!r})")
        params = body.get("cost")
        known = [f.name for f in fields(StepCost)]
        if not isinstance(params, dict) or not set(known[:4]) <= set(params) <= set(known):
            raise ValueError(
                f"{origin}: 'cost' must be an object with the fields {known} (the last two optional)"
            )
        try:
            cost = StepCost(**params)
            return cls(str(body.get("name", origin)), cost, body.get("kv_cache_tokens"), body.get("meta"))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{origin}: {exc}") from None


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
that table, not a calibration (``python -m benchmarks.sim.calibrate`` makes one)."""


def builtin_profiles() -> dict[str, CostProfile]:
    """The built-in profiles by name (the GPU ones from published figures)."""
    from parrot.sim.gpu_cost import LLAMA7B_A100, LLAMA7B_A6000, LLAMA13B_A100

    return {
        "smollm2-bf16-xeon2": CostProfile("smollm2-bf16-xeon2", SMOLLM2_BF16_XEON2),
        "llama7b-a6000": LLAMA7B_A6000,
        "llama13b-a100": LLAMA13B_A100,
        "llama7b-a100": LLAMA7B_A100,
    }


PROFILES = ("smollm2-bf16-xeon2", "llama7b-a6000", "llama13b-a100", "llama7b-a100")
"""Names :func:`load_profile` knows without a file."""


def load_profile(spec: str) -> CostProfile:
    """A built-in profile by name, or a cost JSON file by path (a calibration's output).
    ValueError with a message for the user when it is neither."""
    profiles = builtin_profiles()
    if spec in profiles:
        return profiles[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"unknown cost {spec!r}: not one of {', '.join(PROFILES)} nor a file")
    return CostProfile.from_json(path.read_text(), origin=str(path))

"""Fit a :class:`~parrot.sim.cost.StepCost` to timed steps by least squares (numpy only).

Each sample is a step's :class:`~parrot.sim.cost.StepWork` and the seconds it took.
The fit minimises the squared *relative* error (each row weighted by 1 / its time),
so a 10 ms decode step counts as much as a 1 s prefill step (or, with
``relative=False``, the squared error in seconds); the parameters are
kept >= 0 (a term that would come out negative is dropped and the rest refitted,
the active-set method for so few terms), since a step never gets faster for doing
more.  ``terms`` chooses which of the model's terms are fitted (the others stay 0):
a term whose column is all zero in the samples cannot be fitted and raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from parrot.sim.cost import StepCost, StepWork

__all__ = ["TERMS", "Fit", "fit_step_cost"]

TERMS = ("base", "per_prefill_token", "per_decode_seq", "per_kv_token", "per_prefill_pair", "per_prompt_step")
"""The model's terms, in StepCost's order."""


@dataclass(frozen=True)
class Fit:
    """The fitted cost, each sample's relative error ``(model - measured) / measured``,
    and their root mean square."""

    cost: StepCost
    rel_errors: tuple[float, ...]

    @property
    def rms_rel_error(self) -> float:
        return float(np.sqrt(np.mean(np.square(self.rel_errors)))) if self.rel_errors else 0.0

    @property
    def max_abs_rel_error(self) -> float:
        return float(np.max(np.abs(self.rel_errors))) if self.rel_errors else 0.0


def _column(work: StepWork, term: str) -> float:
    return {
        "base": 1.0,
        "per_prefill_token": work.prefill_tokens,
        "per_decode_seq": work.decode_seqs,
        "per_kv_token": work.kv_tokens_read,
        "per_prefill_pair": work.prefill_pairs,
        "per_prompt_step": 1.0 if work.prefill_tokens else 0.0,
    }[term]


def fit_step_cost(
    samples: Sequence[tuple[StepWork, float]], terms: Sequence[str] = TERMS, *, relative: bool = True
) -> Fit:
    """Least-squares fit of the chosen ``terms`` to ``samples`` (work, seconds > 0).
    ``relative`` (default): minimise the squared relative errors; False: the squared
    errors in seconds, so long steps weigh as much as their time (the fit for a
    served run, whose total time the simulator must match)."""
    unknown = [t for t in terms if t not in TERMS]
    if unknown:
        raise ValueError(f"unknown terms {unknown}; the model's terms are {list(TERMS)}")
    if len(samples) < len(terms):
        raise ValueError(f"{len(samples)} samples cannot fit {len(terms)} terms")
    seconds = np.array([s for _, s in samples], dtype=float)
    if not np.all(seconds > 0):
        raise ValueError("every sample's time must be > 0")
    x = np.array([[_column(w, t) for t in terms] for w, _ in samples], dtype=float)
    empty = [t for j, t in enumerate(terms) if not np.any(x[:, j])]
    if empty:
        raise ValueError(f"no sample exercises {empty}: the grid cannot fit them")
    # relative error: divide each row by its time; scale columns so lstsq is well conditioned
    a = x / seconds[:, None] if relative else x
    scale = np.max(np.abs(a), axis=0)
    a = a / scale
    b = np.ones_like(seconds) if relative else seconds
    active = list(range(len(terms)))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if np.all(coef >= 0) or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))  # the most negative term leaves the fit
    params = dict.fromkeys(TERMS, 0.0)
    for j, c in zip(active, coef, strict=True):
        params[terms[j]] = max(0.0, float(c / scale[j]))
    cost = StepCost(**params)
    model = np.array([cost.step_seconds(w) for w, _ in samples])
    return Fit(cost, tuple(float(e) for e in (model - seconds) / seconds))

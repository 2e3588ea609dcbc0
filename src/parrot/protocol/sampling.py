"""Sampling settings of one generated output, validated once at the boundary."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from parrot.protocol.constraint import Constraint
from parrot.protocol.errors import InvalidSampling

MAX_STOP_STRINGS = 16
MIN_TEMPERATURE = 1e-5
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64  # each is checked on every decode step of the request
MAX_LOGPROBS = 20  # most likely tokens reported per generated token (OpenAI's chat limit)
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty / frequency_penalty is [-2, 2]
MAX_TOP_K = (1 << 31) - 1  # anything >= the vocabulary means "no limit"; must fit the engine's int64 tensors


@dataclass(frozen=True)
class SamplingParams:
    """How to generate one output.

    Invariants (checked by :meth:`validate`): ``max_tokens >= 1``;
    ``temperature >= 0`` (0 means greedy); ``0 < top_p <= 1``; ``top_k >= 0``
    (0 means no limit); stop strings are non-empty; the penalties lie in
    ``[-MAX_PENALTY, MAX_PENALTY]``.

    ``constraint`` (a JSON schema, regex or choice list, :mod:`parrot.protocol.constraint`)
    restricts the output to a language: the engine masks every other token while
    decoding.  On the wire it is ``{"json_schema": ...}``, ``{"regex": ...}`` or
    ``{"choices": [...]}``, and left out when None.

    ``presence_penalty`` and ``frequency_penalty`` are OpenAI's: before any other
    step, a token generated ``c > 0`` times so far in this output has its logit
    lowered by ``c * frequency_penalty + presence_penalty`` (prompt tokens do not
    count).  Both 0 (the default) leave the logits untouched.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # report each generated token's logprob and this many most likely alternatives
    # (0..MAX_LOGPROBS); None: no logprobs
    logprobs: int | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            object.__setattr__(self, "constraint", Constraint.from_dict(self.constraint))
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            # a bare string would silently become its characters, a number a TypeError (HTTP 500)
            if not isinstance(value, (list, tuple)):
                raise InvalidSampling(
                    f"invalid sampling: {name} must be a list, got {type(value).__name__} {value!r:.100}"
                )
            object.__setattr__(self, name, tuple(value))
        self.validate()

    @property
    def greedy(self) -> bool:
        """Temperatures below ``MIN_TEMPERATURE`` are greedy: dividing logits by
        them would overflow to inf/NaN."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the logits are penalised for tokens already generated."""
        return bool(self.presence_penalty or self.frequency_penalty)

    def validate(self) -> None:
        def bad(msg: str) -> InvalidSampling:
            return InvalidSampling(f"invalid sampling: {msg}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise bad(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        if (
            isinstance(self.top_k, bool)
            or not isinstance(self.top_k, int)
            or not 0 <= self.top_k <= MAX_TOP_K
        ):
            raise bad(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 disables it), got {self.top_k!r}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, got {self.logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            raise bad(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad(f"seed must be an integer or null, got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise bad(f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_CHARS} chars")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad(f"stop_token_ids must be non-negative integers, got {t!r}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form.  The penalties are left out at 0, ``logprobs`` and ``constraint`` when None, so
        that an engine that predates them (whose :meth:`from_dict` refuses unknown
        fields) still takes what it can honour."""
        d = asdict(self)
        if self.constraint is None:
            del d["constraint"]
        else:
            d["constraint"] = self.constraint.to_dict()
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        for name in ("presence_penalty", "frequency_penalty"):
            if not d[name]:
                del d[name]
        if d["logprobs"] is None:
            del d["logprobs"]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        data = dict(data or {})
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidSampling(f"invalid sampling: unknown field(s) {sorted(unknown)}")
        return cls(**data)


DEFAULT_SAMPLING = SamplingParams()

"""HTTP request/response bodies (pydantic; used only at the HTTP boundary).

Manager API (``/v1``) is what clients and engines talk to; the engine API is
what the manager talks to on a separate engine process.  Field-level limits
here are coarse guards; semantic validation (templates, sampling, transforms,
context lengths) happens in the layers that own those concepts so that the
in-process path gets exactly the same checks.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Criteria = Literal["LATENCY", "THROUGHPUT"]
VarState = Literal["pending", "ready", "failed"]
CallState = Literal["waiting", "ready", "running", "done", "failed"]


class StrictBody(BaseModel):
    """A request body: unknown fields are rejected and values are not coerced (``"yes"``
    is not a boolean, ``"3"`` not a number).  Invalid Unicode (a lone surrogate) is
    refused when the body is parsed (:func:`parrot.protocol.asgi.parse_json_body`)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorInfo(BaseModel):
    code: str
    message: str
    detail: dict[str, Any] = Field(default_factory=dict)


# ----------------------------------------------------------------- sessions
class SessionCreated(BaseModel):
    session_id: str
    token: str = Field(description="Secret; present it as 'Authorization: Bearer <token>' on every request.")
    batch: BatchResult | None = Field(default=None, description="The result of the batch sent with it.")


# ---------------------------------------------------------------- variables
class CreateVariable(StrictBody):
    name: str | None = Field(default=None, max_length=200)
    value: str | None = None


class SetVariable(StrictBody):
    value: str


class VariableInfo(BaseModel):
    var_id: str
    name: str | None = None
    state: VarState
    value: str | None = None
    error: ErrorInfo | None = None
    producer: str | None = None
    consumers: list[str] = Field(default_factory=list)


# -------------------------------------------------------------------- calls
class PlaceholderBinding(StrictBody):
    """Binds one template placeholder.

    Inputs take exactly one of ``var_id`` (a variable of this session) or
    ``value`` (a constant).  Outputs may name an existing unproduced variable
    in ``var_id`` (otherwise one is created) and carry ``sampling``,
    ``transform`` and an optional performance ``criteria``.
    """

    name: str = Field(max_length=200)
    direction: Literal["input", "output"] | None = None
    var_id: str | None = None
    value: str | None = None
    sampling: dict[str, Any] | None = None
    transform: Any = None
    criteria: Criteria | None = None


class SubmitCall(StrictBody):
    template: str
    placeholders: list[PlaceholderBinding] = Field(default_factory=list, max_length=1024)
    name: str | None = Field(default=None, max_length=200, description="Function name, for introspection.")
    model: str | None = Field(default=None, description="Model to run on; any engine's model if omitted.")
    chat: bool = Field(default=False, description="Wrap the prompt in the model's chat format.")


class CallSubmitted(BaseModel):
    call_id: str
    outputs: dict[str, str] = Field(description="Output placeholder name -> variable id.")


class CallInfo(BaseModel):
    call_id: str
    name: str | None
    state: CallState
    inputs: dict[str, str]
    outputs: dict[str, str]
    engine_id: str | None = None
    objective: Literal["latency", "throughput"] | None = Field(
        default=None, description="Deduced from the DAG and the criteria of its outputs' consumers."
    )
    task_group: str | None = None
    placement: str | None = Field(default=None, description="Why the scheduler chose its engine.")
    error: ErrorInfo | None = None
    prompt_tokens: int | None = None
    generated_tokens: int | None = None
    prefix_reused_tokens: int | None = Field(
        default=None,
        description="Prompt tokens of its last run whose KV came from the engine's prefix cache "
        "(None before it runs, or when its engine does not say).",
    )
    filled_tokens: int | None = Field(
        default=None,
        description="Prompt tokens of its last run the engine computed (the rest of prompt_tokens).",
    )
    submitted_at: float
    dispatched_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = Field(
        default=None, description="When the engine sent the call's first generated token (its last run)."
    )
    finished_at: float | None = None


# -------------------------------------------------------------------- batch
MAX_BATCH_OPS = 512
ENGINE_PRIORITY_MAX = (1 << 63) - 1
"""The largest priority a fill or generate carries to an engine (a signed 64-bit integer,
as vLLM's request priority)."""
"""The most operations one ``BatchRequest`` may carry.  A batch is validated and staged
synchronously (all or none) on the manager's event loop: measured in-process here
(calls with 1,000-character templates), 256 ops took 0.04 s, 1,024 ops 0.29 s and
4,096 ops 0.53 s.  An application's whole DAG fits (the evaluation's largest is ~100
calls)."""

Ref = Annotated[str, Field(min_length=1, max_length=200)]
"""A client-chosen name for a variable, valid within one batch only."""


class BatchBinding(PlaceholderBinding):
    """A :class:`PlaceholderBinding` inside a batch: a variable may also be named
    by ``ref`` (defined by an earlier op of the batch, instead of ``var_id``), and
    an output may be given ``define_ref`` so later ops can use its variable."""

    ref: Ref | None = None
    define_ref: Ref | None = None


class CreateVariableOp(CreateVariable):
    op: Literal["create_variable"]
    ref: Ref | None = Field(default=None, description="Later ops of the batch may use the variable by this.")


class SubmitCallOp(SubmitCall):
    op: Literal["submit_call"]
    placeholders: list[BatchBinding] = Field(default_factory=list, max_length=1024)  # type: ignore[assignment]


class SetVariableOp(SetVariable):
    """Set a variable named by exactly one of ``var_id`` or ``ref``."""

    op: Literal["set_variable"]
    var_id: str | None = None
    ref: Ref | None = None


BatchOp = Annotated[CreateVariableOp | SubmitCallOp | SetVariableOp, Field(discriminator="op")]


class BatchRequest(StrictBody):
    """Operations applied in order, all or none.

    Every ref is defined once, by ``create_variable.ref`` or an output's
    ``define_ref``, before any op uses it (a binding's ``ref``,
    ``set_variable.ref``).
    """

    ops: list[BatchOp] = Field(max_length=MAX_BATCH_OPS)
    wait: BatchWait | None = Field(
        default=None,
        description="Outputs whose values the answer carries: it comes once they are in "
        "(or after wait_s), so an app's submission and its results take one round trip.",
    )


MAX_BATCH_WAIT_S = 60.0
"""The longest a batch's answer waits for its ``wait`` outputs: the long-poll bound of a
variable read (``GET .../variables/{vid}?wait=``)."""


class BatchWait(StrictBody):
    """Refs defined by the batch whose values its answer carries (in ``BatchResult.values``).

    Every ref must be able to get its value without another request: each input upstream
    of it has a value, is set by the batch, or is produced by a call whose inputs are so
    (else 400 ``wait_needs_input``: the request would wait for a value only a later
    request of the same client could give).  A ref still pending after ``wait_s`` seconds
    comes back pending; read it later with ``GET .../variables/{vid}?wait=``."""

    refs: list[str] = Field(min_length=1, max_length=MAX_BATCH_OPS)
    wait_s: float = Field(default=MAX_BATCH_WAIT_S, ge=0, le=MAX_BATCH_WAIT_S)


class BatchOpResult(BaseModel):
    op: Literal["create_variable", "submit_call", "set_variable"]
    var_id: str | None = Field(default=None, description="The variable created or set.")
    call_id: str | None = None
    outputs: dict[str, str] = Field(
        default_factory=dict, description="Output placeholder name -> variable id."
    )


class BatchResult(BaseModel):
    results: list[BatchOpResult] = Field(description="One per op, in order.")
    refs: dict[str, str] = Field(
        default_factory=dict, description="Every ref the batch defined -> variable id."
    )
    values: dict[str, VariableInfo] = Field(
        default_factory=dict, description="Each ref of the request's wait -> its variable after the wait."
    )


class CreateSession(StrictBody):
    """Optional body of ``POST /v1/sessions``: a first batch applied to the new session in
    the same request (one round trip for a whole app); if it is rejected, no session is made."""

    batch: BatchRequest | None = None


BatchRequest.model_rebuild()
SessionCreated.model_rebuild()


# ------------------------------------------------------------------ engines
class EngineStats(BaseModel):
    """A snapshot of an engine's load.  ``token_load`` counts KV tokens of
    running work; ``token_capacity`` is the engine's batching knob.
    ``kv_blocks_cached`` are blocks no context holds that the prefix cache keeps
    (reclaimable; not in ``kv_blocks_used``); ``cached_tokens`` counts prompt
    tokens whose KV came from the prefix cache instead of being computed.

    ``latency_cap_tokens`` is the token load up to which the engine keeps a
    decode step (each running request's time per output token) within
    ``decode_ms_target``, from its fit ``decode_ms_base + decode_ms_per_1k_tokens
    * load / 1000`` (see :mod:`parrot.engine.latency_probe`); 0 while unknown.
    ``prefill_tokens_per_decode_step`` sizes the manager's saturation batching
    (:mod:`parrot.manager.sched.saturation`).
    Invariant: ``latency_cap_tokens <= token_capacity``.
    """

    num_contexts: int = 0
    num_running: int = 0
    num_waiting: int = 0
    token_load: int = 0
    token_capacity: int = 0
    kv_tokens_used: int = 0
    kv_tokens_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_blocks_cached: int = 0
    kv_block_size: int = 0
    preemptions: int = 0
    fills: int = 0
    filled_tokens: int = 0
    generates: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    latency_cap_tokens: int = Field(
        default=0, ge=0, description="Token load under which latency-sensitive work may run here; 0: unknown."
    )
    latency_cap_source: Literal["none", "measured", "fixed", "priority"] = Field(
        default="none",
        description="measured: from the decode-step fit; fixed: set by the operator; priority: the "
        "engine orders requests by priority itself, so the cap is its whole capacity.",
    )
    decode_ms_base: float = Field(default=0.0, description="Fitted decode step time at no load (ms).")
    decode_ms_per_1k_tokens: float = Field(
        default=0.0, description="Fitted growth of the decode step time per 1,000 tokens of load (ms)."
    )
    decode_ms_target: float = Field(default=0.0, description="The step time the cap keeps to (ms).")
    decode_steps_fitted: int = Field(default=0, description="Decode steps behind the fit.")
    latency_refits_rejected: int = Field(
        default=0,
        description="Refits of the decode-step fit from real steps that could not fit (the previous fit "
        "was kept; the engine's log says why).",
    )
    prefill_tokens_per_decode_step: float = Field(
        default=0.0,
        description="How many prompt tokens cost one unloaded decode step, measured from steps "
        "computing prompts (two significant digits); 0: unknown.",
    )
    decode_path: str = Field(
        default="",
        max_length=64,
        description="How the engine computes its steps, chosen when it started (e.g. c-forward/amx-bf16).",
    )

    @model_validator(mode="after")
    def _non_negative(self) -> EngineStats:
        """Counts and times are never negative, times are finite: a heartbeat that says
        otherwise is refused (400) before the scheduler sees it."""
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if value < 0 or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        return self


DEFAULT_BACKEND_MAX_INFLIGHT = 64
"""Requests an external backend has in flight at once unless told otherwise (its
registration, ``--backend-max-inflight``)."""


class EngineDescription(StrictBody):
    """What an engine tells the manager about itself when it registers, or what an
    operator tells it of an external OpenAI-compatible backend to drive as an engine
    (``kind`` ``vllm``, ``sglang`` or ``openai``: see
    :mod:`parrot.manager.backends.openai_backend`; its context length defaults to what the
    backend reports)."""

    url: str = Field(max_length=2000)
    model: str = Field(max_length=500)
    max_seq_len: int | None = Field(default=None, gt=0)
    name: str | None = Field(default=None, max_length=200)
    kind: Literal["parrot", "vllm", "sglang", "openai"] = "parrot"
    max_inflight: int = Field(
        default=DEFAULT_BACKEND_MAX_INFLIGHT, ge=1, le=4096, description="a backend's requests in flight"
    )
    priority: bool = Field(default=False, description="vllm: send each call's app-FIFO place as priority")
    warm_prefix: bool = Field(default=False, description="a backend: warm its prefix cache before calls")

    @model_validator(mode="after")
    def _kind_fields(self) -> EngineDescription:
        if self.kind == "parrot" and self.max_seq_len is None:
            raise ValueError("a Parrot engine registers with its max_seq_len")
        if self.kind == "parrot" and (
            self.priority or self.warm_prefix or self.max_inflight != DEFAULT_BACKEND_MAX_INFLIGHT
        ):
            raise ValueError("max_inflight, priority and warm_prefix describe external backends only")
        return self


class EngineRegistered(BaseModel):
    engine_id: str
    heartbeat_interval_s: float


class Heartbeat(StrictBody):
    stats: EngineStats = Field(default_factory=EngineStats)


class EngineInfo(BaseModel):
    engine_id: str
    name: str | None
    model: str
    max_seq_len: int
    url: str | None
    alive: bool
    stats: EngineStats


# ----------------------------------------------------- engine process API
class FillRequest(StrictBody):
    tokens: list[int] = Field(max_length=1_000_000)
    context_id: int
    parent_context_id: int | None = None
    cache_salt: str = Field("", max_length=256)
    priority: int = Field(0, ge=0, le=ENGINE_PRIORITY_MAX)
    retain: bool = False


class GenerateRequest(StrictBody):
    sampling: dict[str, Any] = Field(default_factory=dict)
    context_id: int
    parent_context_id: int | None = None
    priority: int = Field(0, ge=0, le=ENGINE_PRIORITY_MAX)


class FreeContextRequest(StrictBody):
    context_id: int


class TokenCapacityRequest(StrictBody):
    """Set an engine's token capacity (the most KV tokens its running work may hold
    at once; small = low per-token latency, large = high throughput)."""

    token_capacity: int


class TokenLogprob(BaseModel):
    """A generated token's log-probability and the ``top`` most likely tokens at its
    step, as ``[token_id, logprob]`` pairs, most likely first (log-softmax of the
    model's logits, before temperature and the other filters)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)


class GenerateChunk(BaseModel):
    """One line of a generate stream.  The last line has ``done`` set.  ``logprobs``
    (only when the sampling asked for them) has one entry per id of ``token_ids``."""

    token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    done: bool = False
    finish_reason: Literal["stop", "length", "cancelled"] | None = None
    error: ErrorInfo | None = None
    logprobs: list[TokenLogprob] | None = None

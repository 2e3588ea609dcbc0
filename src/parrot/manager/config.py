"""The manager's settings (``parrot serve`` sets them from its options)."""

from __future__ import annotations

from dataclasses import dataclass, field

from parrot.manager.dag.tokens import INLINE_TOKENIZE_BYTES
from parrot.manager.tenants import Quotas

__all__ = ["ManagerConfig"]


@dataclass
class ManagerConfig:
    max_body_bytes: int = 8 * 1024 * 1024
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    # a template's leading constant text (a system prompt) of at least this many tokens
    # counts once in an engine's load however many calls there share it
    min_prefix_tokens: int = 32
    # prefix keys remembered per engine, to place calls where their prefix is cached
    affinity_keys_per_engine: int = 4096
    # a call whose engine is lost is re-run elsewhere (at most this many tries), waiting up to
    # engine_wait_s for another engine of its model
    max_attempts: int = 3
    engine_wait_s: float = 30.0
    # scheduling (the paper's Algorithm 1): policy, the token load under which every engine
    # keeps per-token latency low (None: each engine's own measured cap), an engine's
    # capacity when it does not report one, and how long a ready call may wait for an engine
    policy: str = "parrot"
    latency_cap_tokens: int | None = None
    # what the latency cap bounds ("all": every engine running latency work, the paper's rule;
    # "mixed": latency and throughput work meeting on an engine) and whether a task group or
    # the sharers of a prefix may spread to a less loaded engine (scheduler.SchedulerConfig)
    latency_cap_scope: str = "all"
    # the secret engines and operators present (parrot.protocol.cluster); None: no remote
    # engines can register, and GET /v1/engines shows everyone the public view only
    cluster_secret: str | None = None
    # a CA bundle that verifies https engines' certificates (None: the system's trust store)
    tls_ca_file: str | None = None
    affinity_spill: bool = False
    # a latency call goes to the most loaded engine running latency work that has room for it
    # under the latency cap, and takes an idle engine only when none has, keeping idle engines
    # for throughput work (scheduler.SchedulerConfig.pack_latency)
    pack_latency: bool = True
    # the tokenizer (a model folder, or "tiny") of external backends registered at run time
    # (POST /v1/engines with a kind) whose model no registered engine serves
    backend_tokenizer: str | None = None
    # while latency calls queue, batch them past the latency cap up to the size that finishes
    # them soonest on average (parrot.manager.sched.saturation), given how many prompt tokens cost
    # one unloaded decode step on the engines (None: what each engine measured, else 24);
    # False: the paper's rule (the cap binds always)
    saturation_batching: bool = True
    prefill_tokens_per_step: float | None = None
    engine_token_capacity: int = 32768
    queue_timeout_s: float | None = 600.0
    # a session nobody used for this long (seconds) with no call queued or running is
    # closed, its variables dropped and its engine contexts freed; None: never
    session_ttl_s: float | None = 3600.0
    # application-level FIFO: a queued call ranks by its session's first queued call (a
    # chain's next step keeps its application's place); False ranks each call by its own
    # arrival, as the request-level baseline policies always do
    app_fifo: bool = True
    # program-level scheduling (with app_fifo): a queued call ranks first by its application's
    # attained service, least first (parrot.manager.sched.queue_order), and its fills and
    # generations carry that order to the engines.  Off by default: it shortens short apps
    # behind long ones but lengthens the long ones more (docs/scheduling.md)
    program_scheduling: bool = False
    # a call submitted before its inputs exist has its template's constant start filled on
    # the engine likely to run it while it waits, in a context the engine retains until the
    # call has read it (parrot.manager.early_prefill)
    early_prefill: bool = True
    # tenants (parrot.manager.tenants): API key -> tenant name (None or empty: no keys, every
    # client is the anonymous tenant), what each tenant may hold at once, and who may share
    # cached prompt prefixes ("tenant": calls of one tenant; "global": everyone's)
    api_keys: dict[str, str] | None = None
    quotas: Quotas = field(default_factory=Quotas)
    prefix_sharing: str = "tenant"
    # text of at most this many UTF-8 bytes is tokenized on the event loop, longer text in a
    # worker thread (parrot.manager.dag.tokens); None: everything on the loop
    inline_tokenize_bytes: int | None = INLINE_TOKENIZE_BYTES

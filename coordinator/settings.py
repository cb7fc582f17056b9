"""Coordinator settings (env prefix SPECDEC_, or the matching --kebab-case flags)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from coordinator.adaptive import drafting_method
from specdec.serving.settings import ServiceSettings, StringList


class CoordinatorSettings(ServiceSettings):
    """Settings of `specdec serve coordinator`."""

    port: int = Field(50051, ge=0, le=65535, description="public gRPC port (0 = pick a free port)")
    max_message_bytes: int = Field(
        8 * 1024 * 1024, gt=0, description="largest request accepted (RESOURCE_EXHAUSTED above)"
    )
    max_connection_age_s: float = Field(
        300.0,
        ge=0,
        le=7 * 24 * 3600,  # grpc takes milliseconds as a 32-bit int
        description="end each client connection after about this long (HTTP/2 GOAWAY; its calls in flight go on), "
        "so clients reconnect through the Service and spread over the replicas there are then (the HPA's "
        "new ones too); 0 = never",
    )
    target_addresses: StringList = Field(min_length=1, description="target worker host:port list (comma separated)")
    draft_address: str | None = Field(
        None, description="the draft worker's host:port (one replica; --draft-addresses lists several)"
    )
    draft_addresses: StringList = Field(
        default_factory=list,
        description="draft worker host:port list, one entry per replica: each session drafts on one of them "
        "(comma separated; unset with --draft-address unset = no draft model)",
    )
    tokenizer: str | None = Field(None, description="tokenizer path or hub id (default: the target's model id)")
    served_model_name: str | None = Field(
        None, description="model name the engine API (vllm.grpc.engine) reports to gateways (default: the target's id)"
    )
    state_url: str = Field("memory://", description="memory:// (single coordinator), redis://, rediss://")
    state_memory_max_tokens: int = Field(
        4_000_000,
        ge=0,
        description="memory:// only: the token ids its sessions may hold in all (each session counts 64 more); a "
        "request that would add more is refused RESOURCE_EXHAUSTED (the state store is full); 0 = no limit",
    )
    state_password: SecretStr | None = Field(
        None, description="Redis AUTH password (better than one in state_url; never logged)"
    )
    state_password_file: str | None = Field(None, description="file holding the Redis AUTH password")
    state_username: str | None = Field(None, description="Redis ACL user (with state_password)")
    state_tls_ca_file: str | None = Field(
        None, description="PEM CA that signed the Redis server certificate (rediss://)"
    )
    worker_tls_ca_file: str | None = Field(
        None, description="PEM CA of the workers' certificates: call workers over TLS"
    )
    worker_tls_cert_file: str | None = Field(None, description="client certificate presented to workers (mTLS)")
    worker_tls_key_file: str | None = Field(None, description="private key of --worker-tls-cert-file")
    worker_tls_server_name: str | None = Field(
        None, description="name expected in the workers' certificates (default: the host in each address)"
    )
    worker_token_file: str | None = Field(None, description="file holding the bearer token sent to the workers")
    session_ttl_s: float = Field(3600.0, gt=0, description="an idle session's state expires after this")
    session_lease_s: float = Field(
        90.0,
        gt=0,
        description="a request's hold on its session, renewed in the background while it runs; must exceed "
        "worker_timeout_s + state_retry_s",
    )
    state_timeout_s: float = Field(2.0, gt=0, description="socket timeout of state store calls")
    state_replica_acks: int = Field(
        0,
        ge=0,
        le=16,
        description="redis:// only: a round's tokens are sent once this many of Redis's replicas have its commit "
        "(WAIT), so a failover to one of them loses none of them; a commit not on them within state_replica_wait_s "
        "is retried as an unreachable store for state_retry_s, then the turn fails UNAVAILABLE, rolled back; 0 = "
        "no wait (replication is asynchronous)",
    )
    state_replica_wait_s: float = Field(
        1.0, gt=0, description="how long one commit waits for state_replica_acks replicas (below state_timeout_s)"
    )
    num_speculative_tokens: int = Field(
        4,
        ge=0,
        description="default K (the draft tokens per round; adaptive K may use fewer) of requests that draft without "
        "the confidence stop or with fixed K; with the stop, blocks run up to max_speculative_tokens; 0 = none",
    )
    speculation_mode: Literal["auto", "sequential", "pipelined"] = Field(
        "auto",
        description="pipelined drafts the next block while the target verifies (and adaptive turns do not wait for "
        "the draft's long prefills); auto = pipelined unless draft and target share one CPU host",
    )
    draft_method: Literal["auto", "model", "ngram", "hybrid"] = Field(
        "auto",
        description="who drafts when a request does not say: model = the draft worker; ngram = lookup in the "
        "session's own tokens (no draft model needed); hybrid = lookup where it matches, the model elsewhere, "
        "chosen per round; auto = hybrid with a draft worker, ngram without",
    )
    ngram_min: int = Field(2, ge=1, description="shortest suffix (tokens) a lookup draft matches")
    ngram_max: int = Field(5, ge=1, description="longest suffix (tokens) a lookup draft matches (longest wins)")
    lookup_max_tokens: int = Field(
        8,
        ge=1,
        description="the most tokens one lookup draft proposes (the model's blocks use K); capped by "
        "max_speculative_tokens",
    )
    reply_index_tokens: int = Field(
        0,
        ge=0,
        description="lookup drafts also match recent replies of other requests of the same caller: the index "
        "keeps the latest replies up to this many tokens in all (about 0.7 KB of coordinator memory per token); "
        "0 = off (callers that share an identity could tell from timing what others were answered)",
    )
    draft_confidence: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="the draft model ends a block after a token it proposed with a lower probability (HF's "
        "assistant confidence threshold; a request may set its own; fixed-K requests default to 0); 0 = off",
    )
    draft_block_confidence: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="the draft model ends a block once the product of the probabilities of the tokens it proposed "
        "in it (its estimate that the target keeps them all) is lower (a request may set its own; fixed-K requests "
        "default to 0). With either stop an adaptive request that sets no K drafts up to max_speculative_tokens; "
        "with neither, blocks of K (num_speculative_tokens); 0 = off",
    )
    draft_block_confidence_from_costs: bool = Field(
        True,
        description="for adaptive requests that leave draft_block_confidence unset, with adaptive_k: the block "
        "stop is twice a drafted token's measured cost (a draft step and a verify row) over a round's fixed cost "
        "(the one-token verify and the overhead), three times on a pipelined coordinator, in [0.05, 0.9]; "
        "draft_block_confidence until those costs are measured, and 0 there still turns the stop off",
    )
    adaptive_k: bool = Field(True, description="pick K per round from measured acceptance and step times")
    probe_every: int = Field(
        32,
        gt=0,
        description="with speculation off for a session, probe it every N rounds (with K below the longest block "
        "allowed, draft that block every N rounds to measure it again; with a plan expecting under 1.5 tokens a "
        "round, decode a round target-only every N rounds to time that again)",
    )
    speculation_max_requests: int = Field(
        0,
        ge=0,
        description="rounds decode target-only while more requests than this are generating on the session's target "
        "replica: this coordinator's there, or all the coordinators' as the replica reports them (requests with fixed "
        "K excepted: their seeds replay); batched target-only passes can serve many requests faster than speculation "
        "(0 = no limit)",
    )
    prefix_block_tokens: int = Field(
        16,
        ge=0,
        description="prefix reuse: a new session or one-shot request starts from a cached prefix of its prompt, "
        "matched in blocks of this many tokens (0 = off: one-shot caches are freed at once)",
    )
    max_speculative_tokens: int = Field(16, ge=1, description="largest K a request may ask for")
    default_max_new_tokens: int = Field(
        256, gt=0, description="max_new_tokens when a request leaves it unset (cut to the room the context has left)"
    )
    max_concurrent_requests: int = Field(
        64, gt=0, description="requests generating at once; more get RESOURCE_EXHAUSTED"
    )
    max_requests_per_caller: int = Field(
        0,
        ge=0,
        description="requests one authenticated caller (an identity of --auth-tokens-file or a client certificate) "
        "may have generating at once on this coordinator; more get RESOURCE_EXHAUSTED, so one caller cannot take "
        "every --max-concurrent-requests slot; callers without an identity are not counted; 0 = no limit",
    )
    max_sessions_per_caller: int = Field(
        0,
        ge=0,
        le=100_000,
        description="named sessions one caller (one identity of --auth-tokens-file or client certificate; all "
        "callers are one without authentication) may hold until closed or expired; a request that would make one "
        "more gets RESOURCE_EXHAUSTED; 0 = no limit",
    )
    max_session_tokens_per_caller: int = Field(
        0,
        ge=0,
        description="token ids one caller's named sessions may hold (committed prompts and replies, counted as "
        "--max-sessions-per-caller counts sessions, which it needs); while they hold this many or more, its "
        "requests that would continue or make a session get RESOURCE_EXHAUSTED until sessions are closed or "
        "expire; a turn begun under it may still add up to the context length; 0 = no limit",
    )
    worker_timeout_s: float = Field(60.0, gt=0, description="upper bound of one worker call (client deadlines cap it)")
    worker_startup_timeout_s: float = Field(600.0, gt=0, description="how long to wait at start for workers to serve")
    draft_startup_wait_s: float = Field(
        10.0,
        ge=0,
        description="how long start-up waits for a draft replica to serve; then the coordinator serves without one "
        "(lookup drafts) and takes each on when it serves",
    )
    draft_timeout_s: float = Field(
        2.0,
        gt=0,
        description="a proposal slower than this (or 3x its recent latency under load) is abandoned and the round "
        "decoded target-only",
    )
    draft_retry_s: float = Field(5.0, gt=0, description="after a draft failure, decode target-only this long")
    target_retry_s: float = Field(2.0, gt=0, description="after a target replica fails, prefer the others this long")
    target_info_refresh_s: float = Field(
        30.0,
        gt=0,
        description="read each target replica's Info again this often: a replica restarted with structured output "
        "turned on or off (or of a version with or without it) is routed to accordingly from then on",
    )
    state_retry_s: float = Field(
        5.0, ge=0, description="keep retrying an unreachable state store this long (within the client deadline)"
    )

    @field_validator("target_addresses", "draft_addresses")
    @classmethod
    def _one_entry_per_replica(cls, addresses: list[str]) -> list[str]:
        stripped = [address.strip() for address in addresses]
        if "" in stripped:
            raise ValueError(f"{','.join(addresses)!r} has an empty entry (a trailing or doubled comma?)")
        repeated = sorted({address for address in stripped if stripped.count(address) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} listed twice: list each replica once")
        return stripped

    @field_validator("draft_address")
    @classmethod
    def _blank_is_none(cls, address: str | None) -> str | None:
        return (address or "").strip() or None

    @model_validator(mode="after")
    def _drafts_in_one_place(self) -> CoordinatorSettings:
        if self.draft_address and self.draft_addresses:
            raise ValueError(
                "both draft_address and draft_addresses are set: give the draft replicas in one of them "
                "(draft_addresses for several)"
            )
        return self

    @property
    def drafts(self) -> list[str]:
        """The draft replicas' addresses (none: no draft model)."""
        return self.draft_addresses or ([self.draft_address] if self.draft_address else [])

    @model_validator(mode="after")
    def _worker_tls_complete(self) -> CoordinatorSettings:
        if (self.worker_tls_cert_file is None) != (self.worker_tls_key_file is None):
            raise ValueError("worker_tls_cert_file and worker_tls_key_file must be given together")
        if self.worker_tls_cert_file and not self.worker_tls_ca_file:
            raise ValueError("a worker client certificate (mTLS) needs worker_tls_ca_file")
        return self

    @model_validator(mode="after")
    def _lease_outlasts_a_stall(self) -> CoordinatorSettings:
        """A turn stalled in one worker call and then in state retries must still hold its lease
        (it is renewed every lease/3, but a renewal can be stuck behind the same stalled store)."""
        if self.session_lease_s <= self.worker_timeout_s + self.state_retry_s:
            raise ValueError(
                f"session_lease_s ({self.session_lease_s:g}) must exceed worker_timeout_s + state_retry_s "
                f"({self.worker_timeout_s:g} + {self.state_retry_s:g}); raise the lease or lower the timeouts"
            )
        return self

    @model_validator(mode="after")
    def _token_budget_over_counted_sessions(self) -> CoordinatorSettings:
        """Each turn of a caller sums the tokens of its counted sessions: the limit of sessions
        bounds that work (and with it how long one such sum holds a Redis)."""
        if self.max_session_tokens_per_caller and not self.max_sessions_per_caller:
            raise ValueError(
                "max_session_tokens_per_caller needs max_sessions_per_caller: each of a caller's turns sums "
                "the tokens of its sessions, which that limit bounds (k8s/ sets 1000)"
            )
        return self

    @model_validator(mode="after")
    def _replica_wait_within_one_call(self) -> CoordinatorSettings:
        if self.state_replica_acks and self.state_replica_wait_s >= self.state_timeout_s:
            raise ValueError(
                f"state_replica_wait_s ({self.state_replica_wait_s:g}) must be below state_timeout_s "
                f"({self.state_timeout_s:g}): the wait runs within one state store call"
            )
        return self

    @model_validator(mode="after")
    def _ngram_range(self) -> CoordinatorSettings:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        return self

    def default_method(self, has_draft: bool) -> str:
        """The draft method of requests that do not choose one (``has_draft``: a draft model serves)."""
        wanted = "hybrid" if self.draft_method == "auto" else self.draft_method
        return drafting_method(wanted, has_draft)

    @model_validator(mode="after")
    def _k_within_max(self) -> CoordinatorSettings:
        if self.num_speculative_tokens > self.max_speculative_tokens:
            raise ValueError("num_speculative_tokens must not exceed max_speculative_tokens")
        return self

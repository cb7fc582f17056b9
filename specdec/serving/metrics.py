"""Prometheus metrics: one registry per service process, served over HTTP on --metrics-port."""

from __future__ import annotations

import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from specdec.serving.errors import PortUnavailable
from specdec.serving.settings import ServiceSettings

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# a whole generation can take minutes
_RPC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def start_metrics(settings: ServiceSettings, registry: CollectorRegistry) -> dict[str, int]:
    """Serves /metrics when a port is set; returns {"metrics_port": bound port} (or {})."""
    if settings.metrics_port is None:
        return {}
    try:
        server, _thread = start_http_server(settings.metrics_port, addr=settings.host, registry=registry)
    except OSError as exc:
        where = f"{settings.host}:{settings.metrics_port}"
        raise PortUnavailable(f"could not bind {where} for /metrics ({exc.strerror}); is the port in use?") from exc
    return {"metrics_port": int(server.server_port)}


class RpcMetrics:
    """Every service's RPCs (health checks aside): counted by method and status code, and timed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter(
            "specdec_rpcs", "RPCs served, by method (service/method) and status code", ["method", "code"],
            registry=registry,
        )  # fmt: skip
        self.seconds = Histogram(
            "specdec_rpc_seconds", "RPC duration, by method", ["method"], buckets=_RPC_BUCKETS, registry=registry
        )
        self.first_message_seconds = Histogram(
            "specdec_rpc_first_message_seconds",
            "Streaming RPCs: time until the first message is handed to grpc to send (GenerateStream: the first tokens)",
            ["method"], buckets=_RPC_BUCKETS, registry=registry,
        )  # fmt: skip

    def first_message(self, method: str, began: float) -> None:
        self.first_message_seconds.labels(method).observe(time.monotonic() - began)

    def ended(self, method: str, code: grpc.StatusCode, began: float) -> None:
        self.calls.labels(method, code.name).inc()
        self.seconds.labels(method).observe(time.monotonic() - began)


class WorkerMetrics:
    """What a draft or target worker reports."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.cached_sessions = Gauge("specdec_worker_cached_sessions", "Sessions with a KV cache", registry=registry)
        self.cached_tokens = Gauge(
            "specdec_worker_cached_tokens",
            "Tokens held by all KV caches (past a windowed layer's window and margin, a token counts for the whole "
            "layers' share of its memory)",
            registry=registry,
        )
        self.cache_budget_tokens = Gauge(
            "specdec_worker_cache_budget_tokens", "Tokens the KV caches may hold in all (--max-cache-tokens)",
            registry=registry,
        )  # fmt: skip
        self.computed_tokens = Counter(
            "specdec_worker_computed_tokens", "Tokens run through the model", registry=registry
        )
        self.resyncs = Counter(
            "specdec_worker_cache_resyncs", "Requests refused because the cache lacked the prefix", registry=registry
        )
        self.compute_seconds = Histogram(
            "specdec_worker_compute_seconds", "Model time per request", buckets=_LATENCY_BUCKETS, registry=registry
        )
        self.model_errors = Counter(
            "specdec_worker_model_errors", "Forward-pass exceptions (the worker exits)", registry=registry
        )
        self.request_errors = Counter(
            "specdec_worker_request_errors", "Requests failed by their own input or numbers (the worker goes on)",
            registry=registry,
        )  # fmt: skip
        self.guessed_tokens = Counter(
            "specdec_draft_guessed_tokens", "Draft worker: guessed tokens run beside drafted ones (--guess-tokens)",
            registry=registry,
        )  # fmt: skip
        self.guesses_taken = Counter(
            "specdec_draft_guesses_taken", "Draft worker: draft tokens whose step a right guess saved",
            registry=registry,
        )  # fmt: skip


class CoordinatorMetrics:
    """What the coordinator reports."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.active_requests = Gauge("specdec_active_requests", "Requests generating now", registry=registry)
        self.rejected_requests = Counter(
            "specdec_rejected_requests", "Requests refused at admission", registry=registry
        )
        self.generated_tokens = Counter("specdec_generated_tokens", "Tokens committed to sessions", registry=registry)
        self.generated_total = 0  # the same count, read back for load reports
        self.rounds = Counter("specdec_rounds", "Draft-verify rounds", ["mode"], registry=registry)
        self.draft_tokens_proposed = Counter(
            "specdec_draft_tokens_proposed", "Draft tokens proposed, by position in the block", ["position"],
            registry=registry,
        )  # fmt: skip
        self.draft_tokens_accepted = Counter(
            "specdec_draft_tokens_accepted", "Draft tokens accepted, by position in the block", ["position"],
            registry=registry,
        )  # fmt: skip
        self.proposer_rounds = Counter(
            "specdec_proposer_rounds", "Rounds by who drafted: model, ngram (lookup) or none (target-only)",
            ["proposer"], registry=registry,
        )  # fmt: skip
        self.load_target_only_rounds = Counter(
            "specdec_load_target_only_rounds",
            "Rounds decoded target-only because more requests were generating than --speculation-max-requests",
            registry=registry,
        )
        self.draft_prefixes_finishing = Gauge(
            "specdec_draft_prefixes_finishing",
            "Prefixes that finished turns left the draft computing for their sessions' next turns, "
            "read in the background (at most --max-concurrent-requests per draft replica)",
            registry=registry,
        )
        self.draft_catch_up_rounds = Counter(
            "specdec_draft_catch_up_rounds",
            "Rounds decoded without the draft model while it computed a long prefix sent without waiting "
            "(pipelined: the draft on other hardware)",
            registry=registry,
        )
        self.proposer_tokens_proposed = Counter(
            "specdec_proposer_tokens_proposed", "Draft tokens proposed, by proposer", ["proposer"], registry=registry
        )
        self.proposer_tokens_accepted = Counter(
            "specdec_proposer_tokens_accepted", "Draft tokens accepted, by proposer", ["proposer"], registry=registry
        )
        self.committed_per_round = Histogram(
            "specdec_committed_tokens_per_round", "Accepted drafts + the target's token, per round",
            buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16), registry=registry,
        )  # fmt: skip
        self.round_seconds = Histogram(
            "specdec_round_seconds", "Round latency split into draft wait, verify model time and the rest",
            ["part"], buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.reply_lookup_rounds = Counter(
            "specdec_reply_lookup_rounds", "Lookup rounds drafted from earlier requests' replies (the reply index)",
            registry=registry,
        )  # fmt: skip
        self.reply_lookup_tokens_accepted = Counter(
            "specdec_reply_lookup_tokens_accepted", "Tokens of reply-index drafts the target accepted",
            registry=registry,
        )  # fmt: skip
        self.reply_index_tokens = Gauge(
            "specdec_reply_index_tokens", "Reply tokens the reply index holds", registry=registry
        )
        self.draft_failures = Counter(
            "specdec_draft_failures",
            "A draft replica unreachable or hung: skipped a while (its sessions draft on another, or target-only)",
            registry=registry,
        )  # fmt: skip
        self.draft_request_errors = Counter(
            "specdec_draft_request_errors", "Draft requests failed by their own input (that turn goes target-only)",
            registry=registry,
        )  # fmt: skip
        self.target_failovers = Counter(
            "specdec_target_failovers", "Verify calls moved to another target replica", registry=registry
        )
        self.cache_resyncs = Counter("specdec_cache_resyncs", "Worker caches re-prefilled", ["role"], registry=registry)
        self.replica_turns = Gauge(
            "specdec_replica_turns", "Turns on each worker replica now (where new sessions are placed by)",
            ["role", "address"], registry=registry,
        )  # fmt: skip
        self.finished_requests = Counter(
            "specdec_finished_requests", "Replies that ended, by reason: eos, stop_token, stop_string, length",
            ["reason"], registry=registry,
        )  # fmt: skip

    def record_round(
        self,
        k: int,
        accepted: int,
        draft_ms: float,
        verify_ms: float,
        overhead_ms: float,
        committed: int,
        proposer: str = "model",
    ) -> None:
        """One round: its mode and proposer, tokens, per-position acceptance and latency split."""
        self.rounds.labels("speculative" if k else "target_only").inc()
        self.proposer_rounds.labels(proposer if k else "none").inc()
        if k:
            self.proposer_tokens_proposed.labels(proposer).inc(k)
            self.proposer_tokens_accepted.labels(proposer).inc(accepted)
        self.generated_tokens.inc(committed)
        self.generated_total += committed
        self.committed_per_round.observe(committed)
        for position in range(1, k + 1):
            self.draft_tokens_proposed.labels(str(position)).inc()
            if position <= accepted:
                self.draft_tokens_accepted.labels(str(position)).inc()
        for part, ms in (("draft", draft_ms), ("verify", verify_ms), ("overhead", overhead_ms)):
            self.round_seconds.labels(part).observe(max(ms, 0.0) / 1000)

"""The coordinator's domain side: worker connections, admission, turns, sessions."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import importlib.metadata
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import structlog
from transformers import PreTrainedTokenizerBase

from coordinator.adaptive import LoadLimit, StepCosts
from coordinator.settings import CoordinatorSettings
from coordinator.turn import CLEANUP_TIMEOUT_S, Turn, TurnDeps
from coordinator.validation import FEATURES, Limits, TurnRequest
from coordinator.workers import DraftClient, DraftPool, StartupWait, TargetPool, translates, warn_if_unlike
from specdec.runtime.logprobs import MAX_TOP_LOGPROBS
from specdec.runtime.lookup import ReplyIndex
from specdec.runtime.sampling import GREEDY_TEMPERATURE
from specdec.runtime.tokenizer import load_tokenizer, tokenizer_fingerprint
from specdec.serving.errors import NotServing, Overloaded, StartupError, StateUnavailable, StateUnreachable
from specdec.serving.metrics import CoordinatorMetrics
from specdec.serving.security import caller_identity
from specdec.state import StateStore, open_store, store_location
from specdec.v1 import common_pb2, coordinator_pb2

log = structlog.get_logger(__name__)

MAX_PROMPT_CHARS = 1_000_000
DRAFT_PEERS_WAIT_S = 1.0  # once a draft replica serves, start-up waits this long for the others
# What draft replicas should share (the first to join sets the limits GetInfo reports).
_ALIKE_DRAFT_FIELDS = ("model_id", "max_context_len", "max_draft_tokens", "vocab_translation")


def prefix_ttl_s(session_ttl_s: float, target: common_pb2.WorkerInfo) -> float:
    """How long a record of where a prefix is cached is kept: as long as the target keeps a cache
    nobody uses (a record of a freed cache only costs a resync), at most the session TTL."""
    return min(session_ttl_s, target.cache_idle_s or session_ttl_s)


def check_compatible(target: common_pb2.WorkerInfo, draft: common_pb2.WorkerInfo) -> None:
    """Raises when the draft cannot propose tokens for the target: it must speak the target's ids,
    either sharing its tokenizer or translating to it (a draft started with --target-tokenizer).
    The output layers may be padded to different sizes (Qwen2.5-0.5B has 151,936 rows, the 7B and
    larger 152,064): the draft is told the target's size and proposes no id beyond it."""
    if target.tokenizer_hash == draft.tokenizer_hash:
        return
    if translates(draft):
        raise StartupError(
            f"draft model {draft.model_id!r} translates to tokenizer {draft.tokenizer_hash}, but target model "
            f"{target.model_id!r} has tokenizer {target.tokenizer_hash}; start the draft with --target-tokenizer "
            "set to the target's model"
        )
    raise StartupError(
        f"draft model {draft.model_id!r} (tokenizer {draft.tokenizer_hash}) does not share the tokenizer of "
        f"target model {target.model_id!r} (tokenizer {target.tokenizer_hash}); start the draft worker with "
        "--target-tokenizer set to the target's model (and --vocab-method tli or slem) to translate its proposals"
    )


def largest_block(
    max_speculative_tokens: int, target_max: int, draft: common_pb2.WorkerInfo | None, warn: bool = True
) -> int:
    """The largest K requests may use: --max-speculative-tokens, at most what the workers accept
    (their --max-draft-tokens; ``target_max``: the largest a target replica takes, 0 = unknown).
    A target replica that takes fewer verifies a block cut to its first tokens (exact, shorter)."""
    limits = [n for n in (target_max, draft.max_draft_tokens if draft is not None else 0) if n]
    largest = min([max_speculative_tokens, *limits])
    if largest < max_speculative_tokens and warn:
        log.warning(
            "max_speculative_tokens_capped",
            max_speculative_tokens=max_speculative_tokens,
            workers_max_draft_tokens=min(limits),
            effect=f"requests draft at most {largest} tokens a round; raise the workers' --max-draft-tokens",
        )
    return largest


def vocab_method(draft: common_pb2.WorkerInfo | None) -> str:
    """How the draft's proposals reach the target's vocabulary (GetInfo's draft_vocab_method)."""
    if draft is None:
        return ""
    return {common_pb2.VOCAB_TRANSLATION_TLI: "tli", common_pb2.VOCAB_TRANSLATION_SLEM: "slem"}.get(
        draft.vocab_translation, "shared"
    )


def choose_pipelined(mode: str, target: common_pb2.WorkerInfo, draft: common_pb2.WorkerInfo | None) -> bool:
    """Pipelining overlaps drafting with verification; that pays when the two run on different
    hardware. On one CPU host they compete for the same cores and memory bandwidth (measured on the
    benchmark machine: a 5-token verify went from 0.73 s to 1.3-2.1 s with a draft running beside it),
    so ``auto`` pipelines unless both workers are CPU processes on the same host."""
    if draft is None or mode == "sequential":
        return False
    if mode == "pipelined":
        return True
    shared_cpu = (
        target.host == draft.host and not target.device.startswith("cuda") and not draft.device.startswith("cuda")
    )
    return not shared_cpu


def package_version() -> str:
    """specdec's installed version; "unknown" where it runs from a source tree on PYTHONPATH that
    was never installed (no package metadata), rather than failing the coordinator's start-up."""
    try:
        return importlib.metadata.version("specdec")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def server_info(
    settings: CoordinatorSettings,
    limits: Limits,
    target: common_pb2.WorkerInfo,
    draft: common_pb2.WorkerInfo | None,
    pipelined: bool,
    chat_template: bool,
) -> coordinator_pb2.GetInfoResponse:
    """What GetInfo answers (made at start-up, and again if a draft that was down then joins)."""
    return coordinator_pb2.GetInfoResponse(
        server_version=package_version(),
        target_model_id=target.model_id,
        draft_model_id=draft.model_id if draft else "",
        draft_methods=["model", "ngram", "hybrid"] if draft else ["ngram"],
        default_draft_method=limits.default_method,
        lookup_max_tokens=limits.lookup_max_tokens,
        max_context_len=limits.max_context_len,
        draft_max_context_len=limits.draft_context_len,
        vocab_size=limits.vocab_size,
        eos_token_ids=sorted(limits.eos_token_ids),
        max_speculative_tokens=limits.max_k,
        default_speculative_tokens=limits.default_k,
        max_new_tokens=limits.max_context_len - 1,
        default_max_new_tokens=limits.default_max_new_tokens,
        max_message_bytes=settings.max_message_bytes,
        max_concurrent_requests=settings.max_concurrent_requests,
        max_requests_per_caller=settings.max_requests_per_caller,
        max_sessions_per_caller=settings.max_sessions_per_caller,
        max_session_tokens_per_caller=settings.max_session_tokens_per_caller,
        speculation_max_requests=settings.speculation_max_requests,
        max_prompt_chars=limits.max_prompt_chars,
        speculation_mode="pipelined" if pipelined else "sequential",
        adaptive_k=settings.adaptive_k,
        features=features(limits.structured_output),
        greedy_temperature=GREEDY_TEMPERATURE,
        chat_template=chat_template,
        max_top_logprobs=MAX_TOP_LOGPROBS,
        draft_vocab_method=vocab_method(draft),
        draft_confidence=limits.draft_confidence,
        draft_block_confidence=limits.draft_block_confidence,
        draft_block_confidence_from_costs=limits.draft_block_confidence_from_costs,
        reply_index_tokens=settings.reply_index_tokens,
    )


def k_limits(settings: CoordinatorSettings, max_k: int) -> dict[str, int]:
    """The Limits fields that follow the largest K: it, the default K and the longest lookup draft."""
    return {
        "max_k": max_k,
        "default_k": min(settings.num_speculative_tokens, max_k),
        "lookup_max_tokens": min(settings.lookup_max_tokens, max_k),
    }


def features(structured_output: bool) -> list[str]:
    """The request fields GetInfo lists: all, structured output only where a target replica
    applies grammars."""
    return [f for f in FEATURES if structured_output or f != "sampling.structured_output"]


class Engine:
    """Owns connections and limits; creates one Turn per request."""

    def __init__(self, settings: CoordinatorSettings, metrics: CoordinatorMetrics) -> None:
        s = settings
        self.settings = s
        self.metrics = metrics
        self.targets = TargetPool(s.target_addresses, s, s.target_retry_s, joined=self._refit_targets)
        self.drafts = DraftPool(s.drafts, s, s.draft_retry_s, s.draft_timeout_s) if s.drafts else None
        self.store: StateStore = open_store(
            s.state_url,
            s.session_ttl_s,
            s.session_lease_s,
            s.state_timeout_s,
            username=s.state_username,
            password=s.state_password.get_secret_value() if s.state_password else None,
            password_file=s.state_password_file,
            tls_ca_file=s.state_tls_ca_file,
            memory_max_tokens=s.state_memory_max_tokens,
            max_sessions_per_caller=s.max_sessions_per_caller,
            max_session_tokens_per_caller=s.max_session_tokens_per_caller,
            replica_acks=s.state_replica_acks,
            replica_wait_s=s.state_replica_wait_s,
        )
        self._deps: TurnDeps | None = None
        self._info: coordinator_pb2.GetInfoResponse | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._draft_joins: set[asyncio.Task[None]] = set()
        self._draft_info: common_pb2.WorkerInfo | None = None  # the first draft replica that joined
        self._started = asyncio.Event()
        self._replies = ReplyIndex(s.ngram_min, s.ngram_max, s.reply_index_tokens) if s.reply_index_tokens else None
        self._active = 0
        self._by_caller: collections.Counter[str] = collections.Counter()  # requests admitted, by caller
        self._watch: asyncio.Task[None] | None = None
        self._info_from: tuple[common_pb2.WorkerInfo, common_pb2.WorkerInfo | None, bool, bool] | None = None

    async def start(self) -> None:
        """Waits for a target replica and (up to --draft-startup-wait-s, or 1 s more once one of
        them serves) the draft replicas, checks that they fit together, loads the tokenizer. A draft
        replica that does not serve by then, or whose Info call fails, joins when it serves; until
        one has, the coordinator serves as one without a draft."""
        timeout = self.settings.worker_startup_timeout_s
        target_info = await self.targets.connect(timeout)
        if self.drafts is not None:
            connecting = {r: asyncio.create_task(r.connect(timeout)) for r in self.drafts.replicas}
            await _first_serving(list(connecting.values()), min(self.settings.draft_startup_wait_s, timeout))
            for replica, task in connecting.items():
                if task.done() and task.exception() is None:
                    self._fit_draft(replica, target_info, task.result())
                else:  # not serving yet, or its Info failed: it is retried, as a late draft
                    join = asyncio.create_task(self._join_draft(replica, task, target_info, timeout))
                    self._draft_joins.add(join)
        await self._start_store(timeout)
        tokenizer = await asyncio.to_thread(load_tokenizer, self.settings.tokenizer or target_info.model_id)
        if tokenizer_fingerprint(tokenizer) != target_info.tokenizer_hash:
            raise StartupError("the coordinator's tokenizer differs from the target model's; fix --tokenizer")
        self._tokenizer = tokenizer
        self._configure(target_info, self._draft_info, "coordinator_ready")
        self._started.set()
        self._watch = asyncio.create_task(self._watch_targets())

    async def _watch_targets(self) -> None:
        """Reads the target replicas' Info again every --target-info-refresh-s and offers
        structured output while some replica applies grammars (replicas restarted with another
        version or setting, late replicas, one found refusing grammars)."""
        s = self.settings
        while True:
            await asyncio.sleep(s.target_info_refresh_s)
            await self.targets.refresh_info(min(s.target_info_refresh_s, 10.0))
            self._refit_targets()

    def _refit_targets(self) -> None:
        """Limits and GetInfo for the target replicas as they are now (a late replica joined, or
        one restarted with other settings): structured output while some replica applies grammars,
        blocks up to the largest a replica takes."""
        if self._deps is None or self._info_from is None:  # start-up configures them
            return
        s, deps, limits = self.settings, self._deps, self._deps.limits
        able = self.targets.grammars
        max_k = largest_block(s.max_speculative_tokens, self.targets.max_draft_tokens, self._draft_info, warn=False)
        if (able, max_k) == (limits.structured_output, limits.max_k):
            return
        deps.limits = dataclasses.replace(limits, structured_output=able, **k_limits(s, max_k))
        self._info = server_info(s, deps.limits, *self._info_from)
        log.info("target_limits_changed", structured_output=able, max_speculative_tokens=max_k)

    async def _start_store(self, timeout_s: float) -> None:
        """Connects to the state store, waiting for it (as for a worker) while it cannot be reached;
        a store that refuses the coordinator (a wrong password) ends start-up at once."""
        where = store_location(self.settings.state_url)
        wait = StartupWait("waiting_for_state_store", timeout_s, store=where)
        while True:
            try:
                await self.store.start()
                return
            except StateUnreachable as exc:
                cause = str(exc.__cause__ or exc)
                if wait.over:
                    raise StartupError(
                        f"the state store at {where} could not be reached in "
                        f"{timeout_s:g} s ({cause}); check --state-url and that the store is up, or give it longer "
                        "(--worker-startup-timeout-s)"
                    ) from None
                wait.tick(error=str(exc), cause=cause)
                await asyncio.sleep(0.5)
            except StateUnavailable as exc:  # it answered, and refused: a configuration error
                cause = exc.__cause__ or exc
                raise StartupError(
                    f"the state store at {where} refused the coordinator "
                    f"({type(cause).__name__}: {cause}); check --state-username and --state-password-file "
                    "(or --state-password, or the password in --state-url) and the user's ACL"
                ) from None

    def _fit_draft(
        self, replica: DraftClient, target_info: common_pb2.WorkerInfo, draft_info: common_pb2.WorkerInfo
    ) -> None:
        """Takes a draft replica into use; raises when it cannot draft for the target. Warns when it
        serves another model than the first replica."""
        assert self.drafts is not None
        check_compatible(target_info, draft_info)
        if self._draft_info is None:
            self._draft_info = draft_info
        else:
            warn_if_unlike(
                "draft_replicas_differ", replica.address, draft_info, self._draft_info, _ALIKE_DRAFT_FIELDS,
                "the limits GetInfo reports are the first replica's; deploy one draft model everywhere",
            )  # fmt: skip
        self.drafts.join(replica, target_info)

    async def _join_draft(
        self,
        replica: DraftClient,
        connecting: asyncio.Task[common_pb2.WorkerInfo],
        target_info: common_pb2.WorkerInfo,
        timeout_s: float,
    ) -> None:
        """Waits for a draft replica that was not serving at start-up (for as long as it takes),
        then drafts with it: requests that start from then on see it."""
        while True:
            try:
                draft_info = await connecting
                break
            except (RuntimeError, grpc.aio.AioRpcError) as exc:
                error = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.warning("draft_not_ready", address=replica.address, error=error)
                await asyncio.sleep(self.settings.draft_retry_s)  # an Info call can fail at once
                connecting = asyncio.create_task(replica.connect(timeout_s))
        await self._started.wait()  # start-up's own configuration comes first
        had_draft = self._draft_info is not None
        try:
            self._fit_draft(replica, target_info, draft_info)
        except RuntimeError as exc:
            log.error("draft_not_used", address=replica.address, model=draft_info.model_id, error=str(exc))
            return
        if had_draft:  # the service drafts already: one more replica to draft on
            log.info("draft_joined", address=replica.address, draft=draft_info.model_id)
        else:
            self._configure(target_info, draft_info, "draft_joined")

    def _configure(
        self, target_info: common_pb2.WorkerInfo, draft_info: common_pb2.WorkerInfo | None, event: str
    ) -> None:
        """Limits, costs and GetInfo for the workers met so far (again when a late draft joins);
        logs ``event`` with them."""
        s, tokenizer = self.settings, self._tokenizer
        assert tokenizer is not None
        max_k = largest_block(s.max_speculative_tokens, self.targets.max_draft_tokens, draft_info)
        pipelined = choose_pipelined(s.speculation_mode, target_info, draft_info)
        limits = Limits(
            vocab_size=target_info.vocab_size,
            max_context_len=target_info.max_context_len,
            eos_token_ids=frozenset(target_info.eos_token_ids),
            default_max_new_tokens=min(s.default_max_new_tokens, target_info.max_context_len - 1),
            max_prompt_chars=MAX_PROMPT_CHARS,
            draft_context_len=draft_info.max_context_len if draft_info is not None else 0,
            default_method=s.default_method(draft_info is not None),
            draft_confidence=s.draft_confidence,
            draft_block_confidence=s.draft_block_confidence,
            draft_block_confidence_from_costs=s.draft_block_confidence_from_costs and s.adaptive_k,
            structured_output=self.targets.grammars,
            **k_limits(s, max_k),
        )
        if draft_info is not None and draft_info.max_context_len < target_info.max_context_len:
            log.warning(
                "draft_context_shorter",
                draft_context_len=draft_info.max_context_len,
                target_context_len=target_info.max_context_len,
                effect="sessions longer than the draft's context decode target-only",
            )
        # the prefill rates the workers timed at start-up (the slowest replica's), until calls are measured
        targets = [r.info for r in self.targets.replicas]
        costs = StepCosts(
            load=lambda: self._active,  # the requests in flight: costs measured under load price load
            prefill_per_token=max((i.prefill_ms_per_token for i in targets), default=0.0) or None,
            draft_prefill_per_token=(draft_info.prefill_ms_per_token or None) if draft_info is not None else None,
            prefill_per_1k_context=max((i.prefill_ms_per_token_per_1k_context for i in targets), default=0.0),
            draft_prefill_per_1k_context=draft_info.prefill_ms_per_token_per_1k_context if draft_info else 0.0,
        )
        draft = self.drafts if draft_info is not None else None
        self._deps = TurnDeps(
            self.store, self.targets, draft, tokenizer, limits, self.metrics, s.worker_timeout_s, s.state_retry_s,
            costs, pipelined, s.adaptive_k, s.probe_every, lease_s=s.session_lease_s,
            prefix_block=s.prefix_block_tokens, prefix_ttl_s=prefix_ttl_s(s.session_ttl_s, target_info),
            ngram=(s.ngram_min, s.ngram_max),
            replies=self._replies, load_limit=LoadLimit(s.speculation_max_requests),
        )  # fmt: skip
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self._info_from = (target_info, draft_info, pipelined, has_template)  # GetInfo's other sources
        self._info = server_info(s, limits, *self._info_from)
        log.info(
            event,
            target=target_info.model_id,
            draft=draft_info.model_id if draft_info else None,
            draft_vocab_method=vocab_method(draft_info),
            mode="pipelined" if pipelined else "sequential",
            adaptive_k=s.adaptive_k,
            draft_method=limits.default_method,
        )

    @property
    def deps(self) -> TurnDeps:
        if self._deps is None:
            raise NotServing("the coordinator is starting up; retry when health reports SERVING")
        return self._deps

    @property
    def ready(self) -> bool:
        """Start-up is done: the workers answered and fit together."""
        return self._deps is not None

    @property
    def active(self) -> int:
        """Requests generating now."""
        return self._active

    @property
    def generated_tokens(self) -> int:
        """Tokens committed since start."""
        return self.metrics.generated_total

    @property
    def limits(self) -> Limits:
        return self.deps.limits

    @property
    def info(self) -> coordinator_pb2.GetInfoResponse:
        if self._info is None:
            raise NotServing("the coordinator is starting up; retry when health reports SERVING")
        return self._info

    @asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """Admission control: RESOURCE_EXHAUSTED at once when at the limit, or when the caller (an
        authenticated identity) is at its own (no queue)."""
        limit, caller, per_caller = self.settings.max_concurrent_requests, caller_identity.get(), 0
        if caller:  # without one, every client (and a gateway's users) would share one count
            per_caller = self.settings.max_requests_per_caller
        if per_caller and self._by_caller[caller] >= per_caller:
            self.metrics.rejected_requests.inc()
            raise Overloaded(
                f"you have {per_caller} requests generating, the most this server runs at once for one caller; "
                "retry when one of them ends"
            )
        if self._active >= limit:
            self.metrics.rejected_requests.inc()
            raise Overloaded(f"the server is at its limit of {limit} concurrent requests; retry with backoff")
        self._active += 1
        self._by_caller[caller] += 1
        self.metrics.active_requests.inc()
        try:
            yield
        finally:
            self._active -= 1
            self._by_caller[caller] -= 1
            if not self._by_caller[caller]:
                del self._by_caller[caller]
            self.metrics.active_requests.dec()

    def new_turn(self, request: TurnRequest, deadline: float | None) -> Turn:
        return Turn(self.deps, request, deadline)

    async def close_session(self, session_id: str) -> bool:
        """Deletes the session and frees its caches in every worker (idempotent). Freeing is best
        effort, as after a failed turn (workers also free idle caches): a hung worker gets
        ``CLEANUP_TIMEOUT_S``, not --worker-timeout-s."""
        existed = await self.store.delete(session_id)
        calls = [replica.release(session_id, CLEANUP_TIMEOUT_S) for replica in self.targets.replicas]
        if self.drafts is not None:
            calls += [replica.release(session_id, CLEANUP_TIMEOUT_S) for replica in self.drafts.replicas]
        await asyncio.gather(*calls, return_exceptions=True)
        return existed

    async def stop(self) -> None:
        for join in self._draft_joins:
            join.cancel()
        if self._watch is not None:
            self._watch.cancel()
        await self.store.close()
        await self.targets.close()
        if self.drafts is not None:
            await self.drafts.close()


async def _first_serving(connecting: list[asyncio.Task[common_pb2.WorkerInfo]], timeout_s: float) -> None:
    """Waits until every draft replica has answered or failed, or until ``timeout_s``; once one
    has answered, at most DRAFT_PEERS_WAIT_S more for the others (a replica that is down then
    joins when it serves, instead of holding start-up for the whole wait)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    pending = set(connecting)
    while pending:
        left = max(end - loop.time(), 0.0)
        done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            return
        if any(task.exception() is None for task in done):
            end = min(end, loop.time() + DRAFT_PEERS_WAIT_S)

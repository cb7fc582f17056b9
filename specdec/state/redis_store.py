"""Redis state store (``redis://`` / ``rediss://``): commits are Lua compare-and-set scripts."""

from __future__ import annotations

import dataclasses
import hashlib
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.credentials import CredentialProvider
from redis.exceptions import (
    AuthenticationError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from specdec.runtime.tokens import pack_tokens, unpack_tokens
from specdec.serving.errors import (
    SessionBusy,
    SessionNotFound,
    StartupError,
    StateConflict,
    StateLost,
    StateStoreFull,
    StateUnavailable,
    StateUnreachable,
)
from specdec.serving.security import secret_file
from specdec.state.base import (
    RECENT_STEPS,
    STORE_FULL,
    TOMBSTONE_EXTRA_MS,
    CacheLocation,
    Commit,
    CommitOutcome,
    CommitResult,
    PrefixLocation,
    SessionRecord,
    StateStore,
    session_conflict,
    session_gone,
    too_many_session_tokens,
    too_many_sessions,
)

T = TypeVar("T")
log = structlog.get_logger(__name__)

# A Redis at its maxmemory with noeviction refuses a script at its first write that may grow the
# store (unless it has written already: a script runs whole or not at all). Scripts that only give
# up or keep what a turn holds, or rewrite fields at the same size (a turn's rollback, a lease's
# renewal or release, a one-shot session's deletion, a cache location's flag), declare that they
# may run then (Redis 7's script flags): a turn cut short by a full store leaves its session as it
# found it, and free. (A release still writes its owner's tombstone, a small key that lives for
# the lease and a minute: past maxmemory by that much at most, for each request refused meanwhile.)
_ALLOW_OOM = "#!lua flags=allow-oom\n"
_NOW_MS = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
# Every script first checks the epoch marker: a Redis that restarted without persistence has
# lost it (and every session), which must surface as an error, never as a silent fresh start.
_EPOCH = "if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {'epoch'} end\n"
# Cuts the recorded cache locations of session hash ``key`` to at most ``n`` tokens.
_CUT_LOCATIONS = """
local function cut_locations(key, n)
  for _, field in ipairs({'target', 'draft'}) do
    local raw = redis.call('HGET', key, field)
    if raw and raw ~= '' then
      local loc = cjson.decode(raw)
      if loc.length > n then
        loc.length = n
        redis.call('HSET', key, field, cjson.encode(loc))
      end
    end
  end
end
"""
# A session counted against its caller's limits names the set that counts it (its hash's field
# 'caller'); deleting the session takes it out of that set, and drops the caller's last sum of its
# sessions' tokens (the set's key .. ':held', kept for a second: see _ACQUIRE), as a commit does.
# (Keys the script is not given in KEYS: this store keeps all its keys on one Redis, never a Redis
# Cluster.)
_FORGET = """
local function forget(key)
  local caller = redis.call('HGET', key, 'caller')
  if caller then
    redis.call('SREM', caller, key)
    redis.call('DEL', caller .. ':held')
  end
end
"""

# KEYS: session, epoch, the owner's tombstone, session tokens, and where the session is counted
# for its caller: the caller's sessions (a set of session keys), the caller's last recount (a
# marker), the caller's last sum of its sessions' tokens; ARGV: epoch, owner, create (0/1),
# lease_ms, ttl_ms, the caller's session limit and its budget of tokens (each 0 = none), the
# prefix of session keys and that of session tokens keys. The sum reads every counted session; it
# is kept for a second, or until one of them commits or is deleted, so that requests refused at
# the budget (or many at once) do not each read them all.
_ACQUIRE = (
    _EPOCH
    + _NOW_MS
    + _CUT_LOCATIONS
    + _FORGET
    + """
if redis.call('EXISTS', KEYS[3]) == 1 then return {'released'} end
local held = redis.call('HMGET', KEYS[1], 'owner', 'lease', 'undo_created', 'undo_version', 'version', 'tokens')
if held[1] and held[1] ~= ARGV[2] and held[1] ~= '' and tonumber(held[2]) > now then return {'busy'} end
if held[6] then  -- an earlier release kept the tokens in the hash: they move to their own key
  redis.call('SET', KEYS[4], held[6])
  redis.call('HDEL', KEYS[1], 'tokens')
end
if held[1] and held[1] ~= ARGV[2] then
  -- A turn its owner left open (see Commit.opens_turn) is undone, if its commits were the last:
  -- a writer that does not keep the undo fields (an older release, mid-upgrade) may have moved on.
  if held[3] and held[4] ~= held[5] then
    redis.call('HDEL', KEYS[1], 'undo_tokens', 'undo_chat', 'undo_created', 'undo_version')
  elseif held[3] == '1' then
    forget(KEYS[1])
    redis.call('DEL', KEYS[1], KEYS[4])
  elseif held[3] then
    local was = redis.call('HMGET', KEYS[1], 'undo_tokens', 'undo_chat', 'version')
    redis.call('SET', KEYS[4], was[1])
    redis.call('HSET', KEYS[1], 'chat', was[2], 'version', tonumber(was[3]) + 1, 'updated', now)
    cut_locations(KEYS[1], 0)  -- as a rollback leaves them
    redis.call('HDEL', KEYS[1], 'undo_tokens', 'undo_chat', 'undo_created', 'undo_version')
  end
end
local counted, budget = KEYS[5] ~= nil, tonumber(ARGV[7])
if counted and budget > 0 then
  -- the tokens the caller's sessions hold (sessions that expired leave the count)
  local held = tonumber(redis.call('GET', KEYS[7]))
  if not held then
    held = 0
    for _, key in ipairs(redis.call('SMEMBERS', KEYS[5])) do
      if redis.call('EXISTS', key) == 0 then
        redis.call('SREM', KEYS[5], key)
      else
        held = held + redis.call('STRLEN', ARGV[9] .. string.sub(key, #ARGV[8] + 1)) / 4
      end
    end
    redis.call('SET', KEYS[7], held, 'PX', 1000)
  end
  if held >= budget then return {'over_budget', held} end
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  if ARGV[3] == '0' then return {'missing'} end
  local limit = tonumber(ARGV[6])
  if counted and limit > 0 then
    -- at the limit, sessions that expired leave the count (their keys are gone); at most one
    -- recount a second for a caller, whose sessions it reads one by one
    if redis.call('SCARD', KEYS[5]) >= limit and redis.call('SET', KEYS[6], '1', 'PX', 1000, 'NX') then
      for _, key in ipairs(redis.call('SMEMBERS', KEYS[5])) do
        if redis.call('EXISTS', key) == 0 then redis.call('SREM', KEYS[5], key) end
      end
    end
    if redis.call('SCARD', KEYS[5]) >= limit then return {'too_many'} end
  end
  if counted then redis.call('SADD', KEYS[5], KEYS[1]) end
  redis.call('SET', KEYS[4], '')
  redis.call('HSET', KEYS[1], 'version', 0, 'steps', '|', 'owner', ARGV[2],
             'lease', now + tonumber(ARGV[4]), 'created', now, 'updated', now,
             'target', '', 'draft', '')
  if counted then redis.call('HSET', KEYS[1], 'caller', KEYS[5]) end
else
  redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'lease', now + tonumber(ARGV[4]))
end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[4], ARGV[5])
return {'ok', redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[4]) or ''}
"""
)

# KEYS: session, epoch, session tokens; ARGV: epoch, owner, expected_version (-1 = any: the owner's rollback), step,
# append (packed uint32), truncate_to (-1 = none), target json ('' = unchanged), target length (-1 = none), draft json,
# draft length, lease_ms, ttl_ms, recent steps kept, chat ('' = unchanged, else '=' .. the new value),
# turn ('open' / 'close' / '': see Commit.opens_turn), the session's creation time in ms ('' = any: see
# Commit.created_at)
_COMMIT = (
    _EPOCH
    + _NOW_MS
    + _CUT_LOCATIONS
    + """
local cur = redis.call('HMGET', KEYS[1], 'version', 'steps', 'owner', 'created')
if not cur[1] or (ARGV[16] ~= '' and cur[4] and cur[4] ~= ARGV[16]) then return {'missing', 0} end
if string.find(cur[2], '|' .. ARGV[4] .. '|', 1, true) then
  -- a write of this call's own, after the first one's in the replication stream: a WAIT that
  -- follows on this connection covers the commit that applied (--state-replica-acks)
  redis.call('PEXPIRE', KEYS[1], ARGV[12])
  redis.call('PEXPIRE', KEYS[3], ARGV[12])  -- the two keys keep one TTL
  return {'already', tonumber(cur[1])}
end
if tonumber(ARGV[3]) >= 0 and tonumber(cur[1]) ~= tonumber(ARGV[3]) then return {'conflict', tonumber(cur[1])} end
if cur[3] ~= ARGV[2] then return {'not_owner', tonumber(cur[1])} end
local caller = redis.call('HGET', KEYS[1], 'caller')
if caller then redis.call('DEL', caller .. ':held') end  -- its last sum of tokens (_ACQUIRE)
local length = redis.call('STRLEN', KEYS[3]) / 4
local kept = length
local cut = tonumber(ARGV[6])
if cut >= 0 and cut < length then kept = cut end
local committed = kept + #ARGV[5] / 4
if tonumber(ARGV[8]) > committed or tonumber(ARGV[10]) > committed then return {'invalid', committed} end
local version = tonumber(cur[1]) + 1
if ARGV[15] == 'open' then
  redis.call('HSET', KEYS[1], 'undo_tokens', redis.call('GET', KEYS[3]) or '',
             'undo_chat', redis.call('HGET', KEYS[1], 'chat') or '',
             'undo_created', cur[1] == '0' and 1 or 0, 'undo_version', version)
elseif ARGV[15] == 'close' then
  redis.call('HDEL', KEYS[1], 'undo_tokens', 'undo_chat', 'undo_created', 'undo_version')
elseif redis.call('HEXISTS', KEYS[1], 'undo_version') == 1 then
  redis.call('HSET', KEYS[1], 'undo_version', version)  -- the open turn's latest commit
end
local steps = cur[2] .. ARGV[4] .. '|'
local _, bars = string.gsub(steps, '|', '')
while bars > tonumber(ARGV[13]) + 1 do
  local cut = string.find(steps, '|', 2, true)  -- (find returns start AND end: keep only start)
  steps = string.sub(steps, cut)
  bars = bars - 1
end
-- A round appends (what the AOF and the replicas receive is what it adds); only a cut rewrites.
if kept < length then
  redis.call('SET', KEYS[3], string.sub(redis.call('GET', KEYS[3]), 1, kept * 4) .. ARGV[5])
elseif ARGV[5] ~= '' then
  redis.call('APPEND', KEYS[3], ARGV[5])
end
redis.call('HSET', KEYS[1], 'version', version, 'steps', steps, 'updated', now, 'lease', now + tonumber(ARGV[11]))
if ARGV[14] ~= '' then redis.call('HSET', KEYS[1], 'chat', string.sub(ARGV[14], 2)) end
cut_locations(KEYS[1], kept)  -- a location this commit does not set is valid for the tokens it kept, at most
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'target', ARGV[7]) end
if ARGV[9] ~= '' then redis.call('HSET', KEYS[1], 'draft', ARGV[9]) end
redis.call('PEXPIRE', KEYS[1], ARGV[12])
redis.call('PEXPIRE', KEYS[3], ARGV[12])
return {'applied', version}
"""
)

# KEYS: session; ARGV: the draft location claimed (address, length, source, ready_by), the JSON to
# write; 1 when written (the session exists and its draft location still is the one claimed, by
# value: a cut re-encodes the field)
_MARK_DRAFT_READY = (
    _ALLOW_OOM
    + """
local raw = redis.call('HGET', KEYS[1], 'draft')
if not raw or raw == '' then return 0 end
local loc = cjson.decode(raw)
if loc.address ~= ARGV[1] or loc.length ~= tonumber(ARGV[2]) or (loc.source or '') ~= ARGV[3]
   or (loc.ready_by or 0) ~= tonumber(ARGV[4]) then
  return 0
end
redis.call('HSET', KEYS[1], 'draft', ARGV[5])
return 1
"""
)

# KEYS: session, session tokens; ARGV: owner, lease_ms, ttl_ms, the session's creation time in ms ('' = any);
# returns -1 when the session is gone or was made again since, 0 when another request holds it
_RENEW = (
    _ALLOW_OOM
    + _NOW_MS
    + """
local cur = redis.call('HMGET', KEYS[1], 'owner', 'created')
if not cur[1] or (ARGV[4] ~= '' and cur[2] and cur[2] ~= ARGV[4]) then return -1 end
if cur[1] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'lease', now + tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""
)

# KEYS: session, the owner's tombstone, session tokens; ARGV: owner, tombstone_ms, '1' = delete the
# session (if the owner still holds it) instead of giving the lease up. The tombstone makes an
# acquire by this owner that reaches Redis later (sent before a cancellation, delayed by a stall,
# on another connection) a no-op: release and acquire may then arrive in either order.
_RELEASE = (
    _ALLOW_OOM
    + _FORGET
    + """
redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
  if ARGV[3] == '1' then
    forget(KEYS[1])
    redis.call('DEL', KEYS[1], KEYS[3])
  else
    redis.call('HSET', KEYS[1], 'owner', '', 'lease', 0)
  end
end
return 1
"""
)

# KEYS: session, session tokens; the number of keys deleted
_DELETE = (
    _ALLOW_OOM
    + _FORGET
    + """
forget(KEYS[1])
return redis.call('DEL', KEYS[1], KEYS[2])
"""
)

_FLAGS_PROBE = "#!lua flags=no-writes\nreturn 1\n"
# KEYS: session, session tokens. One read of both (a transaction would do, but a full Redis
# refuses every command queued in one).
_READ = """#!lua flags=no-writes
return {redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2])}
"""

_LOST = (
    "the state store lost its data (was Redis restarted without persistence?); "
    "session {sid!r} cannot continue: start it again"
)


def _created_ms(created_at: float | None) -> str:
    """A session's creation time as its hash keeps it (ms; '' = any session of the id)."""
    return "" if created_at is None else str(round(created_at * 1000))


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


def _record(session_id: str, fields: dict[bytes, bytes], tokens: bytes) -> SessionRecord:
    """``tokens``: the session's tokens key (a hash an earlier release wrote holds them itself)."""
    raw = {k.decode(): v for k, v in fields.items()}
    return SessionRecord(
        session_id=session_id,
        tokens=unpack_tokens(raw.get("tokens", tokens)),
        version=int(raw["version"]),
        recent_steps=[step for step in raw["steps"].decode().split("|") if step],
        owner=raw["owner"].decode(),
        target=CacheLocation.from_json(raw["target"]),
        draft=CacheLocation.from_json(raw["draft"]),
        chat=raw.get("chat", b"").decode(),
        created_at=int(raw["created"]) / 1000,
        updated_at=int(raw["updated"]) / 1000,
    )


class FileCredentials(CredentialProvider):
    """Redis AUTH with the password in a file, read again when the file changes: the connections
    made from then on use the new one (a rotated password without a restart)."""

    def __init__(self, username: str | None, password_file: str) -> None:
        self._username = username
        self._password = secret_file(password_file, "state password", "state_password")

    def get_credentials(self) -> tuple[str] | tuple[str, str]:
        password = self._password.current()
        return (self._username, password) if self._username else (password,)

    async def get_credentials_async(self) -> tuple[str] | tuple[str, str]:
        return self.get_credentials()


class RedisStateStore(StateStore):
    """Sessions as Redis hashes ``<prefix>session:<id>`` and their committed tokens as strings
    ``<prefix>tokens:<id>`` (appended to, so a round writes only what it adds), with one TTL."""

    def __init__(
        self,
        url: str,
        ttl_s: float,
        lease_s: float,
        timeout_s: float,
        key_prefix: str = "specdec:",
        max_sessions_per_caller: int = 0,
        replica_acks: int = 0,
        replica_wait_s: float = 1.0,
        max_session_tokens_per_caller: int = 0,
        **connection: Any,
    ) -> None:
        """``max_sessions_per_caller`` (0 = none): the sessions one caller may hold (StateStore.acquire);
        ``max_session_tokens_per_caller`` (0 = none): the tokens one caller's sessions may hold
        before its turns are refused (StateStore.acquire; a turn sums them, one STRLEN a session, and
        the sum is kept for a second or until one of the caller's sessions commits or is deleted);
        ``replica_acks`` (0 = none): the replicas that must have a commit (Redis WAIT, at most
        ``replica_wait_s``) before ``commit`` returns it (see ``commit``);
        ``connection``: extra redis-py connection settings (username, password or
        credential_provider, ssl_ca_certs)."""
        self._client = aioredis.from_url(
            url,
            **connection,
            decode_responses=False,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            health_check_interval=30,
        )
        self._ttl_ms = int(ttl_s * 1000)
        self._lease_ms = int(lease_s * 1000)
        self._prefix = key_prefix
        self._max_sessions = max_sessions_per_caller
        self._max_caller_tokens = max_session_tokens_per_caller
        self._replica_acks = replica_acks
        self._replica_wait_ms = max(int(replica_wait_s * 1000), 1)  # WAIT's 0 would wait for ever
        self._epoch_key = f"{key_prefix}epoch"
        self._epoch = ""
        self._acquire = self._client.register_script(_ACQUIRE)
        self._commit = self._client.register_script(_COMMIT)
        # a turn's rollback puts back what its opening commit kept aside (the undo fields) and
        # drops that copy: it never grows the store, so it runs when the store is full too
        self._rollback = self._client.register_script(_ALLOW_OOM + _COMMIT)
        self._renew = self._client.register_script(_RENEW)
        self._release = self._client.register_script(_RELEASE)
        self._mark_draft_ready = self._client.register_script(_MARK_DRAFT_READY)
        self._read = self._client.register_script(_READ)
        self._delete = self._client.register_script(_DELETE)

    def key(self, session_id: str) -> str:
        return f"{self._prefix}session:{session_id}"

    def tokens_key(self, session_id: str) -> str:
        return f"{self._prefix}tokens:{session_id}"

    def caller_key(self, caller: str) -> str:
        """The set of ``caller``'s sessions counted against its limit (the identity hashed: any
        string makes a key)."""
        return f"{self._prefix}caller:{hashlib.sha256(caller.encode()).hexdigest()[:32]}"

    def _tombstone(self, owner: str) -> str:
        return f"{self._prefix}released:{owner}"

    async def start(self) -> None:
        await self._adopt_epoch()
        await self._check_script_flags()
        await self._check_eviction()

    async def _check_script_flags(self) -> None:
        """Ends start-up where Redis cannot run scripts that declare flags (before 7.0): the
        scripts that free a turn's hold declare theirs, and every renewal and release would fail."""
        try:
            await self._call(lambda: self._client.eval(_FLAGS_PROBE, 0))
        except StateUnavailable as exc:
            cause = exc.__cause__
            if isinstance(cause, ResponseError) and not isinstance(cause, NoPermissionError):
                raise StartupError(
                    f"the state store cannot run scripts that declare flags ({cause}): specdec needs "
                    "Redis 7.0 or later (or Valkey); upgrade it, or point --state-url at one that is"
                ) from None
            raise

    async def _check_eviction(self) -> None:
        """An error line where Redis would evict sessions when full (a memory limit and a policy
        other than noeviction): a session gone between turns would start afresh without its
        history. Where INFO is not allowed (an ACL), nothing is said."""
        try:
            memory = await self._client.info("memory")
        except RedisError as exc:
            log.info("state_store_policy_unread", error=type(exc).__name__)
            return
        policy = memory.get("maxmemory_policy", "noeviction")
        if int(memory.get("maxmemory", 0)) and policy != "noeviction":
            log.error(
                "state_store_evicts_sessions",
                policy=policy,
                fix="set maxmemory-policy noeviction: a full store then refuses new work instead of dropping sessions",
            )

    async def _adopt_epoch(self) -> None:
        """Creates the epoch marker if missing, and remembers its value (read first: a full store
        refuses the write, even one that would change nothing)."""
        epoch = await self._call(lambda: self._client.get(self._epoch_key))
        if epoch is None:
            await self._call(lambda: self._client.set(self._epoch_key, uuid.uuid4().hex, nx=True))
            epoch = await self._call(lambda: self._client.get(self._epoch_key))
        self._epoch = epoch.decode()

    async def _epoch_lost(self, session_id: str) -> StateLost:
        log.error("state_store_epoch_changed", previous_epoch=self._epoch)
        await self._adopt_epoch()
        return StateLost(_LOST.format(sid=session_id))

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            try:
                return await fn()
            except ReadOnlyError:
                # A failover made the node these connections reach a replica (Sentinel, or a managed
                # Redis behind one name): new connections reach the new primary. The write was
                # refused, not applied, so it is sent again once on a fresh connection.
                log.warning("state_store_read_only", action="reconnecting")
                await self._client.connection_pool.disconnect(inuse_connections=False)
                return await fn()
        except OutOfMemoryError as exc:
            log.warning("state_store_full", hint="raise Redis's maxmemory, or lower --session-ttl-s")
            raise StateStoreFull(STORE_FULL) from exc
        except RedisError as exc:
            message = f"state store unavailable ({type(exc).__name__}); retry later"
            if isinstance(exc, RedisConnectionError | RedisTimeoutError) and not isinstance(exc, AuthenticationError):
                raise StateUnreachable(message) from exc
            raise StateUnavailable(message) from exc

    async def acquire(self, session_id: str, owner: str, *, create: bool, caller: str | None = None) -> SessionRecord:
        counted = caller is not None and (self._max_sessions > 0 or self._max_caller_tokens > 0)
        limits = [self._max_sessions, self._max_caller_tokens] if counted else [0, 0]
        prefixes = [self.key(""), self.tokens_key("")]
        args = [self._epoch, owner, int(create), self._lease_ms, self._ttl_ms, *limits, *prefixes]
        keys = [self.key(session_id), self._epoch_key, self._tombstone(owner), self.tokens_key(session_id)]
        if counted and caller is not None:
            counting = self.caller_key(caller)
            keys += [counting, f"{counting}:recounted", f"{counting}:held"]
        reply: list[Any] = await self._call(lambda: self._acquire(keys=keys, args=args))
        status = reply[0].decode()
        if status == "epoch":
            raise await self._epoch_lost(session_id)
        if status == "released":
            raise StateConflict(f"the request holding session {session_id!r} already ended")
        if status == "missing":
            raise SessionNotFound(f"session {session_id!r} does not exist or has expired")
        if status == "busy":
            raise SessionBusy(f"session {session_id!r} is generating for another request; retry when it ends")
        if status == "too_many":
            raise too_many_sessions(self._max_sessions)
        if status == "over_budget":
            raise too_many_session_tokens(self._max_caller_tokens, int(reply[1]))
        return _record(session_id, _pairs(reply[1]), reply[2])

    async def commit(self, session_id: str, owner: str, commit: Commit) -> CommitResult:
        args = [
            self._epoch,
            owner,
            -1 if commit.expected_version is None else commit.expected_version,
            commit.step_id,
            pack_tokens(commit.append),
            -1 if commit.truncate_to is None else commit.truncate_to,
            commit.target.to_json() if commit.target else "",
            commit.target.length if commit.target else -1,
            commit.draft.to_json() if commit.draft else "",
            commit.draft.length if commit.draft else -1,
            self._lease_ms,
            self._ttl_ms,
            RECENT_STEPS,
            "" if commit.chat is None else "=" + commit.chat,
            "open" if commit.opens_turn else "close" if commit.closes_turn else "",
            _created_ms(commit.created_at),
        ]
        keys = [self.key(session_id), self._epoch_key, self.tokens_key(session_id)]
        rollback = commit.expected_version is None and commit.closes_turn  # no tokens are sent from one
        if self._replica_acks and not rollback:
            reply, acks = await self._call(lambda: self._commit_on_replicas(keys, args))
        else:
            script = self._rollback if rollback else self._commit
            reply, acks = await self._call(lambda: script(keys=keys, args=args)), self._replica_acks
        status_raw, *rest = reply
        status = status_raw.decode()
        version = int(rest[0]) if rest else 0
        if status == "epoch":
            raise await self._epoch_lost(session_id)
        if status == "invalid":
            raise ValueError(f"a cache length exceeds the committed length {version}")
        if status in ("applied", "already") and acks < self._replica_acks:
            # the commit is on the primary, not yet on enough replicas: the caller retries it (a
            # retry applies nothing and waits again) and sends no tokens from it until one succeeds
            log.warning("state_replicas_behind", acks=acks, wanted=self._replica_acks, step=commit.step_id)
            raise StateUnavailable(
                f"{acks} of the {self._replica_acks} state store replicas a commit needs (--state-replica-acks) "
                f"had it within {self._replica_wait_ms} ms; retry later"
            )
        if status == "applied":
            return CommitResult(CommitOutcome.APPLIED, int(version))
        if status == "already":
            return CommitResult(CommitOutcome.ALREADY_APPLIED, int(version))
        if status == "missing":
            raise session_gone(session_id)
        raise session_conflict(session_id, taken=status == "not_owner")

    async def _commit_on_replicas(self, keys: list[str], args: list[Any]) -> tuple[list[Any], int]:
        """The commit script, then WAIT, on one connection (WAIT counts the replicas that have
        every write of its own connection): the script's reply and the replicas that have it."""
        async with self._client.pipeline(transaction=False) as pipe:
            await self._commit(keys=keys, args=args, client=pipe)
            pipe.wait(self._replica_acks, self._replica_wait_ms)
            reply, acks = await pipe.execute()
        return reply, int(acks)

    async def renew(self, session_id: str, owner: str, created_at: float | None = None) -> bool:
        args = [owner, self._lease_ms, self._ttl_ms, _created_ms(created_at)]
        keys = [self.key(session_id), self.tokens_key(session_id)]
        renewed = int(await self._call(lambda: self._renew(keys=keys, args=args)))
        if renewed < 0:
            raise session_gone(session_id)
        return renewed == 1

    async def release(self, session_id: str, owner: str, *, delete: bool = False) -> None:
        keys = [self.key(session_id), self._tombstone(owner), self.tokens_key(session_id)]
        args = [owner, self._lease_ms + TOMBSTONE_EXTRA_MS, int(delete)]
        await self._call(lambda: self._release(keys=keys, args=args))

    async def mark_draft_ready(self, session_id: str, claimed: CacheLocation) -> bool:
        held = dataclasses.replace(claimed, ready_by=0.0).to_json()
        args = [claimed.address, claimed.length, claimed.source, repr(claimed.ready_by), held]
        return bool(await self._call(lambda: self._mark_draft_ready(keys=[self.key(session_id)], args=args)))

    async def get(self, session_id: str) -> SessionRecord | None:
        keys = [self.key(session_id), self.tokens_key(session_id)]
        fields, tokens = await self._call(lambda: self._read(keys=keys))
        return _record(session_id, _pairs(fields), tokens or b"") if fields else None

    async def delete(self, session_id: str) -> bool:
        keys = [self.key(session_id), self.tokens_key(session_id)]
        return bool(await self._call(lambda: self._delete(keys=keys)))

    def _prefix_key(self, key: str) -> str:
        return f"{self._prefix}prefix:{key}"

    async def put_prefixes(self, keys: Sequence[str], location: PrefixLocation, ttl_s: float) -> None:
        value, ttl_ms = location.to_json(), max(int(ttl_s * 1000), 1)

        async def put() -> None:
            async with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.set(self._prefix_key(key), value, px=ttl_ms)
                await pipe.execute()

        await self._call(put)

    async def find_prefix(self, keys: Sequence[str]) -> tuple[int, PrefixLocation] | None:
        if not keys:
            return None
        values: list[bytes | None] = await self._call(lambda: self._client.mget([self._prefix_key(k) for k in keys]))
        for index in range(len(values) - 1, -1, -1):
            raw = values[index]
            if raw is not None:
                return index, PrefixLocation.from_json(raw)
        return None

    async def ping(self) -> None:
        await self._call(self._client.ping)

    async def close(self) -> None:
        await self._client.aclose()

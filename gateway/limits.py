"""Per-tenant limits: requests per minute, tokens per minute and concurrent requests.

RPM and TPM are token buckets that refill continuously (capacity = the per-minute limit); the
concurrency limit is a set of in-flight request ids with an expiry, so a gateway that dies
cannot leak slots forever. All three are checked and taken in one Lua script on Redis, on Redis's
clock, so one limit holds across every gateway replica. A tenant's three keys share one hash tag
(common/redis_keys.py: kvharbor:rl:{tenant}:rpm|tpm|conc), so on a Redis Cluster they live in
one slot and the script runs on the node that owns it. TPM takes the prompt's tokens on
admission and output tokens as they stream (the bucket may go below zero; the next request then
waits).

While Redis is down the `open` policy falls back to the same buckets in this process (each
replica then enforces the limits alone), and `closed` refuses with LimiterUnavailable.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvharbor.common.openai_api import APIError
from kvharbor.common.redis_client import is_cluster_client
from kvharbor.common.redis_keys import RATE_LIMIT_PREFIX, rate_limit_key
from kvharbor.gateway.tenants import Tenant

log = logging.getLogger("kvharbor.gateway.limits")
PREFIX = RATE_LIMIT_PREFIX
CONCURRENCY_TTL_S = 900.0  # a slot's lease: longer than any request may take

# KEYS: rpm bucket, tpm bucket, concurrency set. ARGV: rpm, tpm, max_concurrent (0 = none),
# prompt tokens, slot ttl ms, then the request's slots (slot_members: one per prompt it carries).
# Returns {ok, reason, retry_after_ms, rpm_left, tpm_left}.
_ADMIT = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local need = tonumber(ARGV[4])
local function level(key, cap)
  if cap == 0 then return 0 end
  local b = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens, ts = tonumber(b[1]), tonumber(b[2])
  if not tokens then return cap end
  return math.min(cap, tokens + (now - ts) * cap / 60000)
end
local r, k = level(KEYS[1], rpm), level(KEYS[2], tpm)
if tpm > 0 then need = math.min(need, tpm) else need = 0 end
if rpm > 0 and r < 1 then
  return {0, 'rpm', math.ceil((1 - r) * 60000 / rpm), tostring(r), tostring(k)}
end
if tpm > 0 and k < need then
  return {0, 'tpm', math.ceil((need - k) * 60000 / tpm), tostring(r), tostring(k)}
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) + #ARGV - 5 > conc then
    return {0, 'concurrency', 1000, tostring(r), tostring(k)}
  end
  for i = 6, #ARGV do
    redis.call('ZADD', KEYS[3], now + tonumber(ARGV[5]), ARGV[i])
  end
  redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[5]))
end
if rpm > 0 then
  r = r - 1
  redis.call('HSET', KEYS[1], 'tokens', r, 'ts', now)
  redis.call('PEXPIRE', KEYS[1], 120000)
end
if tpm > 0 then
  k = k - need
  redis.call('HSET', KEYS[2], 'tokens', k, 'ts', now)
  redis.call('PEXPIRE', KEYS[2], 120000)
end
return {1, '', 0, tostring(r), tostring(k)}
"""

# KEYS: tpm bucket. ARGV: tpm, tokens. Takes streamed output tokens (down to -tpm at most).
_DEBIT = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local cap, n = tonumber(ARGV[1]), tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(b[1]), tonumber(b[2])
if not tokens then tokens, ts = cap, now end
tokens = math.max(-cap, math.min(cap, tokens + (now - ts) * cap / 60000) - n)
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('PEXPIRE', KEYS[1], 120000)
return tostring(tokens)
"""


# What redis-py's cluster client says of a call it cannot route (a RedisClusterException).
_UNROUTABLE = ("must map to the same key slot", "No way to dispatch", "Invalid args in command")


# KEYS: concurrency set. ARGV: slot ttl ms, then the request's slots. Pushes their expiry out (those
# it holds).
_RENEW = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local kept = 0
for i = 2, #ARGV do
  kept = kept + redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[1]), ARGV[i])
end
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1])) end
return kept
"""


def slot_members(request_id: str, weight: int = 1) -> list[str]:
    """The concurrency slots one request holds: one per prompt it carries (a completions prompt
    list of k prompts is k requests' work, and takes k of the tenant's max_concurrent)."""
    return [request_id] + [f"{request_id}:{i}" for i in range(1, weight)]


class LimiterUnavailable(RuntimeError):
    """Redis is down and the policy is fail-closed."""


@dataclass(frozen=True)
class Decision:
    ok: bool
    reason: str = ""  # rpm | tpm | concurrency
    retry_after_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)


def _headers(tenant: Tenant, rpm_left: float, tpm_left: float) -> dict[str, str]:
    h: dict[str, str] = {}
    lim = tenant.limits
    if lim.rpm:
        h["x-ratelimit-limit-requests"] = str(lim.rpm)
        h["x-ratelimit-remaining-requests"] = str(max(0, math.floor(rpm_left)))
        h["x-ratelimit-reset-requests"] = f"{max(0.0, (lim.rpm - rpm_left) * 60 / lim.rpm):.1f}s"
    if lim.tpm:
        h["x-ratelimit-limit-tokens"] = str(lim.tpm)
        h["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(tpm_left)))
        h["x-ratelimit-reset-tokens"] = f"{max(0.0, (lim.tpm - tpm_left) * 60 / lim.tpm):.1f}s"
    return h


class _LocalBuckets:
    """The same buckets in this process, for when Redis is away (fail-open)."""

    def __init__(self) -> None:
        self._levels: dict[str, tuple[float, float]] = {}
        self._slots: dict[str, dict[str, float]] = {}

    def _level(self, key: str, cap: int, now: float) -> float:
        tokens, ts = self._levels.get(key, (cap, now))
        return min(cap, tokens + (now - ts) * cap / 60)

    def admit(
        self, tenant: Tenant, prompt_tokens: int, request_id: str, ttl: float = CONCURRENCY_TTL_S, weight: int = 1
    ) -> tuple[int, str, float, float, float]:
        now = time.monotonic()
        lim = tenant.limits
        r = self._level(tenant.name + ":rpm", lim.rpm, now) if lim.rpm else 0.0
        k = self._level(tenant.name + ":tpm", lim.tpm, now) if lim.tpm else 0.0
        need = min(prompt_tokens, lim.tpm) if lim.tpm else 0
        if lim.rpm and r < 1:
            return 0, "rpm", (1 - r) * 60 / lim.rpm, r, k
        if lim.tpm and k < need:
            return 0, "tpm", (need - k) * 60 / lim.tpm, r, k
        slots = self._slots.setdefault(tenant.name, {})
        for rid in [rid for rid, until in slots.items() if until <= now]:
            del slots[rid]
        if lim.max_concurrent and len(slots) + weight > lim.max_concurrent:
            return 0, "concurrency", 1.0, r, k
        for member in slot_members(request_id, weight):
            slots[member] = now + ttl
        if lim.rpm:
            r -= 1
            self._levels[tenant.name + ":rpm"] = (r, now)
        if lim.tpm:
            k -= need
            self._levels[tenant.name + ":tpm"] = (k, now)
        return 1, "", 0.0, r, k

    def debit(self, tenant: Tenant, tokens: int) -> None:
        if tenant.limits.tpm:
            now = time.monotonic()
            cap = tenant.limits.tpm
            level = self._level(tenant.name + ":tpm", cap, now)
            self._levels[tenant.name + ":tpm"] = (max(-cap, level - tokens), now)

    def release(self, tenant: Tenant, request_id: str, weight: int = 1) -> None:
        for member in slot_members(request_id, weight):
            self._slots.get(tenant.name, {}).pop(member, None)

    def renew(self, tenant: Tenant, request_id: str, ttl: float, weight: int = 1) -> None:
        slots = self._slots.get(tenant.name, {})
        for member in slot_members(request_id, weight):
            if member in slots:
                slots[member] = time.monotonic() + ttl


class RateLimiter:
    def __init__(
        self, client=None, policy: str = "open", prefix: str = PREFIX, slot_ttl: float = CONCURRENCY_TTL_S
    ) -> None:
        self.client = client  # redis.asyncio Redis or RedisCluster (common/redis_client.py), or None: local only
        self.policy = policy
        self.prefix = prefix
        self._local = _LocalBuckets()
        self._admit = client.register_script(_ADMIT) if client is not None else None
        self._debit = client.register_script(_DEBIT) if client is not None else None
        self._renew = client.register_script(_RENEW) if client is not None else None
        self.slot_ttl = slot_ttl  # a slot's lease; streams renew it while they live (renew_slot)
        self.redis_failures = 0
        # A cluster client read the slot map once before any call (see _ready); a plain one needs nothing.
        self._initialized = client is None or not is_cluster_client(client)
        self._initializing: asyncio.Future | None = None

    async def _ready(self) -> None:
        """Let a RedisCluster client read the slot map and open its nodes once, before the calls.
        redis-py's cluster client (8.1) does that itself on its first call, but then disconnects,
        in the background, connections that calls racing it (a burst on a fresh gateway) have
        just taken: AttributeError on a closed writer, and a script may have run with its reply lost.
        Every caller meanwhile awaits the same attempt; a failed one (Redis away) is tried again
        by the next call, and its error goes where the call's own would."""
        if self._initialized:
            return
        if self._initializing is None:
            self._initializing = asyncio.ensure_future(self.client.initialize())
            self._initializing.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, even unawaited
        attempt = self._initializing
        try:
            await asyncio.shield(attempt)
        except BaseException:
            if self._initializing is attempt and attempt.done():
                self._initializing = None
            raise
        self._initialized = True

    def _keys(self, tenant: Tenant) -> list[str]:
        """rpm bucket, tpm bucket, concurrency set: one hash slot (the scripts take them together)."""
        return [rate_limit_key(tenant.name, kind, self.prefix) for kind in ("rpm", "tpm", "conc")]

    async def admit(self, tenant: Tenant, prompt_tokens: int, request_id: str, weight: int = 1) -> Decision:
        """Take one request (of `weight` prompts: as many concurrency slots) and its prompt tokens."""
        lim = tenant.limits
        if not (lim.rpm or lim.tpm or lim.max_concurrent):
            return Decision(True)
        args = [lim.rpm or 0, lim.tpm or 0, lim.max_concurrent or 0, prompt_tokens, int(self.slot_ttl * 1000),
                *slot_members(request_id, weight)]  # fmt: skip
        try:
            if self._admit is None:
                raise ConnectionError("no Redis configured")
            await self._ready()
            ok, reason, retry_ms, r, k = await self._admit(keys=self._keys(tenant), args=args)
            ok, reason, retry_s, r, k = int(ok), _text(reason), int(retry_ms) / 1000, float(r), float(k)
        except Exception as exc:
            if not self._redis_down(exc):
                raise
            ok, reason, retry_s, r, k = self._local.admit(tenant, prompt_tokens, request_id, self.slot_ttl, weight)
        return Decision(bool(ok), reason, retry_s, _headers(tenant, r, k))

    def _redis_down(self, exc: Exception) -> bool:
        from redis.exceptions import RedisClusterException, RedisError

        # The cluster client raises RedisClusterException (not a RedisError) when no node answers,
        # and also for calls it cannot route (keys of several slots): those are bugs, not outages.
        if not isinstance(exc, RedisError | RedisClusterException | OSError | TimeoutError | ConnectionError):
            return False
        if isinstance(exc, RedisClusterException) and any(m in str(exc) for m in _UNROUTABLE):
            return False
        self.redis_failures += 1
        if self.policy == "closed":
            raise LimiterUnavailable(f"rate limits unavailable (Redis: {exc}); retry shortly") from exc
        if self.redis_failures == 1 or self.redis_failures % 100 == 0:
            log.warning(
                "Redis unavailable for rate limits; enforcing them in this gateway only", extra={"error": repr(exc)}
            )
        return True

    async def debit_tokens(self, tenant: Tenant, tokens: int) -> None:
        if not tenant.limits.tpm or tokens <= 0:
            return
        try:
            if self._debit is None:
                raise ConnectionError("no Redis configured")
            await self._ready()
            await self._debit(keys=self._keys(tenant)[1:2], args=[tenant.limits.tpm, tokens])
        except Exception:
            self._local.debit(tenant, tokens)

    async def renew_slot(self, tenant: Tenant, request_id: str, weight: int = 1) -> None:
        """Push a live request's slot leases out by `slot_ttl` (a stream calls this while it runs:
        a stream longer than the lease would lose its slot, and the tenant get one too many)."""
        if not tenant.limits.max_concurrent:
            return
        self._local.renew(tenant, request_id, self.slot_ttl, weight)
        if self._renew is not None:
            try:
                await self._ready()
                args = [int(self.slot_ttl * 1000), *slot_members(request_id, weight)]
                await self._renew(keys=self._keys(tenant)[2:3], args=args)
            except Exception as exc:
                if not self._redis_down(exc):
                    raise

    async def release(self, tenant: Tenant, request_id: str, weight: int = 1) -> None:
        if not tenant.limits.max_concurrent:
            return
        self._local.release(tenant, request_id, weight)
        if self.client is not None:
            try:
                await self._ready()
                await self.client.zrem(self._keys(tenant)[2], *slot_members(request_id, weight))
            except Exception:
                log.debug("could not release a concurrency slot; it will expire", extra={"tenant": tenant.name})


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def take_limits(
    limiter: RateLimiter, tenant: Tenant, tokens: int, slot: str, weight: int, refused: Callable[[str], None]
) -> dict[str, str]:
    """Take the tenant's limits for one call (its prompt `tokens`, `weight` concurrency slots under
    `slot`): the rate-limit headers, or the APIError its refusal is, a 503 while the limiter is
    away (fail-closed) or a 429 naming the limit. `refused(reason)` counts a refusal."""
    try:
        decision = await limiter.admit(tenant, tokens, slot, weight)
    except LimiterUnavailable as exc:
        refused("limiter_unavailable")
        raise APIError(
            503, str(exc), type="service_unavailable", code="limiter_unavailable", headers={"Retry-After": "1"}
        ) from None
    if not decision.ok:
        refused(decision.reason)
        retry = str(max(1, math.ceil(decision.retry_after_s)))
        raise APIError(
            429,
            f"rate limit reached for tenant {tenant.name!r} ({decision.reason}); retry after {retry}s",
            type="rate_limit_error",
            code=f"rate_limit_{decision.reason}",
            headers={**decision.headers, "Retry-After": retry},
        )
    return decision.headers

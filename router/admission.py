"""SLO-based goodput admission, its state in Redis so that every router replica sees it.

A request is admitted only if the cluster can serve it within its TTFT and TPOT SLOs without
pushing an already admitted request past its own: goodput, the requests per second served
within both SLOs, is what DistServe (Zhong et al., OSDI 2024) optimises. One Lua script
reads, decides and reserves atomically, so routers sharing one Redis never over-admit.

Keys, all under ``pdserve:{cluster}:``, all with a TTL::

    adm:prefill:{worker}  HASH  attempt_id -> "deadline_ms:prefill_s"
                                prefill seconds reserved (queued or running) on the worker
    adm:decode:{worker}   HASH  attempt_id -> "deadline_ms:tpot_slo_s:context_tokens"
                                requests admitted to the worker's decode batch
    slo:{bucket_start}    HASH  finished, met_ttft, met_tpot, met_both, rejected
                                outcomes in the 10-s window from bucket_start (Unix seconds)

    try_admit ──ADMIT_LUA: purge expired, sum, decide, HSET both──► adm:prefill:P + adm:decode:D
    prefill answered ──────release_prefill──► HDEL adm:prefill:P
    request ended (any way) ─release_decode──► HDEL adm:decode:D
    request ended ─────────record_outcome───► HINCRBY slo:{bucket}

Reservations are keyed by the router's attempt id (:mod:`router.recovery`; only a request's first
attempt is admitted). Deadlines are Redis server time (``TIME``), so router clocks do not matter.
A reservation whose router crashed lapses at its deadline: the next script run on that key purges
it, and the key expires after its latest deadline.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

# Decide and reserve, atomically.
# KEYS[1] adm:prefill:{P}  KEYS[2] adm:decode:{D}
# ARGV[1] attempt_id  [2] prefill_s  [3] ttft_slo_s  [4] a (s)  [5] b (s/request)  [6] c (s/token)
#     [7] context_tokens  [8] tpot_slo_s  [9] prefill_ttl_ms  [10] decode_ttl_ms  [11] tpot_retry_s
# Returns {admitted 0/1, reason, ttft_s, tpot_s, retry_after_s (-1: retrying cannot help)};
# floats as strings (a Lua number reply would be truncated to an integer). Every argument is checked
# before anything is written (reason 'invalid_argument', nothing purged or reserved): Redis does not roll
# back a script that fails midway, so a TTL that PEXPIRE refuses must never get that far.
ADMIT_LUA = """
local function finite(x) return x ~= nil and x == x and x > -math.huge and x < math.huge end
local v = {}
for i = 2, 11 do
  v[i] = tonumber(ARGV[i])
  if not finite(v[i]) or v[i] < 0 then return {0, 'invalid_argument', '0', '0', '-1'} end
end
if v[3] <= 0 or v[8] <= 0 or v[7] ~= math.floor(v[7]) then return {0, 'invalid_argument', '0', '0', '-1'} end
for _, i in ipairs({9, 10}) do  -- TTLs: whole milliseconds in [1, MAX_TTL_S * 1000]
  if v[i] < 1 or v[i] > 86400000 or v[i] ~= math.floor(v[i]) then return {0, 'invalid_argument', '0', '0', '-1'} end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rid = ARGV[1]

-- Live entries of a reservation hash, as number arrays. Expired ones are deleted; this
-- request's own (a repeated try_admit) is skipped so that it is not counted twice.
local function live(key)
  local out, kv = {}, redis.call('HGETALL', key)
  for i = 1, #kv, 2 do
    local f = {}
    for x in string.gmatch(kv[i + 1], '[^:]+') do f[#f + 1] = tonumber(x) end
    if not f[1] or f[1] <= now then redis.call('HDEL', key, kv[i])
    elseif kv[i] ~= rid then out[#out + 1] = f end
  end
  return out
end

local prefill_s, ttft_slo = tonumber(ARGV[2]), tonumber(ARGV[3])
local a, b, c, ctx = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local tpot_slo, tpot_retry = tonumber(ARGV[8]), tonumber(ARGV[11])

-- TTFT: the prefill work reserved ahead of this request, then its own.
local queued = 0
for _, f in ipairs(live(KEYS[1])) do queued = queued + (f[2] or 0) end
local ttft = queued + prefill_s

-- TPOT with one more request in the batch; every admitted request must still meet its SLO.
local n, ctx_sum, tightest = 0, 0, math.huge
for _, f in ipairs(live(KEYS[2])) do
  n = n + 1
  ctx_sum = ctx_sum + (f[3] or 0)
  if f[2] and f[2] < tightest then tightest = f[2] end
end
local tpot = a + b * (n + 1) + c * (ctx_sum + ctx)

local reason, retry = 'admitted', 0
if prefill_s > ttft_slo then reason, retry = 'ttft_infeasible', -1
elseif ttft > ttft_slo then reason, retry = 'ttft_slo', math.max(ttft - ttft_slo, 0.001)  -- until it drains
elseif a + b + c * ctx > tpot_slo then reason, retry = 'tpot_infeasible', -1
elseif tpot > tpot_slo then reason, retry = 'tpot_slo', tpot_retry
elseif tpot > tightest then reason, retry = 'tpot_slo_admitted', tpot_retry end

local function reserve(key, ttl, value)
  ttl = tonumber(ttl)
  redis.call('HSET', key, rid, string.format('%.0f', now + ttl) .. ':' .. value)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end  -- key outlives entries
end
if reason == 'admitted' then
  reserve(KEYS[1], ARGV[9], ARGV[2])
  reserve(KEYS[2], ARGV[10], ARGV[8] .. ':' .. ARGV[7])
end
local function s(x) return string.format('%.17g', x) end
return {reason == 'admitted' and 1 or 0, reason, s(ttft), s(tpot), s(retry)}
"""

MAX_TTL_S = 86_400
"""The longest reservation lifetime :data:`ADMIT_LUA` accepts (seconds; it refuses longer ones)."""
MAX_DECODE_TTL_S = 3600.0
"""Default cap of a decode reservation's lifetime (seconds), whatever the request's SLOs ask: a request
decoding for longer is no longer counted in its worker's batch after it (it lapses; nothing breaks)."""

_COUNTERS = ("finished", "met_ttft", "met_tpot", "met_both", "rejected", "rejected_ttft", "rejected_tpot")


class TpotParams(NamedTuple):
    """The decode step-time model and the request's context, for the TPOT rule:
    ``tpot = a + b * batch_size + c * context_tokens`` (seconds); ``(a, b, c)`` from
    ``StepTimeModel.coefficients()``. ``context_tokens``: the request's expected context while
    decoding (e.g. prompt + max_tokens / 2; prompt + max_tokens for the worst case)."""

    a: float
    b: float
    c: float
    context_tokens: int


@dataclass(frozen=True)
class Decision:
    """Outcome of ``try_admit``.

    Attributes:
        admitted: both reservations were taken.
        reason: ``admitted``, ``ttft_slo`` (prefill queue too long), ``ttft_infeasible`` (its
            own prefill exceeds the SLO), ``tpot_slo`` (its own TPOT SLO would be missed),
            ``tpot_slo_admitted`` (an admitted request's SLO would be missed), ``tpot_infeasible``
            (missed even alone on the worker).
        predicted_ttft_s: reserved prefill seconds on the worker + this request's (seconds).
        predicted_tpot_s: the decode worker's step time with this request added (seconds).
        retry_after_s: 0 if admitted; seconds until retrying may succeed; None if it cannot.
    """

    admitted: bool
    reason: str
    predicted_ttft_s: float
    predicted_tpot_s: float
    retry_after_s: float | None


def _s(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


class Admission:
    """Goodput admission shared by all routers of ``cluster`` through Redis (asyncio).

    Args:
        redis_url_or_client: a URL (the client is owned and closed by ``aclose``) or a
            ``redis.asyncio.Redis``.
        cluster: namespace, as in the registry.
        reservation_ttl_s: lifetime of a prefill reservation (seconds): longer than any queue +
            prefill, short enough that a crashed router's reservations lapse soon.
        decode_ttl_s: default lifetime of a decode reservation (seconds): longer than a request's
            whole decode (``try_admit`` takes a per-request value).
        max_decode_ttl_s: cap of any decode reservation's lifetime (seconds), whatever ``try_admit`` is asked.
        tpot_retry_s: retry hint of TPOT rejections (seconds).
        slo_bucket_s / slo_retention_s: attainment window granularity and lifetime (seconds).
    """

    def __init__(self, redis_url_or_client: str | aioredis.Redis, cluster: str, reservation_ttl_s: float = 30.0,
                 decode_ttl_s: float = 600.0, tpot_retry_s: float = 0.5, slo_bucket_s: int = 10,
                 slo_retention_s: int = 3600, max_decode_ttl_s: float = MAX_DECODE_TTL_S) -> None:
        times = (reservation_ttl_s, decode_ttl_s, tpot_retry_s, slo_bucket_s, slo_retention_s, max_decode_ttl_s)
        if not all(math.isfinite(x) and x > 0 for x in times):
            raise ValueError("TTLs, retry hint and SLO buckets must be finite and positive")
        if max(reservation_ttl_s, max_decode_ttl_s) > MAX_TTL_S:
            raise ValueError(f"reservation lifetimes must be at most {MAX_TTL_S} s")
        self._owned = isinstance(redis_url_or_client, str)
        self._redis = (aioredis.Redis.from_url(redis_url_or_client, socket_timeout=2.0) if self._owned
                       else redis_url_or_client)
        self._prefix = f"pdserve:{cluster}:"
        self._prefill_ttl_ms, self._decode_ttl_ms = _ms(reservation_ttl_s), _ms(min(decode_ttl_s, max_decode_ttl_s))
        self._max_decode_ttl_s = max_decode_ttl_s
        self._tpot_retry_s, self._bucket_s, self._retention_s = tpot_retry_s, int(slo_bucket_s), int(slo_retention_s)
        self._admit = self._redis.register_script(ADMIT_LUA)  # EVALSHA, reloaded on NOSCRIPT

    def prefill_key(self, worker: str) -> str:
        return f"{self._prefix}adm:prefill:{worker}"

    def decode_key(self, worker: str) -> str:
        return f"{self._prefix}adm:decode:{worker}"

    def slo_key(self, bucket_start: int) -> str:
        return f"{self._prefix}slo:{bucket_start}"

    async def try_admit(self, attempt_id: str, prefill_worker: str, prefill_seconds: float, ttft_slo_s: float,
                        decode_worker: str, tpot_params: TpotParams | tuple[float, float, float, int],
                        tpot_slo_s: float, decode_ttl_s: float | None = None) -> Decision:
        """Admit the request and reserve ``prefill_seconds`` on ``prefill_worker`` and a batch slot
        on ``decode_worker``, or reject it and reserve nothing; one atomic script (see module doc).

        Args:
            prefill_seconds: predicted prefill time of this request there (seconds), e.g. uncached
                blocks * ``PrefillStats.seconds_per_block`` (+ any fixed overhead to budget).
            ttft_slo_s / tpot_slo_s: the request's SLOs (seconds).
            tpot_params: ``(a, b, c, context_tokens)``, see ``TpotParams``.
            decode_ttl_s: this request's decode reservation lifetime (default: the constructor's), capped at
                ``max_decode_ttl_s``.

        Raises:
            ValueError: a time, coefficient or SLO that is not finite, negative times or context,
                non-positive SLOs or ``decode_ttl_s`` (checked here, and again by the script before it
                writes anything).
            redis.RedisError: Redis is unreachable or failed the script; this request's entries, should
                the script have written any, are deleted first (best effort: they lapse at their TTL).
        """
        a, b, c, ctx = tpot_params
        values = (prefill_seconds, ttft_slo_s, tpot_slo_s, a, b, c, ctx)
        if not all(math.isfinite(x) for x in values) or decode_ttl_s is not None and not math.isfinite(decode_ttl_s):
            raise ValueError("admission times, coefficients, SLOs and TTLs must be finite")
        if prefill_seconds < 0 or ctx < 0 or ttft_slo_s <= 0 or tpot_slo_s <= 0 or min(a, b, c) < 0:
            raise ValueError("times, coefficients and context must be >= 0, SLOs > 0")
        if decode_ttl_s is not None and decode_ttl_s <= 0:
            raise ValueError(f"decode_ttl_s must be positive, got {decode_ttl_s}")
        ttl_ms = self._decode_ttl_ms if decode_ttl_s is None else _ms(min(decode_ttl_s, self._max_decode_ttl_s))
        keys = [self.prefill_key(prefill_worker), self.decode_key(decode_worker)]
        try:
            ok, reason, ttft, tpot, retry = await self._admit(
                keys=keys,
                args=[attempt_id, repr(float(prefill_seconds)), repr(float(ttft_slo_s)), repr(float(a)),
                      repr(float(b)), repr(float(c)), int(ctx), repr(float(tpot_slo_s)), self._prefill_ttl_ms, ttl_ms,
                      repr(float(self._tpot_retry_s))])
        except RedisError:
            await self._forget(attempt_id, keys)  # a script failing midway keeps what it wrote
            raise
        if _s(reason) == "invalid_argument":
            raise ValueError("the admission script refused its arguments (nothing was reserved)")
        retry_s = float(_s(retry))
        return Decision(bool(int(ok)), _s(reason), float(_s(ttft)), float(_s(tpot)), None if retry_s < 0 else retry_s)

    async def _forget(self, attempt_id: str, keys: list[str]) -> None:
        """Delete ``attempt_id``'s entries from ``keys``, best effort (a failure is logged: they lapse)."""
        try:
            async with self._redis.pipeline(transaction=False) as p:
                for key in keys:
                    p.hdel(key, attempt_id)
                await p.execute()
        except RedisError as exc:
            log.warning("admission: could not delete the entries of %s after an error (they lapse): %s",
                        attempt_id, type(exc).__name__)

    async def release_prefill(self, attempt_id: str, prefill_worker: str) -> None:
        """The prefill answered (or failed): its work is no longer queued. Idempotent."""
        await self._redis.hdel(self.prefill_key(prefill_worker), attempt_id)

    async def release_decode(self, attempt_id: str, decode_worker: str) -> None:
        """The request ended, however it ended: it leaves the decode batch. Idempotent."""
        await self._redis.hdel(self.decode_key(decode_worker), attempt_id)

    async def load(self, prefill_worker: str, decode_worker: str) -> dict:
        """Live (unexpired) reservations: ``prefill_reserved_s`` (seconds) on the prefill worker;
        ``decode_requests``, ``decode_context_tokens`` and ``decode_tightest_tpot_slo_s`` (None
        if no request) on the decode worker. Read-only."""
        async with self._redis.pipeline(transaction=True) as p:
            p.time()
            p.hgetall(self.prefill_key(prefill_worker))
            p.hgetall(self.decode_key(decode_worker))
            (sec, usec), pre, dec = await p.execute()
        now_ms = sec * 1000 + usec // 1000

        def live(h: dict) -> list[list[float]]:
            rows = [[float(x) for x in _s(v).split(":")] for v in h.values()]
            return [r for r in rows if r[0] > now_ms]

        d = live(dec)
        return {"prefill_reserved_s": sum(r[1] for r in live(pre)), "decode_requests": len(d),
                "decode_context_tokens": int(sum(r[2] for r in d)),
                "decode_tightest_tpot_slo_s": min((r[1] for r in d), default=None)}

    # ---- SLO attainment ----------------------------------------------------------------
    def _bucket(self, now: float | None) -> int:
        now = time.time() if now is None else now
        return int(now // self._bucket_s) * self._bucket_s

    async def _incr(self, fields: list[str], now: float | None) -> None:
        key = self.slo_key(self._bucket(now))
        async with self._redis.pipeline(transaction=True) as p:
            for f in fields:
                p.hincrby(key, f, 1)
            p.expire(key, self._retention_s)
            await p.execute()

    async def record_outcome(self, ttft_s: float | None, tpot_s: float | None, ttft_slo_s: float,
                             tpot_slo_s: float, now: float | None = None) -> None:
        """Count one finished request of the window containing ``now`` (Unix seconds; default: now).
        ``ttft_s`` / ``tpot_s`` in seconds; None (e.g. the request failed first) misses that SLO.
        A single-token request has TPOT 0 (met)."""
        met_ttft = ttft_s is not None and ttft_s <= ttft_slo_s
        met_tpot = tpot_s is not None and tpot_s <= tpot_slo_s
        met = {"met_ttft": met_ttft, "met_tpot": met_tpot, "met_both": met_ttft and met_tpot}
        fields = ["finished"] + [f for f, ok in met.items() if ok]
        await self._incr(fields, now)

    async def record_rejection(self, now: float | None = None, reason: str = "") -> None:
        """Count one request that admission rejected (it counts against ``attainment_offered``), and
        by cause when ``reason`` (a :class:`Decision` reason) names the TTFT or the TPOT SLO."""
        cause = [f"rejected_{reason[:4]}"] if reason[:4] in ("ttft", "tpot") else []
        await self._incr(["rejected", *cause], now)

    async def attainment(self, window_s: float = 60, now: float | None = None) -> dict:
        """Sums over the last ``ceil(window_s / slo_bucket_s)`` buckets, the current (partial) one
        included: the counters, and fractions of finished requests that met the TTFT SLO
        (``attainment_ttft``), the TPOT SLO (``attainment_tpot``), both (``attainment_both``),
        and both over finished + rejected (``attainment_offered``). Fractions are None without data."""
        last = self._bucket(now)
        keys = [self.slo_key(last - i * self._bucket_s) for i in range(max(1, math.ceil(window_s / self._bucket_s)))]
        async with self._redis.pipeline(transaction=False) as p:
            for k in keys:
                p.hgetall(k)
            rows = await p.execute()
        out: dict = {f: sum(int(r.get(f.encode(), r.get(f, 0))) for r in rows) for f in _COUNTERS}
        fin, offered = out["finished"], out["finished"] + out["rejected"]
        for name in ("ttft", "tpot", "both"):
            out[f"attainment_{name}"] = out[f"met_{name}"] / fin if fin else None
        out["attainment_offered"] = out["met_both"] / offered if offered else None
        out["window_s"] = len(keys) * self._bucket_s
        return out

    async def aclose(self) -> None:
        """Close the Redis client if this object created it."""
        if self._owned:
            await self._redis.aclose()


def _ms(seconds: float) -> int:
    return max(1, int(round(seconds * 1000)))

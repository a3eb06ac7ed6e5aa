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

import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import redis.asyncio as aioredis

# Decide and reserve, atomically.
# KEYS[1] adm:prefill:{P}  KEYS[2] adm:decode:{D}
# ARGV[1] attempt_id  [2] prefill_s  [3] ttft_slo_s  [4] a (s)  [5] b (s/request)  [6] c (s/token)
#     [7] context_tokens  [8] tpot_slo_s  [9] prefill_ttl_ms  [10] decode_ttl_ms  [11] tpot_retry_s
# Returns {admitted 0/1, reason, ttft_s, tpot_s, retry_after_s (-1: retrying cannot help)};
# floats as strings (a Lua number reply would be truncated to an integer).
ADMIT_LUA = """
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
        tpot_retry_s: retry hint of TPOT rejections (seconds).
        slo_bucket_s / slo_retention_s: attainment window granularity and lifetime (seconds).
    """

    def __init__(self, redis_url_or_client: str | aioredis.Redis, cluster: str, reservation_ttl_s: float = 30.0,
                 decode_ttl_s: float = 600.0, tpot_retry_s: float = 0.5, slo_bucket_s: int = 10,
                 slo_retention_s: int = 3600) -> None:
        if min(reservation_ttl_s, decode_ttl_s, tpot_retry_s, slo_bucket_s, slo_retention_s) <= 0:
            raise ValueError("TTLs, retry hint and SLO buckets must be positive")
        self._owned = isinstance(redis_url_or_client, str)
        self._redis = (aioredis.Redis.from_url(redis_url_or_client, socket_timeout=2.0) if self._owned
                       else redis_url_or_client)
        self._prefix = f"pdserve:{cluster}:"
        self._prefill_ttl_ms, self._decode_ttl_ms = _ms(reservation_ttl_s), _ms(decode_ttl_s)
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
            decode_ttl_s: this request's decode reservation lifetime (default: the constructor's).

        Raises:
            ValueError: negative times or context, non-positive SLOs.
            redis.RedisError: Redis is unreachable.
        """
        a, b, c, ctx = tpot_params
        if prefill_seconds < 0 or ctx < 0 or ttft_slo_s <= 0 or tpot_slo_s <= 0 or min(a, b, c) < 0:
            raise ValueError("times, coefficients and context must be >= 0, SLOs > 0")
        ttl_ms = _ms(decode_ttl_s) if decode_ttl_s else self._decode_ttl_ms
        ok, reason, ttft, tpot, retry = await self._admit(
            keys=[self.prefill_key(prefill_worker), self.decode_key(decode_worker)],
            args=[attempt_id, repr(float(prefill_seconds)), repr(float(ttft_slo_s)), repr(float(a)), repr(float(b)),
                  repr(float(c)), int(ctx), repr(float(tpot_slo_s)), self._prefill_ttl_ms, ttl_ms,
                  repr(float(self._tpot_retry_s))])
        retry_s = float(_s(retry))
        return Decision(bool(int(ok)), _s(reason), float(_s(ttft)), float(_s(tpot)), None if retry_s < 0 else retry_s)

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

"""Soak in CI: 500 concurrent streaming clients against a real router + prefill + decode worker
on the embedded model for 45 seconds (``bench/soak.py``; the benchmark runs it for 5 minutes).

Asserts zero errors of any kind, RSS growth of the router and of each worker under 5% or under
10 MiB (whichever is larger) at rest, and every KV pool free at the end. At rest: the warm-up and
the measured load run as two phases, and each process's RSS is read once every request of a phase
has finished and every pool is free (``bench/soak.py``). A leak keeps its memory at rest; in-flight
work does not. A router that leaks 8 KiB a request (a bytearray kept per Generate call) grew 39.9%
at rest in this test's 45 seconds (6,339 requests) and fails it, as on a CPU half as fast (~3,200
requests, ~+23 MiB) it would; without the leak the router read -1.0% to +5.1% at rest over seven
runs on the same machine (at most 5.8 MiB, 2026-12-02).

Until 2026-12-02 the check was on the high-water mark under load, 5 s after the warm-up against
the last 5 s (reported now, not asserted). A torch-free router's RSS under this load is mostly its
in-flight gRPC buffers and swings by ~20 MiB within seconds at constant load (117-136 MiB on a
Zen 5), so its high-water growth ran from -10.2 to +12.8 MiB over nine soaks on a Xeon 207 and read
+23.1 MiB (124.2 -> 147.3) in one CI run on a Zen 5 with no leak: the floor had been raised from
5% to 10 MiB and to 20 MiB for that noise. At rest the same router read 113.7, 116.1 and 112.5 MiB
after a warm-up and two 35-second phases of ~4,600 requests each.

The warm-up (10 s at full concurrency) is what makes the check mean something: by its end
all 500 clients have had requests in flight (peak KV blocks touched, peak gRPC buffers), every
decode batch size up to ``max_batch_size`` has run, and every prompt of the fixed set of 100 has
been sent (about 700 requests complete in 10 s here, against ~460 needed to draw all 100), so the
prefill worker's prefix cache and the router's prefix index have reached their final size.
What grows after that is growth, not the first use of a bounded structure.
"""

from __future__ import annotations

import pytest

from pdserve.bench.soak import soak

pytestmark = pytest.mark.timeout(400)

CLIENTS, DURATION_S, WARMUP_S = 500, 45.0, 10.0
MAX_GROWTH_PCT, MAX_GROWTH_MIB = 5.0, 10.0


def test_500_clients_for_45_seconds_zero_errors_flat_rss_pools_free(redis_url, model_dir):
    result = soak(model_dir, redis_url, clients=CLIENTS, duration_s=DURATION_S, warmup_s=WARMUP_S,
                  client_procs=4, num_prompts=100)
    print(f"\nsoak: {result['requests']} requests, {result['statuses']}, {result['tokens_per_s']:.0f} tokens/s, "
          f"TTFT p50/p99 {result['ttft_s']['p50']:.3f}/{result['ttft_s']['p99']:.3f} s, "
          f"RSS growth at rest % {({k: round(v['rest_growth_pct'], 2) for k, v in result['rss'].items()})}, "
          f"under load (high-water) % {({k: round(v['growth_pct'], 2) for k, v in result['rss'].items()})}")
    assert result["errors"] == 0, (result["statuses"], result["error_examples"])
    assert set(result["statuses"]) == {"OK"}
    assert result["requests"] >= CLIENTS  # every client finished at least one request
    assert result["measured_requests"] > 0 and result["tokens_per_s"] > 0
    assert set(result["rss"]) == {"router", "prefill", "decode"}
    for name, rss in result["rss"].items():
        assert rss["rest_growth_pct"] < MAX_GROWTH_PCT or rss["rest_growth_mib"] < MAX_GROWTH_MIB, (name, rss)
    assert all(free == total > 0 for free, total in result["pools_at_end"].values()), result["pools_at_end"]

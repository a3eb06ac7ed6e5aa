"""Chaos: a decode worker that stops taking KV pages (SIGSTOP: its kernel still accepts the connection and
the bytes, nothing acknowledges) while the prefill worker has transfers queued for it and for a healthy
decode worker.

Cluster: 1 prefill (p0) + 2 decode workers (d0, d1). p0 is stopped while ``NUM_REQUESTS`` greedy requests
are dispatched, so that its transfers queue up for both decode workers; then d0 is stopped and p0
resumed. Contract: the requests placed on d1 complete at their first dispatch (no retry) while d0 is
still stopped, because each destination's transfers run on a lane of their own
(:mod:`prefill_worker.sender`); with one sender thread they had waited behind d0's acknowledgement
timeouts until d1 gave them up and the router retried them. The requests placed on d0 fail over to d1;
after SIGCONT every worker serves again and every KV pool ends fully free.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from pdserve.deploy import client
from tests.clusters import Cluster

pytestmark = pytest.mark.timeout(180)

NUM_REQUESTS = 6
PROMPT = "Once upon a time, there was a little dog"


@pytest.fixture
def cluster(model_dir, redis_url):
    c = Cluster(model_dir, redis_url, num_prefill=1, num_decode=2)
    yield c
    for p in c.workers:                      # whatever the test did, nothing stays stopped
        try:
            os.kill(p.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    c.stop()


def inflight(state, worker_id: str) -> int:
    return next(w.num_router_inflight for w in state.workers if w.worker_id == worker_id)


def test_a_stalled_receiver_holds_up_only_its_own_transfers(cluster):
    cluster.complete(PROMPT, max_tokens=4, temperature=0)           # every worker warm
    p0, d0 = cluster.worker("p0"), cluster.worker("d0")

    async def go(ch):
        os.kill(p0.proc.pid, signal.SIGSTOP)                          # transfers queue up at p0

        async def one(i: int):
            request = client.make_request(f"{PROMPT} {i}", max_tokens=8, temperature=0)
            return await client.complete(ch, request, timeout_s=120)

        tasks = [asyncio.create_task(one(i)) for i in range(NUM_REQUESTS)]
        deadline = time.monotonic() + 20
        while True:                                                   # every request placed, on both
            state = await client.cluster_state(ch)
            on_d0, on_d1 = inflight(state, "d0"), inflight(state, "d1")
            if on_d0 + on_d1 == NUM_REQUESTS and on_d0 and on_d1:
                break
            assert time.monotonic() < deadline, f"requests never spread over both decode workers: {on_d0}, {on_d1}"
            await asyncio.sleep(0.02)
        os.kill(d0.proc.pid, signal.SIGSTOP)
        os.kill(p0.proc.pid, signal.SIGCONT)
        first_try = []
        for done in asyncio.as_completed(tasks):                      # d1's, while d0 stays stopped
            result = await done
            if result.final.num_retries == 0:
                first_try.append(result)
            if len(first_try) == on_d1:
                break
        assert len(first_try) == on_d1, f"only {len(first_try)} of d1's {on_d1} requests served at first try"
        os.kill(d0.proc.pid, signal.SIGCONT)
        rest = await asyncio.gather(*tasks, return_exceptions=True)  # d0's: retried on d1, or d0 woke
        failed = [r for r in rest if isinstance(r, grpc.aio.AioRpcError)]
        assert not failed, [f"{e.code().name}: {e.details()}" for e in failed]

    cluster.run(go)
    cluster.wait_workers({"p0", "d0", "d1"}, timeout_s=30)
    cluster.assert_pools_free(timeout_s=30)
    assert cluster.complete(PROMPT, max_tokens=4, temperature=0).text

"""A decode worker that gives a request up while the prefill worker still works on it (its KV wait timed
out) ends the router's attempt at once, blamed on the decode worker, with the prefill call cancelled:
the router had waited for the prefill worker's answer, up to ``prefill_timeout_s``, and then blamed the
prefill worker, whose transfer the decode worker refused."""

from __future__ import annotations

import time

import grpc
import pytest

from tests.clusters import Cluster

HOLD_S = 40.0  # the prefill worker holds each transfer open this long before its done frame


@pytest.fixture
def held_cluster(redis_url, model_dir):
    c = Cluster(model_dir, redis_url, num_prefill=1, num_decode=1,
                worker_flags_by_name={"p0": {"fault_hold_transfer_s": HOLD_S}},
                router_flags={"kv_timeout_s": 1.5, "max_attempts": 2})
    yield c
    c.stop()


def test_decode_giving_up_ends_the_attempt_before_the_prefill_answers(held_cluster):
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        held_cluster.complete("Once upon a time", max_tokens=4, temperature=0)
    elapsed = time.monotonic() - started
    err = info.value
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert "decode worker d0 gave the request up before the prefill worker p0 answered" in err.details(), \
        err.details()
    assert "KV" in err.details(), err.details()                # the decode worker's own reason
    assert elapsed < HOLD_S / 2, f"the router waited {elapsed:.1f} s, as if for the prefill worker's answer"
    deadline = time.monotonic() + 10                            # the decode worker freed the blocks it held
    while True:
        d0 = next(w for w in held_cluster.state().workers if w.worker_id == "d0")
        if d0.num_free_blocks == d0.num_total_blocks:
            break
        assert time.monotonic() < deadline, (d0.num_free_blocks, d0.num_total_blocks)
        time.sleep(0.2)

"""The router's stall rule on a decode stream (router/stall.py) and gRPC keepalive wiring, in process.

Rule: after a request's first token, a decode stream fails (WorkerFailure, so the request migrates)
once ``stream_idle_timeout_s`` passed with no event from its worker on this stream nor on any other
stream of the router; before a colocated worker's first token only ``prefill_timeout_s`` bounds the
wait. A worker still streaming other requests is alive: a request waiting for a batch slot there
must not migrate. The real-process version (SIGSTOP) is tests/test_chaos_sigstop.py.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from types import SimpleNamespace

import grpc
import pytest

from pdserve.cluster import service
from pdserve.cluster.registry import WorkerInfo
from pdserve.cluster.service import KEEPALIVE_CHANNEL_OPTIONS, KEEPALIVE_SERVER_OPTIONS
from pdserve.deploy import client
from pdserve.proto import worker_pb2
from pdserve.router import generate
from pdserve.router.config import RouterConfig
from pdserve.router.recovery import WorkerFailure
from pdserve.router.stall import StallWatch, decode_events
from pdserve.router.view import ClusterView

T = 0.3  # stream_idle_timeout_s of these tests


class FakeStream:
    """A decode stream whose events the test pushes; counts the reads started (one at a time)."""

    def __init__(self) -> None:
        self.events: asyncio.Queue = asyncio.Queue()
        self.num_reads = 0

    async def read(self):
        self.num_reads += 1
        return await self.events.get()


def _tokens(*ids: int) -> worker_pb2.DecodeEvent:
    return worker_pb2.DecodeEvent(tokens=worker_pb2.TokenDelta(token_ids=list(ids)))


def _worker(worker_id: str = "d0") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="decode", address="127.0.0.1:1")


async def _drain(stream: FakeStream, watch: StallWatch, got: list) -> None:
    async for event in decode_events(stream, _worker(watch.worker_id), watch):
        got.append(event)


def test_a_silent_worker_fails_the_stream_after_the_idle_timeout():
    async def go():
        stream, got = FakeStream(), []
        watch = StallWatch({}, "d0", T)
        stream.events.put_nowait(_tokens(5))
        started = time.monotonic()
        with pytest.raises(WorkerFailure) as info:
            await _drain(stream, watch, got)
        return time.monotonic() - started, info.value, got

    elapsed, failure, got = asyncio.run(go())
    assert [list(e.tokens.token_ids) for e in got] == [[5]]
    assert T * 0.9 <= elapsed < T + 0.5, elapsed
    assert failure.worker_ids == {"d0"} and "stalled" in failure.message and "stream_idle_timeout_s" in failure.message


def test_a_stream_waiting_for_a_batch_slot_lives_while_its_worker_streams_others():
    """Silent for 4 T on its own stream, but the worker answers the router's other stream every T / 3:
    no failure, the same read is kept (a cancelled grpc.aio read would cancel the call), and the
    events that come later are relayed."""
    async def go():
        heard: dict[str, float] = {}
        queued, busy = FakeStream(), FakeStream()
        got_queued, got_busy = [], []
        queued_task = asyncio.create_task(_drain(queued, StallWatch(heard, "d0", T), got_queued))
        busy_task = asyncio.create_task(_drain(busy, StallWatch(heard, "d0", T), got_busy))
        for i in range(12):  # 4 T
            busy.events.put_nowait(_tokens(i))
            await asyncio.sleep(T / 3)
        assert not queued_task.done()
        queued.events.put_nowait(_tokens(7))
        queued.events.put_nowait(grpc.aio.EOF)
        busy.events.put_nowait(grpc.aio.EOF)
        await asyncio.wait_for(asyncio.gather(queued_task, busy_task), 5)
        return queued, got_queued, got_busy

    queued, got_queued, got_busy = asyncio.run(go())
    assert [list(e.tokens.token_ids) for e in got_queued] == [[7]]
    assert len(got_busy) == 12
    assert queued.num_reads == 2  # one read for the token, one for EOF: never re-issued on a timeout


def test_a_colocated_prefill_longer_than_the_idle_timeout_is_not_a_stall():
    """Before its first token a colocated worker prefills: only first_token_s bounds the wait."""
    async def go(first_token_after_s: float):
        stream, got = FakeStream(), []
        watch = StallWatch({}, "c0", T, first_token_s=4 * T)
        task = asyncio.create_task(_drain(stream, watch, got))
        await asyncio.sleep(first_token_after_s)
        stream.events.put_nowait(_tokens(1))
        started = time.monotonic()
        try:
            await asyncio.wait_for(task, 10)
        except WorkerFailure as failure:
            return got, failure, time.monotonic() - started
        raise AssertionError("the stream never failed")

    got, failure, after_token_s = asyncio.run(go(2.5 * T))  # a long prefill, then silence
    assert [list(e.tokens.token_ids) for e in got] == [[1]]
    assert "stalled" in failure.message and after_token_s < T + 0.5  # T applies from the first token on

    async def never():
        watch = StallWatch({}, "c0", T, first_token_s=2 * T)
        with pytest.raises(WorkerFailure) as info:
            await _drain(FakeStream(), watch, [])
        return info.value

    assert "prefill_timeout_s" in asyncio.run(never()).message


def test_heard_is_dropped_once_the_router_has_no_request_on_the_worker():
    view = ClusterView(lambda: [], Counter({"d0": 1}), lambda address: None, heard={"d0": 1.0, "d1": 2.0})
    generate._forget_if_idle(view, "d0")
    generate._forget_if_idle(view, "d1")
    assert view.heard == {"d0": 1.0}
    view.inflight["d0"] -= 1
    generate._forget_if_idle(view, "d0")
    assert view.heard == {}


def test_stream_idle_timeout_is_validated_and_has_an_up_flag(monkeypatch, model_dir):
    with pytest.raises(ValueError, match="stream_idle_timeout_s"):
        RouterConfig(model_dir=model_dir, stream_idle_timeout_s=0)
    assert RouterConfig(model_dir=model_dir).stream_idle_timeout_s == 10.0
    with pytest.raises(ValueError):
        StallWatch({}, "d0", 0)

    from pdserve.deploy import cli, cluster_args, ray_cluster, redis_server

    started = []

    class FakeRay:
        def __init__(self, cfg) -> None:
            self.cfg = cfg
            started.append(cfg)

        def start(self) -> str:
            return "127.0.0.1:1"

    monkeypatch.setattr(ray_cluster, "RayCluster", FakeRay)
    monkeypatch.setattr(redis_server, "ensure_redis", lambda url: None)
    parser = argparse.ArgumentParser()
    cluster_args.add_cluster_args(parser)
    cli._start_cluster(parser.parse_args(["--model", model_dir, "--stream-idle-timeout", "4.5",
                                          "--queue-timeout", "7"]))
    cli._start_cluster(parser.parse_args(["--model", model_dir]))
    assert started[0].router_options["stream_idle_timeout_s"] == 4.5
    assert started[0].router_options["default_queue_timeout_s"] == 7.0
    assert "stream_idle_timeout_s" not in started[1].router_options  # RouterConfig's default
    assert "default_queue_timeout_s" not in started[1].router_options


def test_keepalive_on_every_channel_and_server(monkeypatch):
    """The router's worker channels, the client helper and every role's server carry the keepalive
    options; servers accept pings at the clients' interval."""
    opts = dict(KEEPALIVE_CHANNEL_OPTIONS)
    assert opts["grpc.keepalive_time_ms"] > 0 and opts["grpc.http2.max_pings_without_data"] == 0
    assert opts["grpc.http2.ping_timeout_ms"] == opts["grpc.keepalive_timeout_ms"]  # grpcio times the ack by this
    server_opts = dict(KEEPALIVE_SERVER_OPTIONS)
    assert server_opts["grpc.http2.min_ping_interval_without_data_ms"] < opts["grpc.keepalive_time_ms"]
    assert server_opts["grpc.keepalive_permit_without_calls"] == 1

    channels = []
    monkeypatch.setattr(grpc.aio, "insecure_channel",
                        lambda address, options=None, interceptors=None: channels.append(dict(options or ())))
    from pdserve.router.server import Router

    Router._channel(SimpleNamespace(_channels={}, _worker_auth=None), "127.0.0.1:1")
    client.open_channel("127.0.0.1:1")
    assert len(channels) == 2 and all(ch.items() >= opts.items() for ch in channels)

    servers = []

    class Stop(Exception):
        pass

    def fake_server(options=None, **kw):
        servers.append(dict(options))
        raise Stop

    monkeypatch.setattr(grpc.aio, "server", fake_server)
    with pytest.raises(Stop):
        asyncio.run(service.start_grpc_server("127.0.0.1", 0, lambda s: None, [],
                                              options=[("grpc.keepalive_time_ms", 20_000)]))
    assert servers[0]["grpc.http2.min_ping_interval_without_data_ms"] == 5_000
    assert servers[0]["grpc.keepalive_time_ms"] == 20_000  # a role's own option replaces the default
    assert servers[0]["grpc.so_reuseport"] == 0

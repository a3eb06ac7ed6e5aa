"""The router's in-flight accounting and attempt ids, on fake workers (no processes): every worker
counted while an attempt holds it is uncounted exactly once, however the attempt ends."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from contextlib import aclosing

import grpc
import pytest

from pdserve.cluster.registry import WorkerInfo
from pdserve.model.sampling import SamplingParams
from pdserve.proto import pdserve_pb2, worker_pb2
from pdserve.router.choose import open_decode
from pdserve.router.config import RouterConfig
from pdserve.router.generate import run_generate
from pdserve.router.recovery import GenerateError, Progress
from pdserve.router.request import RequestTimes
from pdserve.router.slo import Slo
from pdserve.router.validation import ValidRequest
from pdserve.router.view import ClusterView

BLOCK = 4


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"fake {code.name}")


class FakeStream:
    """A decode worker's Generate call: ``events`` are returned by ``read()`` in order (an exception is
    raised, ``None`` blocks forever), then EOF."""

    def __init__(self, events: list) -> None:
        self.events, self.cancelled = list(events), False

    async def read(self):
        if not self.events:
            return grpc.aio.EOF
        ev = self.events.pop(0)
        if ev is None:
            await asyncio.Event().wait()
        if isinstance(ev, BaseException):
            raise ev
        return ev

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def done(self) -> bool:
        return self.cancelled or not self.events


class FakeUnary:
    """A prefill worker's Prefill call answering ``outcome`` (raised if an exception)."""

    def __init__(self, outcome) -> None:
        self.outcome, self.cancelled, self.finished = outcome, False, False

    def __await__(self):
        return self._answer().__await__()

    async def _answer(self):
        self.finished = True
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    def done(self) -> bool:
        return self.finished or self.cancelled


class FakeChannels:
    """``channel(address)`` for the view: each call to a worker takes the next scripted call of that address."""

    def __init__(self, script: dict[str, list]) -> None:
        self.script, self.calls = script, []

    def __call__(self, address: str):
        channels = self

        class Channel:
            def unary_stream(self, method, **kw):
                return lambda request, **kw2: channels._next(address, request)

            def unary_unary(self, method, **kw):
                return lambda request, **kw2: channels._next(address, request)

        return Channel()

    def _next(self, address: str, request):
        call = self.script[address].pop(0)
        self.calls.append((address, request, call))
        return call


def _worker(worker_id: str, role: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=worker_id, kv_address=f"{worker_id}:kv",
                      num_total_blocks=64, num_free_blocks=64, block_size=BLOCK)


def _decode_events(tokens: list[int], num_output: int) -> list:
    return [worker_pb2.DecodeEvent(allocated=worker_pb2.Allocated(block_ids=[0, 1], kv_address="kv")),
            worker_pb2.DecodeEvent(tokens=worker_pb2.TokenDelta(token_ids=tokens)),
            worker_pb2.DecodeEvent(finished=worker_pb2.DecodeFinished(
                finish_reason=pdserve_pb2.FINISH_REASON_LENGTH, num_output_tokens=num_output))]


class DigitsTokenizer:
    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def _setup(workers: list[WorkerInfo], script: dict[str, list]) -> tuple[ClusterView, FakeChannels]:
    channels = FakeChannels(script)
    return ClusterView(lambda: workers, Counter(), channels), channels


def _counted(view: ClusterView) -> dict[str, int]:
    """The workers counted in flight (a negative count, a double release, shows too)."""
    return {w: n for w, n in view.inflight.items() if n}


REQ = ValidRequest("client-1", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=3), Slo(1.0, 0.1))
CFG = RouterConfig(model_dir="unused", prefill_timeout_s=5.0)


async def _collect(view: ClusterView, limit: int | None = None) -> list[pdserve_pb2.GenerateResponse]:
    out = []
    async with aclosing(run_generate(view, REQ, DigitsTokenizer(), CFG, RequestTimes())) as messages:
        async for msg in messages:
            out.append(msg)
            if limit is not None and len(out) == limit:
                break  # the client leaves
    return out


def test_a_count_is_given_back_exactly_once():
    view = ClusterView(lambda: [], Counter(), lambda address: None)
    with view.counting("w") as count:
        assert view.inflight["w"] == 1
        count.release()
        count.release()
        assert view.inflight["w"] == 0
    assert view.inflight["w"] == 0


def test_attempt_ids_name_the_request_and_the_attempt():
    progress = Progress(request_uid="abc")
    assert progress.attempt_id == "abc"
    progress.num_retries, progress.num_migrations = 1, 1
    assert progress.attempt_id == "abc-3"


def test_decode_workers_that_refuse_are_uncounted_and_their_calls_cancelled():
    refused, full, taken = FakeStream([_error(grpc.StatusCode.UNAVAILABLE)]), \
        FakeStream([_error(grpc.StatusCode.RESOURCE_EXHAUSTED)]), FakeStream(_decode_events([7], 2))
    view, _ = _setup([_worker("d0", "decode"), _worker("d1", "decode"), _worker("d2", "decode")],
                     {"d0": [refused], "d1": [full], "d2": [taken]})
    decode = asyncio.run(open_decode(view, REQ, "abc", 8, CFG, Progress(),
                                     candidates=[_worker("d0", "decode"), _worker("d1", "decode"),
                                                 _worker("d2", "decode")]))
    assert decode.worker.worker_id == "d2" and list(decode.allocated.block_ids) == [0, 1]
    assert refused.cancelled and full.cancelled and not taken.cancelled
    assert _counted(view) == {"d2": 1}
    decode.count.release()
    assert _counted(view) == {}


def test_a_finished_attempt_gives_both_workers_back():
    prefill = FakeUnary(worker_pb2.PrefillResponse(first_token=6))
    stream = FakeStream(_decode_events([7, 8], 3))
    view, channels = _setup([_worker("p0", "prefill"), _worker("d0", "decode")], {"p0": [prefill], "d0": [stream]})
    out = asyncio.run(_collect(view))
    assert [list(m.token_ids) for m in out[:-1]] == [[6], [7, 8]]
    assert out[-1].final.usage.completion_tokens == 3
    assert _counted(view) == {} and view.stats["p0"].queued_blocks == 0
    assert not stream.cancelled and not prefill.cancelled
    ids = {request.request_id for _, request, _ in channels.calls}
    assert len(ids) == 1 and "client-1" not in ids  # one attempt id for both workers, not the client's id


def test_a_client_that_leaves_mid_stream_cancels_the_decode_call():
    stream = FakeStream(_decode_events([7], 3)[:1] + [None])  # allocates, then never sends a token
    view, _ = _setup([_worker("p0", "prefill"), _worker("d0", "decode")],
                     {"p0": [FakeUnary(worker_pb2.PrefillResponse(first_token=6))], "d0": [stream]})
    out = asyncio.run(_collect(view, limit=1))
    assert list(out[0].token_ids) == [6]
    assert stream.cancelled
    assert _counted(view) == {}


def test_a_failed_prefill_is_retried_under_a_new_attempt_id_and_uncounted():
    first, second = FakeStream(_decode_events([], 0)[:1] + [None]), FakeStream(_decode_events([7, 8], 3))
    view, channels = _setup([_worker("p0", "prefill"), _worker("d0", "decode")],
                            {"p0": [FakeUnary(_error(grpc.StatusCode.UNAVAILABLE)),
                                    FakeUnary(worker_pb2.PrefillResponse(first_token=6))],
                             "d0": [first, second]})
    out = asyncio.run(_collect(view))
    assert out[-1].final.num_retries == 1 and [t for m in out for t in m.token_ids] == [6, 7, 8]
    assert first.cancelled and not second.cancelled
    uid = channels.calls[0][1].request_id
    assert [request.request_id for _, request, _ in channels.calls] == [uid, uid, f"{uid}-2", f"{uid}-2"]
    assert _counted(view) == {} and view.stats["p0"].queued_blocks == 0


def test_a_request_refused_by_the_decode_worker_leaves_nothing_counted():
    view, _ = _setup([_worker("p0", "prefill"), _worker("d0", "decode")],
                     {"p0": [], "d0": [FakeStream([_error(grpc.StatusCode.INVALID_ARGUMENT)])]})
    with pytest.raises(GenerateError) as info:
        asyncio.run(_collect(view))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert _counted(view) == {}


def test_a_request_waiting_for_kv_room_is_counted_on_no_worker():
    """No decode worker has room: the request waits in the router's line holding nothing (before, its prefill
    worker stayed counted in flight the whole wait, steering other requests away from it); once there is room,
    it is served and everything is given back."""
    workers = [_worker("p0", "prefill"), dataclasses.replace(_worker("d0", "decode"), num_free_blocks=0)]
    channels = FakeChannels({"p0": [FakeUnary(worker_pb2.PrefillResponse(first_token=6))],
                             "d0": [FakeStream(_decode_events([7, 8], 3))]})
    view = ClusterView(lambda: workers, Counter(), channels)
    req = dataclasses.replace(REQ, queue_timeout_s=5.0)

    async def main():
        task = asyncio.create_task(_collect_req(view, req))
        while len(view.room) == 0:
            await asyncio.sleep(0)
        await asyncio.sleep(0.1)                       # two of the line's polls: still no room
        assert _counted(view) == {} and channels.calls == []
        workers[1] = _worker("d0", "decode")
        return await asyncio.wait_for(task, 5)
    out = asyncio.run(main())
    assert [t for m in out for t in m.token_ids] == [6, 7, 8]
    assert _counted(view) == {}


async def _collect_req(view: ClusterView, req: ValidRequest) -> list[pdserve_pb2.GenerateResponse]:
    async with aclosing(run_generate(view, req, DigitsTokenizer(), CFG, RequestTimes())) as messages:
        return [msg async for msg in messages]

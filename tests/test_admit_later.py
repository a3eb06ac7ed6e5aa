"""SLO admission's "retry after" through the router's dispatch (router.choose, router.admit), on fake workers and a
fake gate (no processes): the request waits it out of the line for KV room and is then admitted, is refused at
once when its queue timeout cannot cover the wait, and does not hold up a request behind it meanwhile."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from contextlib import aclosing

import grpc
import pytest

from pdserve.model.sampling import SamplingParams
from pdserve.proto import worker_pb2
from pdserve.router.admission import Decision
from pdserve.router.generate import run_generate
from pdserve.router.recovery import GenerateError
from pdserve.router.request import RequestTimes
from pdserve.router.slo import Slo
from pdserve.router.validation import ValidRequest
from pdserve.router.view import ClusterView
from tests.test_router_inflight import (
    CFG,
    DigitsTokenizer,
    FakeChannels,
    FakeStream,
    FakeUnary,
    _decode_events,
    _worker,
)

LATER = Decision(admitted=False, reason="ttft_slo", predicted_ttft_s=2.5, predicted_tpot_s=0.01, retry_after_s=0.2)


class FakeAdmission:
    """The reservations' releases, counted."""

    def __init__(self) -> None:
        self.released = Counter()

    async def release_prefill(self, attempt_id: str, worker_id: str) -> None:
        self.released["prefill"] += 1

    async def release_decode(self, attempt_id: str, worker_id: str) -> None:
        self.released["decode"] += 1


class FakeGate:
    """``SloGate.admit`` answering each request (named in ``later``'s order as their attempt ids first come)
    "later" its first ``later[name]`` times and then with the first decode worker; logs each call by name."""

    def __init__(self, later: dict[str, int]) -> None:
        self.later, self.calls, self.admission, self.names = dict(later), [], FakeAdmission(), {}

    async def admit(self, attempt_id, prefill_worker, prefill_s, decodes, tokens, slo, ttl_s):
        if attempt_id not in self.names:
            self.names[attempt_id] = list(self.later)[len(self.names)]
        name = self.names[attempt_id]
        self.calls.append(name)
        if self.later[name] > 0:
            self.later[name] -= 1
            return None, LATER
        return decodes[0], None


def _request(name: str, queue_timeout_s: float) -> ValidRequest:
    return ValidRequest(name, [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=3), Slo(5.0, 0.1),
                        queue_timeout_s=queue_timeout_s)


def _view(gate: FakeGate, requests: int, workers: list | None = None) -> ClusterView:
    script = {"p0": [FakeUnary(worker_pb2.PrefillResponse(first_token=6)) for _ in range(requests)],
              "d0": [FakeStream(_decode_events([7, 8], 3)) for _ in range(requests)]}
    workers = workers if workers is not None else [_worker("p0", "prefill"), _worker("d0", "decode")]
    return ClusterView(lambda: workers, Counter(), FakeChannels(script), gate=gate)


async def _run(view: ClusterView, req: ValidRequest, done: list[str]) -> list:
    out = []
    async with aclosing(run_generate(view, req, DigitsTokenizer(), dataclasses.replace(CFG), RequestTimes())) as msgs:
        async for msg in msgs:
            out.append(msg)
    done.append(req.request_id)
    return out


def test_a_request_told_to_retry_later_waits_and_is_admitted():
    gate = FakeGate({"a": 1})
    view, done = _view(gate, 1), []
    out = asyncio.run(_run(view, _request("a", 5.0), done))
    assert [t for m in out for t in m.token_ids] == [6, 7, 8]
    assert gate.calls == ["a", "a"] and not view.inflight - Counter()
    assert gate.admission.released == Counter(prefill=1, decode=1)     # the one reservation, given back


def test_a_wait_past_the_queue_timeout_is_refused_at_once_with_the_reason():
    gate = FakeGate({"a": 1})
    view = _view(gate, 1)
    with pytest.raises(GenerateError) as info:
        asyncio.run(_run(view, _request("a", 0.1), []))                 # the retry comes after 0.2 s
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.message == "not admitted: ttft_slo (predicted TTFT 2.500 s, TPOT 0.0100 s); retry after 0.200 s"
    assert gate.calls == ["a"] and not view.inflight - Counter()
    assert gate.admission.released == Counter()                        # nothing was reserved


def test_a_request_waiting_for_admission_does_not_hold_up_the_next():
    """``a`` waits in the line for KV room; once there is room, admission tells it to retry in 0.2 s; ``b``,
    arriving meanwhile, is admitted and served before ``a`` asks again (before, ``a`` waited for admission
    inside its turn at the head of the line, and ``b`` behind it)."""
    gate = FakeGate({"a": 1, "b": 0})
    workers = [_worker("p0", "prefill"), dataclasses.replace(_worker("d0", "decode"), num_free_blocks=0)]
    view, done = _view(gate, 2, workers), []

    async def main():
        first = asyncio.create_task(_run(view, _request("a", 5.0), done))
        while len(view.room) == 0:
            await asyncio.sleep(0)
        workers[1] = _worker("d0", "decode")           # room now: the line's poll lets ``a`` try again
        while gate.calls != ["a"]:
            await asyncio.sleep(0.001)
        await _run(view, _request("b", 5.0), done)
        await first
    asyncio.run(main())
    assert done == ["b", "a"] and gate.calls == ["a", "b", "a"]
    assert not view.inflight - Counter()


def test_a_request_back_from_admissions_wait_keeps_its_place_in_the_line():
    """``a`` is told to retry in 0.2 s; meanwhile the pool fills and ``b`` arrives and waits in the line. Back,
    ``a`` takes its place ahead of ``b`` (it came first) and, once there is room, is served first (before, it
    came back as a new arrival behind ``b``)."""
    gate = FakeGate({"a": 1, "b": 0})
    workers = [_worker("p0", "prefill"), _worker("d0", "decode")]
    view, done = _view(gate, 2, workers), []

    async def main():
        first = asyncio.create_task(_run(view, _request("a", 5.0), done))
        while gate.calls != ["a"]:
            await asyncio.sleep(0.001)
        workers[1] = dataclasses.replace(_worker("d0", "decode"), num_free_blocks=0)   # the pool fills meanwhile
        second = asyncio.create_task(_run(view, _request("b", 5.0), done))
        while len(view.room) < 2:                      # b waiting, then a back in the line
            await asyncio.sleep(0.001)
        workers[1] = _worker("d0", "decode")
        await asyncio.wait_for(asyncio.gather(first, second), 5)
    asyncio.run(main())
    assert done == ["a", "b"] and gate.calls == ["a", "a", "b"]
    assert not view.inflight - Counter()

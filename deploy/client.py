"""A small asyncio client of the router's ``Generate`` and ``GetClusterState`` RPCs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from proto import pdserve_pb2, pdserve_pb2_grpc


@dataclass
class Completion:
    """A finished generation as the client saw it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    final: pdserve_pb2.Final | None = None


def make_request(prompt: str | list[int], *, max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int = 0, seed: int | None = None, ignore_eos: bool = False,
                 stop_token_ids: tuple[int, ...] = ()) -> pdserve_pb2.GenerateRequest:
    """Build a ``GenerateRequest`` from text or token ids (``None`` leaves a field to the server's default)."""
    sampling = pdserve_pb2.SamplingParams(top_k=top_k, ignore_eos=ignore_eos, stop_token_ids=list(stop_token_ids))
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p), ("seed", seed)):
        if value is not None:
            setattr(sampling, name, value)
    if isinstance(prompt, str):
        return pdserve_pb2.GenerateRequest(text=prompt, sampling=sampling)
    return pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=sampling)


async def stream(channel: grpc.aio.Channel, request: pdserve_pb2.GenerateRequest,
                 timeout_s: float | None = None) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
    """Yield the router's messages for one request.

    Raises:
        grpc.aio.AioRpcError: the router ended the stream with an error status.
    """
    async for msg in pdserve_pb2_grpc.RouterStub(channel).Generate(request, timeout=timeout_s):
        yield msg


async def complete(channel: grpc.aio.Channel, request: pdserve_pb2.GenerateRequest,
                   timeout_s: float | None = None) -> Completion:
    """Run one request to the end and gather its text, tokens and final message.

    Raises:
        grpc.aio.AioRpcError: the router ended the stream with an error status.
    """
    out = Completion()
    async for msg in stream(channel, request, timeout_s):
        out.text += msg.text
        out.token_ids.extend(msg.token_ids)
        if msg.HasField("final"):
            out.final = msg.final
    return out


async def cluster_state(channel: grpc.aio.Channel) -> pdserve_pb2.ClusterState:
    """The router's view of the workers."""
    return await pdserve_pb2_grpc.RouterStub(channel).GetClusterState(pdserve_pb2.GetClusterStateRequest())

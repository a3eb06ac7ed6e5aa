"""A small asyncio client of the router's ``Generate`` and ``GetClusterState`` RPCs,
and :func:`open_channel`, which opens a channel that matches the router's security
(plaintext or TLS, with or without a bearer token), with gRPC keepalive."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from pdserve.cluster.grpc_auth import bearer_interceptors
from pdserve.cluster.service import KEEPALIVE_CHANNEL_OPTIONS
from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc

TOKEN_ENV = "PDSERVE_ROUTER_TOKEN"


def read_token(token_file: str | None = None) -> str | None:
    """The router's bearer token: ``token_file``'s content (whitespace stripped), else the
    ``PDSERVE_ROUTER_TOKEN`` variable, else None.

    Raises:
        ValueError: the file cannot be read or is empty.
    """
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"token file {token_file!r} cannot be read: {e}") from None
        if not token:
            raise ValueError(f"token file {token_file!r} is empty")
        return token
    return os.environ.get(TOKEN_ENV, "").strip() or None


def open_channel(address: str, *, tls_ca_file: str | None = None, token: str | None = None,
                 tls_server_name: str | None = None) -> grpc.aio.Channel:
    """An asyncio channel to the router at ``address`` ("host:port"), with gRPC keepalive
    (:data:`cluster.service.KEEPALIVE_CHANNEL_OPTIONS`: a router that stops acking pings fails the
    channel's calls UNAVAILABLE within about 15 s, even a stream that set no deadline).

    Args:
        tls_ca_file: PEM file of the CA that signed the router's certificate: the channel uses
            TLS and verifies the router against it. None: plaintext.
        token: bearer token sent on every call, as call credentials over TLS and as
            ``authorization`` metadata over plaintext (visible on the network: local use only).
        tls_server_name: name to check the certificate against when it differs from the host
            in ``address`` (``grpc.ssl_target_name_override``).
    Raises:
        ValueError: ``tls_ca_file`` cannot be read or holds no PEM certificate.
    """
    if tls_ca_file is None:
        interceptors = bearer_interceptors(token) if token else None
        return grpc.aio.insecure_channel(address, options=KEEPALIVE_CHANNEL_OPTIONS, interceptors=interceptors)
    try:
        with open(tls_ca_file, "rb") as f:
            ca = f.read()
    except OSError as e:
        raise ValueError(f"TLS CA file {tls_ca_file!r} cannot be read: {e.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in ca:
        raise ValueError(f"TLS CA file {tls_ca_file!r} holds no PEM certificate")
    creds = grpc.ssl_channel_credentials(root_certificates=ca)
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    options = [*KEEPALIVE_CHANNEL_OPTIONS, *([("grpc.ssl_target_name_override", tls_server_name)]
                                            if tls_server_name else [])]
    return grpc.aio.secure_channel(address, creds, options=options)


@dataclass
class Completion:
    """A finished generation as the client saw it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    final: pdserve_pb2.Final | None = None


def make_request(prompt: str | list[int], *, max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int = 0, seed: int | None = None, ignore_eos: bool = False,
                 min_p: float | None = None,
                 stop_token_ids: tuple[int, ...] = (), presence_penalty: float | None = None,
                 frequency_penalty: float | None = None, repetition_penalty: float | None = None,
                 min_tokens: int | None = None, logit_bias: dict[int, float] | None = None,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 bad_words: tuple[str, ...] = (), allowed_token_ids: tuple[int, ...] = (),
                 cache_salt: str = "", priority: int = 0) -> pdserve_pb2.GenerateRequest:
    """Build a ``GenerateRequest`` from text or token ids (``None`` leaves a field to the server's default;
    the penalties, ``min_tokens``, ``logit_bias``, ``logprobs``, ``prompt_logprobs``, ``bad_words``,
    ``allowed_token_ids``, ``cache_salt`` and ``priority``: ``proto/pdserve.proto``)."""
    sampling = pdserve_pb2.SamplingParams(top_k=top_k, ignore_eos=ignore_eos, stop_token_ids=list(stop_token_ids),
                                          logit_bias=logit_bias or {}, bad_words=list(bad_words),
                                          allowed_token_ids=list(allowed_token_ids))
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p), ("min_p", min_p),
                        ("seed", seed),
                        ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
                        ("repetition_penalty", repetition_penalty), ("min_tokens", min_tokens),
                        ("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None:
            setattr(sampling, name, value)
    extra = {"cache_salt": cache_salt, "priority": priority}
    if isinstance(prompt, str):
        return pdserve_pb2.GenerateRequest(text=prompt, sampling=sampling, **extra)
    return pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=sampling, **extra)


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

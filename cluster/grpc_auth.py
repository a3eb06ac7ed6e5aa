"""Bearer-token authentication of gRPC calls, both ends (``grpc.aio``).

Server: :class:`BearerTokenInterceptor` ends every call that lacks ``authorization: Bearer
<token>`` metadata with UNAUTHENTICATED before its request is parsed; the health service's unary
``Check`` stays open so load balancers can probe. Its ``Watch`` (a stream held open) needs the token:
open, callers without one could hold every one of the server's ``maximum_concurrent_rpcs`` and lock
out the clients that have it. Client: :func:`bearer_interceptors` add that metadata on
plaintext channels (over TLS, ``grpc.access_token_call_credentials`` does the same).

Used by the router's public API (the client's token, router/server.py), by the router's calls
to workers (a token derived from the cluster secret, :func:`cluster.secret.worker_rpc_token`),
and by ``deploy.client.open_channel``.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence

import grpc

log = logging.getLogger(__name__)

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/Check",)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call without ``authorization: Bearer <token>`` metadata with UNAUTHENTICATED,
    before the request message is even parsed; methods under ``open_prefixes`` stay open.
    ``token`` is the accepted token, or a sequence of them (any one is accepted); each is compared
    in constant time (``hmac.compare_digest``); the scheme name is case-insensitive (RFC 6750)."""

    def __init__(self, token: str | Sequence[str], open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES) -> None:
        self._tokens = [t.encode() for t in ([token] if isinstance(token, str) else token)]
        self._open_prefixes = open_prefixes

    async def intercept_service(self, continuation, handler_call_details):
        """Pass the call on if it is open or carries the token, else answer with a denying handler."""
        method = handler_call_details.method or ""
        if method.startswith(self._open_prefixes):
            return await continuation(handler_call_details)
        error = self._check(handler_call_details.invocation_metadata or ())
        handler = await continuation(handler_call_details)
        if error is None or handler is None:
            return handler
        log.info("%s refused: %s", method, error)
        return _denying_handler(handler, error)

    def _check(self, metadata) -> str | None:
        values = [v for k, v in metadata if k.lower() == "authorization"]
        if not values:
            return "missing 'authorization: Bearer <token>' metadata"
        value = values[-1].encode() if isinstance(values[-1], str) else values[-1]
        scheme, _, token = value.strip().partition(b" ")
        matches = [hmac.compare_digest(token.strip(), t) for t in self._tokens]  # all compared: no early exit
        if scheme.lower() != b"bearer" or not any(matches):
            return "invalid bearer token"
        return None


def _denying_handler(handler: grpc.RpcMethodHandler, error: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as ``handler`` that aborts with UNAUTHENTICATED.
    No request deserializer: an unauthenticated request is never parsed."""
    async def deny(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, error)

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(handler.request_streaming, handler.response_streaming)](deny)


def _with_token(details: grpc.aio.ClientCallDetails, pair: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()), pair)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class _UnaryUnaryBearer(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self._pair = pair

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self._pair), request)


class _UnaryStreamBearer(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, pair: tuple[str, str]) -> None:
        self._pair = pair

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self._pair), request)


def bearer_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Client interceptors that add ``authorization: Bearer <token>`` to every unary-unary and
    unary-stream call (the only kinds pdserve's APIs have), for plaintext channels, where gRPC
    refuses call credentials. One object per call kind: ``grpc.aio`` files an interceptor under
    the first kind it implements only."""
    pair = ("authorization", f"Bearer {token}")
    return [_UnaryUnaryBearer(pair), _UnaryStreamBearer(pair)]

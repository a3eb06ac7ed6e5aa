"""The HTTP API's server: uvicorn, run as a task on the router's own event loop (its signal handlers
left to the router process), started and stopped by :class:`router.server.Router`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from pdserve.cluster.secret import InsecureReminder, check_exposure, is_loopback
from pdserve.model.chat_template import ChatTemplate
from pdserve.model.model_dir import looks_like_repo_id
from pdserve.router.http.app import Backend, make_app

log = logging.getLogger(__name__)

GRACE_S = 1.0  # in-flight HTTP requests get this long at stop, then they are cancelled (as gRPC's grace)


def served_model_name(model_dir: str, served: str = "") -> str:
    """The model's name in the API: ``served`` when given, else the checkpoint directory's name (a hub
    repository id as given)."""
    if served:
        return served
    if looks_like_repo_id(model_dir) and not Path(model_dir).is_dir():
        return model_dir
    return Path(model_dir).resolve().name


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the router process owns SIGINT/SIGTERM
        yield


class HttpFrontEnd:
    """The OpenAI-compatible API of ``backend`` on ``cfg.http_host:cfg.http_port``, over TLS with the
    router's certificate when it has one.

    Raises:
        ValueError: from the constructor, the chat template file cannot be read or does not compile.
        cluster.secret.InsecureBindError: from the constructor, ``http_host`` is not loopback and the
            cluster secret or client authentication is missing, without ``insecure``.
    """

    def __init__(self, backend: Backend, secret: bytes | None) -> None:
        cfg = backend.cfg
        self.cfg, self.backend = cfg, backend
        client_auth = bool(cfg.bearer_tokens()) or cfg.tls_key_pair() is not None
        exposed = check_exposure("the router's HTTP API", cfg.http_host, secret, cfg.insecure, client_auth)
        if exposed:
            InsecureReminder("the router's HTTP API", cfg.http_host, log=log)
        self.model_name = served_model_name(cfg.model_dir, cfg.served_model_name)
        self.chat_template = ChatTemplate.load(cfg.model_dir, cfg.chat_template)
        self.address = ""
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> str:
        """Bind and serve; returns ``host:port`` once connections are accepted.

        Raises:
            RuntimeError: the address could not be bound, or the server failed to start.
        """
        cfg = self.cfg
        if cfg.bearer_tokens() and cfg.tls_key_pair() is None and not is_loopback(cfg.http_host):
            log.warning("router HTTP API: bearer token over plaintext on %s: configure tls_cert_file / "
                        "tls_key_file", cfg.http_host)
        sock = _bind(cfg.http_host, cfg.http_port)
        tls = dict(ssl_certfile=cfg.tls_cert_file, ssl_keyfile=cfg.tls_key_file) if cfg.tls_cert_file else {}
        config = uvicorn.Config(make_app(self.backend, self.model_name, self.chat_template), lifespan="off",
                                log_level="warning", access_log=False, timeout_graceful_shutdown=GRACE_S, **tls)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                sock.close()
                raise RuntimeError(f"the HTTP API did not start: {self._task.exception()!r}")
            await asyncio.sleep(0.01)
        host, port = sock.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return self.address

    async def stop(self) -> None:
        """Stop accepting; requests in flight get :data:`GRACE_S` seconds, then they are cancelled
        (their workers free their blocks)."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, GRACE_S + 5)
        except Exception as exc:  # stuck or failed: cancelled, the router goes on stopping
            log.warning("HTTP API did not stop cleanly: %r", exc)
            self._task.cancel()


def _bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to ``host:port`` (IPv4 or IPv6, as the host resolves)."""
    sock = None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise RuntimeError(f"cannot bind the HTTP API to {host}:{port}: {exc}") from None
    return sock

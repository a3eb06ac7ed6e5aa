"""Configuration of the router process."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pdserve.cluster.worker_process import default_redis_url

TOKEN_ENV = "PDSERVE_ROUTER_TOKEN"
MIN_TOKEN_CHARS = 16


def _read_text(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {path!r} cannot be read: {e}") from None


def check_token(token: str, source: str) -> str:
    """Return ``token`` if it can be a bearer token: at least 16 visible ASCII characters, no spaces.

    Raises:
        ValueError: it cannot; ``source`` names where it came from (never the token).
    """
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{source}: the bearer token must have at least {MIN_TOKEN_CHARS} characters, "
                         f"got {len(token)}")
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError(f"{source}: the bearer token must be visible ASCII without spaces")
    return token


@dataclass(frozen=True)
class RouterConfig:
    """Router settings.

    Attributes:
        model_dir: checkpoint directory (the router reads only its config and tokenizer).
        cluster: registry namespace in Redis.
        redis_url: the registry.
        host, port: where the public gRPC API listens (port 0 = pick a free one).
        registry_poll_s: seconds between registry reads.
        kv_timeout_s: how long a decode worker waits for a request's KV pages.
        prefill_timeout_s: deadline of the prefill RPC (queue + forward + transfer).
        default_max_tokens: ``max_tokens`` when the request leaves it unset.
        prefix_routing: use the prefix index in dispatch (off: cache-blind, least-loaded).
        admission: admit a request only if its TTFT and TPOT SLOs (and those of the requests
            already admitted) are predicted to hold; reservations live in Redis.
        default_ttft_slo_s / default_tpot_slo_s: SLOs of requests that give none.
        spill_queue_s: a prefill worker whose queued work exceeds this many seconds loses
            its cache advantage to the best worker below the bound (hot-prefix guard).
        tls_cert_file / tls_key_file: PEM certificate chain and private key of the public API;
            both set: the API is served over TLS only; both empty: plaintext.
        token_file: file holding the bearer token clients must send (``authorization: Bearer
            <token>``) on every Router RPC; empty: the ``PDSERVE_ROUTER_TOKEN`` variable, and no
            token check when that is unset too. Health checks never need it.
        max_attempts: dispatches per request, the first included, when workers fail under it
            (a retry before the first token was streamed, a migration after; router/recovery.py).
        registry_grace_s: a worker missing from a registry read is kept this long when Redis lost
            it (restarted empty): since its last heartbeat, or since Redis answered again.
        insecure: on a non-loopback ``host``, serve without the cluster secret or without a bearer
            token and TLS instead of refusing to start (logged at start and every minute).
    """

    model_dir: str
    cluster: str = "default"
    redis_url: str = field(default_factory=default_redis_url)
    host: str = "127.0.0.1"
    port: int = 0
    registry_poll_s: float = 0.25
    kv_timeout_s: float = 30.0
    prefill_timeout_s: float = 60.0
    default_max_tokens: int = 16
    spill_queue_s: float = 2.0
    prefix_routing: bool = True
    admission: bool = False
    default_ttft_slo_s: float = 1.0
    default_tpot_slo_s: float = 0.1
    tls_cert_file: str = ""
    tls_key_file: str = ""
    token_file: str = ""
    max_attempts: int = 4
    registry_grace_s: float = 2.0
    insecure: bool = False

    def __post_init__(self) -> None:
        for name in ("registry_poll_s", "kv_timeout_s", "prefill_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.registry_grace_s < 0:
            raise ValueError(f"registry_grace_s must be >= 0, got {self.registry_grace_s}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file must be given together")
        self.tls_key_pair()  # fail at startup, not at the first connection
        self.bearer_token()

    def tls_key_pair(self) -> tuple[bytes, bytes] | None:
        """``(private key PEM, certificate chain PEM)`` for ``grpc.ssl_server_credentials``, or None
        without TLS.

        Raises:
            ValueError: a file cannot be read or holds no PEM block.
        """
        if not self.tls_cert_file:
            return None
        pair = (_read_text(self.tls_key_file, "tls_key_file"), _read_text(self.tls_cert_file, "tls_cert_file"))
        for text, name in zip(pair, ("tls_key_file", "tls_cert_file")):
            if "-----BEGIN " not in text:
                raise ValueError(f"{name} {getattr(self, name)!r} holds no PEM block")
        return pair[0].encode(), pair[1].encode()

    def bearer_token(self) -> str | None:
        """The token clients must present: ``token_file``'s content (whitespace stripped), else
        ``PDSERVE_ROUTER_TOKEN``, else None (no token check).

        Raises:
            ValueError: the file cannot be read, or the token is too short or not visible ASCII.
        """
        if self.token_file:
            return check_token(_read_text(self.token_file, "token_file").strip(), f"token_file {self.token_file!r}")
        token = os.environ.get(TOKEN_ENV, "").strip()
        return check_token(token, TOKEN_ENV) if token else None

"""Configuration of the router process."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from pdserve.cluster.args import check_port, check_redis_url, check_seconds, default_redis_url
from pdserve.cluster.rpc_fields import MAX_KV_TIMEOUT_S
from pdserve.model.config import check_max_model_len
from pdserve.model.reasoning import REASONING_PARSERS
from pdserve.model.tool_calls import TOOL_CALL_PARSERS

TOKEN_ENV = "PDSERVE_ROUTER_TOKEN"
MIN_TOKEN_CHARS = 16
MIB = 1 << 20
RPC_HEADROOM = 64  # concurrent RPCs beyond max_concurrent_streams: GetClusterState, health, reflection

SCHEDULING_POLICIES = ("fcfs", "priority")


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
        prefill_timeout_s: deadline of the prefill RPC (queue + forward + transfer), and of a colocated
            worker's first token.
        stream_idle_timeout_s: a decode worker that has the request's KV (P answered, or the colocated
            worker streamed its first token) and has sent nothing on this stream nor on any other of this
            router's streams for this many seconds is taken as stalled (SIGSTOPped, partitioned, wedged):
            the stream fails like a crash and the request migrates (rule: :mod:`router.stall`). Also
            the longest wait for a decode worker's allocation. Keep it a few seconds above the slowest
            engine step (kernel compilation on a worker's first steps included).
        default_max_tokens: ``max_tokens`` when the request leaves it unset.
        prefix_routing: use the prefix index in dispatch (off: cache-blind, least-loaded).
        admission: admit a request only if its TTFT and TPOT SLOs (and those of the requests
            already admitted) are predicted to hold; reservations live in Redis.
        default_ttft_slo_s / default_tpot_slo_s: SLOs of requests that give none.
        default_queue_timeout_s: ``queue_timeout_s`` of requests that give none: seconds a request waits for a
            decode worker with free KV blocks for it (with ``admission``, to be admitted) before it is refused
            with RESOURCE_EXHAUSTED (HTTP 429), as vLLM's scheduler queues what its KV cache cannot yet hold;
            0: refused at once. The wait holds no block (it holds its stream slot) and ends when the client leaves.
        spill_queue_s: a prefill worker whose queued work exceeds this many seconds loses
            its cache advantage to the best worker below the bound (hot-prefix guard).
        tls_cert_file / tls_key_file: PEM certificate chain and private key of the public API;
            both set: the API is served over TLS only; both empty: plaintext.
        token_file: file holding the bearer token clients must send (``authorization: Bearer
            <token>``) on every Router RPC, or several, one per line (any of them is accepted); empty:
            the ``PDSERVE_ROUTER_TOKEN`` variable, and no token check when that is unset too. Health
            checks never need it.
        max_attempts: dispatches per request, the first included, when workers fail under it
            (a retry before the first token was streamed, a migration after; router/recovery.py).
        registry_grace_s: a worker missing from a registry read is kept this long when Redis lost
            it (restarted empty): since its last heartbeat, or since Redis answered again.
        insecure: on a non-loopback ``host``, serve without the cluster secret or without a bearer
            token and TLS instead of refusing to start (logged at start and every minute).
        max_concurrent_streams: ``Generate`` streams served at once; one more is answered
            RESOURCE_EXHAUSTED naming this limit. The gRPC server's own cap on concurrent RPCs is
            this plus :data:`RPC_HEADROOM` (room for ``GetClusterState``, health and reflection).
        max_streams_per_token: ``Generate`` streams served at once per bearer token presented (each
            token of ``token_file`` has its own quota); 0: no per-token quota. Needs a token.
        max_tokens_limit: the largest ``max_tokens`` a request may ask for (INVALID_ARGUMENT above
            it): bounds the KV blocks one request reserves on a decode worker.
        min_slo_s / max_ttft_slo_s / max_tpot_slo_s: a client's TTFT SLO is clamped into
            [min_slo_s, max_ttft_slo_s] and its TPOT SLO into [min_slo_s, max_tpot_slo_s] (seconds) before
            admission and the SLO attainment counters see them, so no client can make a reservation
            outlive the operator's bounds or skew the autoscaler beyond them; the defaults must lie within.
        max_receive_message_bytes / max_send_message_bytes: largest message the public API reads /
            writes (gRPC answers RESOURCE_EXHAUSTED beyond them); the HTTP API reads request bodies up to
            ``max_receive_message_bytes`` too (413 beyond).
        http_host, http_port: where the OpenAI-compatible HTTP API listens (:mod:`router.http`; port 0 = pick
            a free one; None: no HTTP API). Same bearer tokens and TLS files as the gRPC API.
        served_model_name: the model's name in the HTTP API (empty: the checkpoint directory's name).
        chat_template: a Jinja chat template file for ``/v1/chat/completions`` (empty: the checkpoint's own).
        tool_call_parser: the format the model writes tool calls in (``hermes``, ``llama3_json``, ``granite``,
            ``mistral``, ``pythonic``: :mod:`model.tool_calls`); chat requests with ``tools`` and ``tool_choice``
            ``auto`` get their calls back as OpenAI ``tool_calls`` (empty: no parsing, and such requests are refused).
        reasoning_parser: how the model marks its reasoning (``deepseek_r1``, ``qwen3``: :mod:`model.reasoning`);
            chat answers then carry it apart from their content, as ``reasoning`` (empty: no split).
        scheduling_policy: ``fcfs`` (arrival order; a request's non-zero ``priority`` is refused, as vLLM refuses
            it) or ``priority`` (vLLM's: the workers schedule lower ``priority`` values first).
        max_model_len: the context served, in tokens (vLLM's ``--max-model-len``; 0: the checkpoint's
            ``max_position_embeddings``): requests whose prompt and ``max_tokens`` exceed it are refused here,
            and the HTTP API reports it. The workers are started with the same one.
    """

    model_dir: str
    cluster: str = "default"
    redis_url: str = field(default_factory=default_redis_url)
    host: str = "127.0.0.1"
    port: int = 0
    registry_poll_s: float = 0.25
    kv_timeout_s: float = 30.0
    prefill_timeout_s: float = 60.0
    stream_idle_timeout_s: float = 10.0
    default_max_tokens: int = 16
    spill_queue_s: float = 2.0
    prefix_routing: bool = True
    admission: bool = False
    default_ttft_slo_s: float = 1.0
    default_tpot_slo_s: float = 0.1
    default_queue_timeout_s: float = 0.0
    tls_cert_file: str = ""
    tls_key_file: str = ""
    token_file: str = ""
    max_attempts: int = 4
    registry_grace_s: float = 2.0
    insecure: bool = False
    max_concurrent_streams: int = 1024
    max_streams_per_token: int = 0
    max_tokens_limit: int = 4096
    min_slo_s: float = 1e-4
    max_ttft_slo_s: float = 600.0
    max_tpot_slo_s: float = 60.0
    max_receive_message_bytes: int = 4 * MIB
    max_send_message_bytes: int = 4 * MIB
    http_host: str = "127.0.0.1"
    http_port: int | None = None
    served_model_name: str = ""
    chat_template: str = ""
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    scheduling_policy: str = "fcfs"
    max_model_len: int = 0

    def __post_init__(self) -> None:
        for name in ("registry_poll_s", "prefill_timeout_s", "stream_idle_timeout_s"):
            check_seconds(name, getattr(self, name))
        check_seconds("kv_timeout_s", self.kv_timeout_s, high=MAX_KV_TIMEOUT_S)   # the decode worker's bound too
        check_port("port", self.port)
        check_redis_url("redis_url", self.redis_url)
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        check_seconds("registry_grace_s", self.registry_grace_s, zero_ok=True)
        check_seconds("default_queue_timeout_s", self.default_queue_timeout_s, zero_ok=True)
        for name in ("max_concurrent_streams", "max_tokens_limit", "max_receive_message_bytes",
                     "max_send_message_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_streams_per_token < 0:
            raise ValueError(f"max_streams_per_token must be >= 0 (0: no quota), got {self.max_streams_per_token}")
        for name in ("min_slo_s", "max_ttft_slo_s", "max_tpot_slo_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a finite positive number of seconds, got {getattr(self, name)}")
        for name, top in (("default_ttft_slo_s", self.max_ttft_slo_s), ("default_tpot_slo_s", self.max_tpot_slo_s)):
            if not self.min_slo_s <= getattr(self, name) <= top:
                raise ValueError(f"{name} ({getattr(self, name)}) must lie in [min_slo_s, max_{name[8:]}] = "
                                 f"[{self.min_slo_s}, {top}]")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens_limit "
                             f"({self.max_tokens_limit})")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file must be given together")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535] (0: any free port), got {self.http_port}")
        if self.tool_call_parser not in ("", *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)} (or empty: none), "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in ("", *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} (or empty: none), "
                             f"got {self.reasoning_parser!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                             f"{self.scheduling_policy!r}")
        check_max_model_len(self.max_model_len)
        self.tls_key_pair()  # fail at startup, not at the first connection
        if not self.bearer_tokens() and self.max_streams_per_token:
            raise ValueError("max_streams_per_token needs bearer tokens (token_file or PDSERVE_ROUTER_TOKEN)")

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

    def bearer_tokens(self) -> tuple[str, ...]:
        """The tokens clients may present, each with its own ``max_streams_per_token`` quota:
        ``token_file``'s lines (one token per line, surrounding whitespace and blank lines ignored),
        else ``PDSERVE_ROUTER_TOKEN``, else none (no token check).

        Raises:
            ValueError: the file cannot be read, holds no token or one twice, or a token is too short
                or not visible ASCII (the message names the line, never the token).
        """
        if self.token_file:
            where = f"token_file {self.token_file!r}"
            lines = _read_text(self.token_file, "token_file").splitlines()
            tokens = tuple(check_token(line.strip(), f"{where} line {i}")
                           for i, line in enumerate(lines, 1) if line.strip())
            if not tokens:
                check_token("", where)  # the same message as an empty single-token file
            if len(set(tokens)) != len(tokens):
                raise ValueError(f"{where}: a token is listed twice")
            return tokens
        token = os.environ.get(TOKEN_ENV, "").strip()
        return (check_token(token, TOKEN_ENV),) if token else ()

    def bearer_token(self) -> str | None:
        """The first of :meth:`bearer_tokens` (the only one unless ``token_file`` lists several), or None.

        Raises:
            ValueError: as :meth:`bearer_tokens`.
        """
        tokens = self.bearer_tokens()
        return tokens[0] if tokens else None

    @property
    def max_concurrent_rpcs(self) -> int:
        """The gRPC server's cap on concurrent RPCs of every kind (``maximum_concurrent_rpcs``)."""
        return self.max_concurrent_streams + RPC_HEADROOM

"""Checks of the fields of the workers' RPCs (``proto/worker.proto``), shared by the prefill and the
decode worker: every field is refused unless it is finite and in range, before anything is allocated.

The router sends only valid values, but a worker must not trust its caller: one bad field (a NaN
timeout, an id outside the vocabulary, a block table of the wrong shape) must end the call with
INVALID_ARGUMENT, never hold blocks without a deadline or fail later inside an engine thread. Each
check raises ``ValueError`` naming the field and the range; messages quote client values through
``repr`` (escaped) and cut long ones.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf import message as pb_message

from pdserve.model.sampling_types import SamplingParams

MAX_ATTEMPT_ID_CHARS = 256
"""Longest ``request_id`` (an attempt id) a worker takes: the router's are about 40 characters."""
UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
"""Unicode categories no id may carry into a log line: control, format, line/paragraph separators,
surrogates (the router escapes them in client ids, workers refuse them in attempt ids)."""

MAX_KV_TIMEOUT_S = 3600.0
"""The longest ``kv_timeout_s`` a request may ask for (seconds): its blocks wait at most this long
for KV pages, so a caller cannot hold them without a deadline."""


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_attempt_id(attempt_id: str) -> str:
    """Return ``attempt_id`` if a worker can key a request and its KV transfer by it: 1 to
    :data:`MAX_ATTEMPT_ID_CHARS` characters, none of them control, format or separator characters
    (it is written into log lines and KV frame headers).

    Raises:
        ValueError: empty, too long, or an unsafe character.
    """
    if not attempt_id:
        raise ValueError("request_id is empty")
    if len(attempt_id) > MAX_ATTEMPT_ID_CHARS:
        raise ValueError(f"request_id of {len(attempt_id)} characters exceeds {MAX_ATTEMPT_ID_CHARS}")
    if any(unicodedata.category(c) in UNSAFE_CATEGORIES for c in attempt_id):
        raise ValueError(f"request_id {_short(attempt_id)} holds control or format characters")
    return attempt_id


def outside_vocabulary(ids: Sequence[int], vocab_size: int) -> list[int]:
    """The distinct ids of ``ids`` outside ``[0, vocab_size)``, ascending (empty when every id is in it)."""
    return sorted({t for t in ids if not 0 <= t < vocab_size})


def check_token_ids(name: str, ids: Sequence[int], vocab_size: int, max_len: int, allow_empty: bool = False,
                    bound: str = "the model's context") -> list[int]:
    """Return ``ids`` as a list if there are at most ``max_len`` of them (checked first, so a huge list
    costs nothing more), each in ``[0, vocab_size)``, and at least one unless ``allow_empty``.

    Raises:
        ValueError: empty (unless allowed), too many (``bound`` says why ``max_len``), or an id outside the
            vocabulary; names ``name``.
    """
    if not ids and not allow_empty:
        raise ValueError(f"{name} is empty")
    if len(ids) > max_len:
        raise ValueError(f"{name} holds {len(ids)} tokens; at most {max_len} are allowed ({bound})")
    if bad := outside_vocabulary(ids, vocab_size):
        raise ValueError(f"{name} {bad[:8]} are outside the vocabulary [0, {vocab_size})")
    return list(ids)


def check_sampling(sampling: SamplingParams, vocab_size: int) -> SamplingParams:
    """Return ``sampling`` if every field is usable: :meth:`SamplingParams.validate` (temperature >= 0,
    top_p in (0, 1], min_p in [0, 1], top_k >= 0, max_tokens >= 1, stop tokens in the vocabulary and at most
    :data:`model.sampling_types.MAX_STOP_TOKEN_IDS` of them, penalties and logit bias in range) and finite floats.

    Raises:
        ValueError: naming the first invalid field.
    """
    for name in ("temperature", "top_p", "min_p"):
        value = getattr(sampling, name)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
    sampling.validate(vocab_size)
    return sampling


def check_block_ids(name: str, block_ids: Sequence[int], num_blocks: int | None = None) -> list[int]:
    """Return ``block_ids`` as a list if they are distinct, non-negative and, when ``num_blocks`` is known
    (the pool they index), below it.

    Raises:
        ValueError: a negative, repeated or out-of-range id; names ``name``.
    """
    ids = list(block_ids)
    bad = sorted({b for b in ids if b < 0 or (num_blocks is not None and b >= num_blocks)})
    if bad:
        bound = f"[0, {num_blocks})" if num_blocks is not None else "non-negative"
        raise ValueError(f"{name} {bad[:8]} are not block ids ({bound})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name} repeats a block id")
    return ids


@dataclass(frozen=True)
class Undecodable:
    """Request bytes that do not parse as the RPC's message (corrupt wire format, invalid UTF-8 in a
    string): handed to the servicer instead of the message, which answers INVALID_ARGUMENT with
    ``message`` rather than letting gRPC answer UNKNOWN."""

    message: str


def lenient_parser(message_type: type[pb_message.Message]) -> Callable[[bytes], pb_message.Message | Undecodable]:
    """A gRPC request deserializer for ``message_type`` that returns :class:`Undecodable` instead of raising."""
    def parse(raw: bytes) -> pb_message.Message | Undecodable:
        try:
            return message_type.FromString(raw)
        except pb_message.DecodeError as exc:
            return Undecodable(f"malformed {message_type.DESCRIPTOR.name}: {exc}")
    return parse


def check_decoded(request: pb_message.Message | Undecodable) -> pb_message.Message:
    """Return ``request`` if it was decoded.

    Raises:
        ValueError: it is :class:`Undecodable` (its message says why).
    """
    if isinstance(request, Undecodable):
        raise ValueError(request.message)
    return request


def add_lenient_handlers(server: grpc.aio.Server, service_name: str,
                         handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    """Register ``handlers`` (built with :func:`lenient_parser` deserializers) for ``service_name`` on
    ``server``, as the generated ``add_*Servicer_to_server`` functions do."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
    server.add_registered_method_handlers(service_name, handlers)

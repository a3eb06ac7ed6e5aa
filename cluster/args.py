"""Command-line flags generated from a config dataclass, so each process's flags
and its config stay one definition."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from typing import Any, TypeVar

T = TypeVar("T")
MAX_TIMEOUT_S = 86_400.0  # a timeout or interval flag longer than a day is a mistake (inf or NaN: one that never fires)


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add ``--field-name`` for every field of dataclass ``cls`` (required when it has no default)."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        kind = {"int": int, "float": float, "str": str, "bool": _bool}.get(str(f.type).removesuffix(" | None"), str)
        kind = FIELD_TYPES.get(f.name, kind)
        parser.add_argument(flag, dest=f.name, type=kind, required=not has_default, default=None,
                            help=f"(default: {_default_text(f)})" if has_default else "(required)")


def config_from_args(cls: type[T], ns: argparse.Namespace, parser: argparse.ArgumentParser | None = None,
                     **overrides: Any) -> T:
    """Build ``cls`` from parsed flags (unset flags keep the dataclass default). With ``parser``, a value the
    config refuses ends the process as a bad flag does (usage and the config's message, exit status 2)
    instead of a traceback.

    Raises:
        ValueError: the config refuses a value (without ``parser``).
    """
    given = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
             if getattr(ns, f.name, None) is not None}
    try:
        return cls(**{**given, **overrides})
    except ValueError as exc:
        if parser is None:
            raise
        parser.error(str(exc))


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def context_length(text: str) -> int:
    """A token count as vLLM's ``--max-model-len`` reads it: ``4096``, or with a suffix, decimal in lower case
    (``4k`` = 4,000, ``25.6k`` = 25,600) and binary in upper case (``4K`` = 4,096, ``1M`` = 1,048,576).

    Raises:
        argparse.ArgumentTypeError: anything else, a negative count, or a fraction of a token.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a token count such as 4096, 4k or 4K, got {text!r}")
    number, suffix = match.groups()
    value = float(number) * _SUFFIXES.get(suffix, 1)
    if value != int(value) or (not suffix and "." in number):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)


FIELD_TYPES = {"max_model_len": context_length}
"""Config fields whose flags read their values with a parser of their own rather than their type's."""


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _default_text(f: dataclasses.Field) -> str:
    return "from environment" if f.default is dataclasses.MISSING else repr(f.default)


def check_port(name: str, port: int) -> None:
    """Refuse a TCP port outside [0, 65535] (0: any free one); the OS would wrap 70000 to 4464.

    Raises:
        ValueError: naming ``name``.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"{name} must be in [0, 65535] (0: any free port), got {port}")


def check_seconds(name: str, value: float, low: float = 0.0, high: float = MAX_TIMEOUT_S,
                  zero_ok: bool = False) -> None:
    """Refuse a duration that is not a finite number of seconds in (``low``, ``high``] (``[low, high]``
    with ``zero_ok``): NaN passes every ``<=`` test and turned off the checks that used them.

    Raises:
        ValueError: naming ``name`` and the range.
    """
    inside = (low <= value if zero_ok else low < value) and value <= high
    if not (math.isfinite(value) and inside):
        bounds = f"{'[' if zero_ok else '('}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be a finite number of seconds in {bounds}, got {value!r}")


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


DEVICE_AUTO = "auto"
_DEVICE_NAME = re.compile(r"^(auto|cpu|cuda(:\d{1,3})?)$")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""``--dtype`` names besides ``auto`` (:data:`cluster.compute.DTYPES` maps them to torch dtypes)."""
AUTO_DTYPE = "auto"  # resolved by cluster.compute.resolve_dtype() in the worker


def check_device_name(name: str) -> None:
    """Raise ValueError unless ``name`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``. Pure: no device is asked."""
    if not isinstance(name, str) or not _DEVICE_NAME.match(name):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")


def check_dtype_name(name: str) -> None:
    """Raise ValueError unless ``name`` is ``auto`` or one of :data:`DTYPE_NAMES`. Pure: nothing is resolved."""
    if name != AUTO_DTYPE and name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be {AUTO_DTYPE} or one of {sorted(DTYPE_NAMES)}, got {name!r}")


KV_TRANSPORTS = ("auto", "nccl", "cuda-ipc", "tcp")
"""``--kv-transport`` values: ``auto`` (what the KV cache's memory allows, best first; a receiver listens on
NCCL or TCP), or one backend (``cuda-ipc``: workers on GPUs one process sees, e.g. sharing one GPU). The
backends are listed best first: :data:`kvtransfer.backends.BACKEND_PREFERENCE` is this order."""


def default_redis_url() -> str:
    """``PDSERVE_REDIS_URL`` or the local Redis."""
    return os.environ.get("PDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0")


def check_redis_url(name: str, url: str) -> None:
    """Refuse a Redis URL the client library cannot parse (it said so from deep inside, at first use).

    Raises:
        ValueError: naming ``name`` and the schemes.
    """
    if not url.startswith(REDIS_SCHEMES):
        raise ValueError(f"{name} must be a URL starting with {', '.join(REDIS_SCHEMES)}, got {url!r}")

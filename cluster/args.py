"""Command-line flags generated from a config dataclass, so each process's flags
and its config stay one definition."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def add_config_args(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add ``--field-name`` for every field of dataclass ``cls`` (required when it has no default)."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        kind = {"int": int, "float": float, "str": str, "bool": _bool}.get(str(f.type).removesuffix(" | None"), str)
        parser.add_argument(flag, dest=f.name, type=kind, required=not has_default, default=None,
                            help=f"(default: {_default_text(f)})" if has_default else "(required)")


def config_from_args(cls: type[T], ns: argparse.Namespace, **overrides: Any) -> T:
    """Build ``cls`` from parsed flags (unset flags keep the dataclass default)."""
    given = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
             if getattr(ns, f.name, None) is not None}
    return cls(**{**given, **overrides})


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _default_text(f: dataclasses.Field) -> str:
    return "from environment" if f.default is dataclasses.MISSING else repr(f.default)

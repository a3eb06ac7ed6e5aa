"""Process logging: plain text, or one JSON object per line (python-json-logger) that log collectors
parse without rules.

The few places that log per request pass its ids as ``extra=request_fields(...)``, so one request can
be followed across processes: the router logs the client's ``request_id`` with the ``attempt_id`` it
dispatched (:mod:`router.recovery`: the request's uid, then ``uid-2``, ``uid-3`` for retries and
migrations), and the workers, which know the request only by that attempt id, log ``attempt_id``::

    {"time": "...", "level": "WARNING", "name": "pdserve.router.generate", "message": "request r1: ...",
     "request_id": "r1", "attempt_id": "5f0c...", "process": 4242}
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TextIO

from pythonjsonlogger.json import JsonFormatter

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
JSON_FIELDS = "%(asctime)s %(levelname)s %(name)s %(message)s %(process)d"


def request_fields(attempt_id: str, request_id: str | None = None) -> dict[str, str]:
    """``extra=`` of a log call about one request: its ``attempt_id``, and at the router the client's
    ``request_id``."""
    return {"attempt_id": attempt_id} if request_id is None else {"request_id": request_id, "attempt_id": attempt_id}


def configure_logging(fmt: str = "text", level: str | int = "WARNING", stream: TextIO | None = None) -> None:
    """Send the root logger's records to ``stream`` (stderr) as ``fmt`` (``text`` or ``json``), from ``level`` up;
    replaces the root logger's handlers.

    Raises:
        ValueError: an unknown format or level.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(JSON_FIELDS, rename_fields={"asctime": "time", "levelname": "level"})
                         if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """``--log-format text|json`` and ``--log-level`` (default WARNING) of a process's command line."""
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text, or one JSON object per line (default: text)")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="(default: WARNING)")

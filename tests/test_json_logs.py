"""``--log-format json`` (cluster/logs.py): every role process writes one JSON object per stderr line,
and one request can be followed across the router and both workers by its attempt id."""

from __future__ import annotations

import io
import json
import logging

import pytest

from pdserve.cluster.logs import configure_logging, request_fields
from pdserve.deploy import client
from tests.clusters import Cluster


def json_lines(text: str) -> list[dict]:
    """Each non-empty line of ``text`` parsed as a JSON object (fails on any other line)."""
    out = []
    for line in text.splitlines():
        if line.strip():
            record = json.loads(line)
            assert isinstance(record, dict) and {"time", "level", "name", "message"} <= record.keys(), line
            out.append(record)
    return out


def test_a_request_is_followed_across_processes_by_its_ids(redis_url, model_dir):
    flags = {"log_format": "json", "log_level": "info"}
    c = Cluster(model_dir, redis_url, router_flags=flags, **flags)
    try:
        request = client.make_request("Once upon a time", max_tokens=4, temperature=0)
        request.request_id = "json-log-test"
        done = c.run(lambda ch: client.complete(ch, request, timeout_s=60))
        assert done.final.request_id == "json-log-test"
    finally:
        c.stop()
    logs = {p.name: json_lines(p.proc.stderr.read()) for p in [c.router, *c.workers]}
    (attempt,) = {r["attempt_id"] for r in logs["router"] if r.get("request_id") == "json-log-test"}
    for name in ("p0", "d0"):  # the workers know the request by its attempt id
        mine = [r for r in logs[name] if r.get("attempt_id") == attempt]
        assert mine, f"{name} logged nothing about attempt {attempt}: {logs[name]}"
        assert all(r["level"] in ("INFO", "WARNING") for r in mine)
    assert any("finished" in r["message"] for r in logs["d0"] if r.get("attempt_id") == attempt)


def test_text_and_json_formats():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        for fmt in ("json", "text"):
            stream = io.StringIO()
            configure_logging(fmt, "INFO", stream)
            logging.getLogger("pdserve.test").info("hello %s", "there", extra=request_fields("a-1", "r-1"))
            line = stream.getvalue().strip()
            if fmt == "json":
                record = json.loads(line)
                assert (record["message"], record["attempt_id"], record["request_id"]) == ("hello there", "a-1", "r-1")
            else:
                assert line.endswith("pdserve.test INFO hello there")
        with pytest.raises(ValueError):
            configure_logging("xml")
    finally:  # give pytest's handlers back
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)

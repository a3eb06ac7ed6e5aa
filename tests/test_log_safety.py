"""What a client or an operator's config puts into log lines and messages cannot forge log lines or
leak a password."""

from __future__ import annotations

import pytest

from pdserve.cluster.registry import redact_url
from pdserve.deploy.config import EMBEDDED_MODEL
from pdserve.model.config import ModelConfig
from pdserve.model.tokenizer import Tokenizer
from pdserve.proto import pdserve_pb2
from pdserve.router.validation import printable_id, validate

CFG = ModelConfig.from_hf_dir(EMBEDDED_MODEL)
TOKENIZER = Tokenizer(EMBEDDED_MODEL, CFG.bos_token_id)


@pytest.mark.parametrize("given, logged", [
    ("req-42", "req-42"),
    ("café ✓ 名前", "café ✓ 名前"),  # printable Unicode stays
    ("\ud7fc", "\ud7fc"),  # so does an unassigned code point: it cannot move the cursor
    ("a\nINFO forged line", "a\\nINFO forged line"),
    ("\x1b[2Jcleared", "\\x1b[2Jcleared"),
    ("tab\tcr\r\x00nul", "tab\\tcr\\r\\x00nul"),
    ("\u2028sep\u202eRTL", "\\u2028sep\\u202eRTL"),
])
def test_request_ids_reach_logs_printable(given, logged):
    assert printable_id(given) == logged
    assert printable_id(logged) == logged
    valid = validate(pdserve_pb2.GenerateRequest(request_id=given, text="Once upon a time"), CFG, TOKENIZER, 4)
    assert valid.request_id == logged  # what the router logs and echoes in Final.request_id


@pytest.mark.parametrize("url, shown", [
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://:s3cret@10.0.0.2:6379/0", "redis://:***@10.0.0.2:6379/0"),
    ("rediss://default:s3cret@redis.internal/1?ssl_cert_reqs=required",
     "rediss://default:***@redis.internal/1?ssl_cert_reqs=required"),
    ("redis://user:p%40ss@[::1]:6380", "redis://user:***@[::1]:6380"),
])
def test_redis_urls_are_redacted(url, shown):
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url) and "p%40ss" not in redact_url(url)

"""Plain HTTP requests to a cluster's OpenAI-compatible API, for the tests that send what the ``openai``
client would not (raw bytes, hostile bodies), and the prompts the HTTP API tests send."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

PROMPTS = ["Once upon a time, there was a little dog", "Lily and Ben went to the park. They saw", "Tom had a red ball."]
MESSAGES = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A dog and a cat"}]


def raw(address: str, path: str, body: dict | bytes | None = None, headers: dict | None = None):
    """``(status, headers, body)`` of one plain HTTP request (POST when ``body`` is given; a dict is sent as
    JSON with every non-ASCII character escaped, lone surrogates as ``\\udXXX``)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{address}{path}", data=data, headers={
        "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()

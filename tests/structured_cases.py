"""The schema, prompt and grammars the structured-output tests (test_structured_output.py over gRPC and in the
engine, test_structured_output_http.py over the HTTP API) hold the json-capable model's answers to."""

from __future__ import annotations

import json

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue", "green"]}},
          "required": ["ok", "color"], "additionalProperties": False}
PROMPT = "Once upon a time, there was a little dog named Max."


def valid(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"ok", "color"} and isinstance(value["ok"], bool) and value["color"] in SCHEMA[
        "properties"]["color"]["enum"]


REGEX = r"[0-9]{2,4}-(yes|no)"
CHOICES = ["red dog", "blue cat", "green", 'a "quoted" word']   # (the embedded vocabulary has no backslash)
EBNF = 'root ::= "The answer is " ("yes" | "no" | [0-9]+) "."'

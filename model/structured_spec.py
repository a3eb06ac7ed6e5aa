"""Structured-output specs as requests carry them, and their checks, without the grammar compiler: the router
refuses a bad spec before any worker (or xgrammar) sees it, and imports none of :mod:`model.structured`'s
dependencies (torch, the C kernels, the tokenizer). :mod:`model.structured` compiles these kinds."""

from __future__ import annotations

import json

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SCHEMA_CHARS = 65_536  # a spec's text at most: every worker compiles it, as every worker reads a prompt
MAX_CHOICES = 1_024

Spec = tuple[str, str]
"""``(kind, text)``: ``("json_object", "")``, ``("json_schema", the schema as JSON text)``, ``("regex",
pattern)``, ``("choice", the choices as a JSON array of strings)`` or ``("grammar", EBNF text)``."""


def check_spec(spec: Spec) -> None:
    """Refuse a spec before any xgrammar parser sees it: an unknown kind, a text over :data:`MAX_SCHEMA_CHARS`
    characters, a schema :func:`check_schema_text` refuses, an empty regex or grammar, or choices that are not
    1 to :data:`MAX_CHOICES` non-empty strings.

    Raises:
        ValueError: naming the field (``structured_output.<kind>``) and the problem.
    """
    kind, text = spec
    if kind not in KINDS:
        raise ValueError(f"unknown structured output kind {kind!r}: one of {', '.join(KINDS)}")
    if kind == "json_schema":
        check_schema_text(text)
    elif len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"structured_output.{kind} of {len(text)} characters exceeds {MAX_SCHEMA_CHARS}")
    elif kind in ("regex", "grammar") and not text:
        raise ValueError(f"structured_output.{kind} is empty")
    elif kind == "choice":
        choices = json.loads(text)
        if not (isinstance(choices, list) and 0 < len(choices) <= MAX_CHOICES
                and all(isinstance(c, str) and c for c in choices)):
            raise ValueError(f"structured_output.choice must be 1 to {MAX_CHOICES} non-empty strings")


def check_schema_text(text: str) -> None:
    """Refuse a schema that is not JSON text of an object, or longer than :data:`MAX_SCHEMA_CHARS` (before
    xgrammar sees it: its parser recurses on nesting).

    Raises:
        ValueError: naming the problem.
    """
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"structured_output.json_schema of {len(text)} characters exceeds {MAX_SCHEMA_CHARS}")
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:   # RecursionError: nested deeper than the parser's stack
        raise ValueError(f"structured_output.json_schema is not JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError("structured_output.json_schema must be a JSON object (a JSON Schema)")

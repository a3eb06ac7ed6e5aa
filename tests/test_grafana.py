"""The Grafana dashboard (deploy/grafana/pdserve.json): valid JSON, every panel's PromQL parses (a small
lexer: balanced brackets, known functions, aggregation clauses, label matchers, range durations), and every
metric it queries is one the processes build (here: the text of fresh registries from cluster/metrics.py;
against the live ``/metrics`` of a cluster: tests/test_metrics.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster import metrics
from pdserve.cluster.registry import WorkerInfo

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "pdserve.json"

FUNCTIONS = {"histogram_quantile", "rate", "irate", "increase", "sum", "avg", "max", "min", "count", "clamp_min",
             "clamp_max", "topk", "bottomk", "abs", "vector", "scalar", "label_replace", "avg_over_time",
             "max_over_time", "sum_over_time", "time"}
AGGREGATIONS = {"sum", "avg", "max", "min", "count", "topk", "bottomk"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset"}
TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<duration>(?:\d+(?:ms|s|m|h|d|w|y))+|\$__rate_interval|\$__interval|\$__range)
  | (?P<number>\d+(?:\.\d*)?(?:e[+-]?\d+)?|\.\d+)
  | (?P<variable>\$\{?[A-Za-z_][A-Za-z0-9_]*\}?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=,(){}\[\]])
""", re.VERBOSE)


def lex(expr: str) -> list[tuple[str, str]]:
    """``(kind, text)`` tokens of a PromQL expression (whitespace dropped).

    Raises:
        ValueError: a character no token starts with.
    """
    out, i = [], 0
    while i < len(expr):
        m = TOKEN.match(expr, i)
        if m is None:
            raise ValueError(f"cannot lex {expr[i:i + 20]!r} in {expr!r}")
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group()))
        i = m.end()
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects, checking its shape on the way.

    Raises:
        ValueError: unbalanced brackets, an unknown function, a label matcher or a grouping clause that is
            not a list of names, a range that is not a duration, or no metric at all.
    """
    tokens, names, stack = lex(expr), set(), []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if text in "([{":
            stack.append(text)
            if text == "{":  # label matchers: name op "value", ...
                i += 1
                while tokens[i][1] != "}":
                    (k1, _), (_, op), (k3, _) = tokens[i:i + 3]
                    if k1 != "ident" or op not in ("=", "!=", "=~", "!~") or k3 not in ("string", "variable"):
                        raise ValueError(f"bad label matcher in {expr!r}")
                    i += 3
                    if tokens[i][1] == ",":
                        i += 1
                continue
            if text == "[":  # a range: one duration
                if tokens[i + 1][0] != "duration" or tokens[i + 2][1] != "]":
                    raise ValueError(f"bad range in {expr!r}")
                i += 2
                continue
        elif text in ")]}":
            if not stack or {"(": ")", "[": "]", "{": "}"}[stack.pop()] != text:
                raise ValueError(f"unbalanced {text!r} in {expr!r}")
        elif kind == "ident" and text in ("by", "without", "on", "ignoring"):  # a list of label names
            if nxt != "(":
                raise ValueError(f"{text} without a label list in {expr!r}")
            j = i + 2
            while tokens[j][1] != ")":  # name, name, ...
                want_name = (j - i) % 2 == 0
                if (tokens[j][0] == "ident") != want_name or (not want_name and tokens[j][1] != ","):
                    raise ValueError(f"bad label list in {expr!r}")
                j += 1
            i = j + 1
            continue
        elif kind == "ident" and nxt == "(":
            if text not in FUNCTIONS:
                raise ValueError(f"unknown function {text} in {expr!r}")
        elif kind == "ident" and text not in KEYWORDS and text not in AGGREGATIONS:
            names.add(text)
        i += 1
    if stack:
        raise ValueError(f"unclosed {stack[-1]!r} in {expr!r}")
    if not names:
        raise ValueError(f"no metric in {expr!r}")
    return names


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def expressions() -> list[str]:
    """Every target's ``expr`` in the dashboard, rows' nested panels included."""
    def panels(ps):
        for p in ps:
            yield p
            yield from panels(p.get("panels", []))
    return [t["expr"] for p in panels(dashboard()["panels"]) for t in p.get("targets", []) if "expr" in t]


def dashboard_metric_names() -> set[str]:
    """The sample names (``..._bucket``, ``..._total``) that the dashboard's queries select."""
    return set().union(*(metric_names(e) for e in expressions()))


def built_metric_names() -> set[str]:
    """Sample names in the ``/metrics`` text of each process kind's registry, as cluster/metrics.py builds it."""
    load = lambda: WorkerInfo(worker_id="w", role="decode", address="", num_total_blocks=8)  # noqa: E731
    registries = [CollectorRegistry() for _ in range(3)]
    metrics.router_metrics(registries[0])
    metrics.prefill_metrics(registries[1], "p", load)
    metrics.decode_metrics(registries[2], "d", "decode", load)
    names = set()
    for registry in registries:
        for fam in text_string_to_metric_families(generate_latest(registry).decode()):
            names |= {s.name for s in fam.samples}
    return names


def test_dashboard_is_grafana_json_with_panels():
    d = dashboard()
    assert d["title"] and d["uid"] and d["schemaVersion"] >= 30
    assert len(expressions()) >= 10
    titles = " ".join(p.get("title", "") for p in d["panels"]).lower()
    for subject in ("ttft", "tpot", "goodput", "running", "waiting", "kv", "prefix", "transfer", "rejection",
                    "migration"):
        assert subject in titles, f"no panel about {subject}"


@pytest.mark.parametrize("expr", expressions())
def test_every_query_parses(expr):
    assert metric_names(expr)


def test_the_lexer_refuses_bad_queries():
    for bad in ("sum(rate(x[5m])", "rate(x[5])", "nosuchfn(x)", "sum by (a b) (x)", "x{a=b}", "1 + 2"):
        with pytest.raises(ValueError):
            metric_names(bad)


def test_every_queried_metric_is_built():
    missing = dashboard_metric_names() - built_metric_names()
    assert not missing, f"the dashboard queries metrics cluster/metrics.py does not build: {sorted(missing)}"

"""``bench.replay``: trace loading and scaling, real-text prompts with Mooncake block sharing,
SLO attainment and goodput, and one end-to-end replay on a real cluster."""

from __future__ import annotations

import argparse
import json
import math
import re
import string
from pathlib import Path

import pytest

from pdserve.bench.replay import cli, goodput
from pdserve.bench.replay.goodput import SLO, attainment
from pdserve.bench.replay.prompts import CORPUS, PromptBuilder
from pdserve.bench.replay.records import RequestRecord
from pdserve.bench.replay.traces import (
    TraceOptions,
    TraceRequest,
    detect_format,
    load_trace,
    mean_rate,
    mooncake_block_tokens,
    read_azure,
    read_mooncake,
    rescale_arrivals,
)
from pdserve.deploy.config import EMBEDDED_MODEL

DATA = Path(__file__).parent / "data"
AZURE = DATA / "azure_code_sample.csv"
MOONCAKE = DATA / "mooncake_sample.jsonl"


@pytest.fixture(scope="module")
def builder() -> PromptBuilder:
    return PromptBuilder(EMBEDDED_MODEL, seed=0)


# --- traces -------------------------------------------------------------------------------

def test_azure_loader_reads_the_sample():
    reqs = read_azure(AZURE)
    assert len(reqs) == 40
    assert reqs[0] == TraceRequest(0.0, 4808, 10, None)
    assert reqs[1].prompt_tokens == 3180 and reqs[1].output_tokens == 8
    assert reqs[1].arrival_s == pytest.approx(4.0319600 - 3.9799600, abs=1e-6)  # 18:17:04.0319600 - 03.9799600
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert detect_format(AZURE) == "azure" and len(read_azure(AZURE, max_requests=5)) == 5


def test_mooncake_loader_reads_the_sample():
    reqs = read_mooncake(MOONCAKE)
    assert len(reqs) == 16
    assert reqs[0].prompt_tokens == 40160 and reqs[0].output_tokens == 6 and reqs[0].block_ids == tuple(range(79))
    assert [r.arrival_s for r in reqs[:4]] == [0.0, 0.0, 0.040, 0.277]  # ms -> s
    assert reqs[10].block_ids == (708, 709, 710, 711, 712, 713)
    assert detect_format(MOONCAKE) == "mooncake"
    with pytest.raises(ValueError):
        detect_format("trace.parquet")


def test_length_scaling_clamps_and_blocks():
    assert mooncake_block_tokens(1 / 32) == 16 and mooncake_block_tokens(0.03) == 15
    assert mooncake_block_tokens(1e-4) == 1
    t = load_trace(MOONCAKE, options=TraceOptions(length_scale=1 / 32))
    assert t.format == "mooncake" and t.block_tokens == 16
    assert t.requests[0].prompt_tokens == round(40160 / 32) and t.requests[0].output_tokens == 1  # 6/32 -> min 1
    t = load_trace(MOONCAKE, options=TraceOptions(length_scale=1 / 32, output_scale=1.0, max_prompt_tokens=96,
                                                  max_output_tokens=50, min_prompt_tokens=8))
    r0 = t.requests[0]
    assert (r0.prompt_tokens, r0.output_tokens, r0.block_ids) == (96, 6, tuple(range(6)))  # 96 / 16 = 6 blocks kept
    assert t.requests[4].output_tokens == 50  # 210 clamped
    assert t.requests[5].prompt_tokens == 8 and t.requests[5].block_ids == (298,)  # 28/32 -> 1 -> min 8
    a = load_trace(AZURE, options=TraceOptions(length_scale=0.1, max_requests=3))
    assert [(r.prompt_tokens, r.output_tokens) for r in a.requests] == [(481, 1), (318, 1), (11, 3)]
    assert a.block_tokens is None and len(a.requests) == 3


def test_arrival_rescaling():
    reqs = [TraceRequest(t, 10, 5) for t in (10.0, 11.0, 13.0, 14.0)]
    assert mean_rate(reqs) == pytest.approx(3 / 4)
    assert [r.arrival_s for r in rescale_arrivals(reqs, time_scale=2.0)] == [0.0, 2.0, 6.0, 8.0]
    fast = rescale_arrivals(reqs, rate=6.0)
    assert mean_rate(fast) == pytest.approx(6.0)
    assert [r.arrival_s for r in fast] == pytest.approx([0, 0.125, 0.375, 0.5])
    burst = [TraceRequest(0.0, 1, 1)] * 3
    assert [r.arrival_s for r in rescale_arrivals(burst, rate=2.0)] == [0.0] * 3
    t = load_trace(AZURE, options=TraceOptions(max_requests=12, rate=4.0))
    assert t.mean_rate() == pytest.approx(4.0) and t.at_rate(10.0).mean_rate() == pytest.approx(10.0)
    assert [r.prompt_tokens for r in t.at_rate(10.0).requests] == [r.prompt_tokens for r in t.requests]


# --- prompts ------------------------------------------------------------------------------

def test_shared_hash_ids_share_token_blocks(builder):
    t = load_trace(MOONCAKE, options=TraceOptions(length_scale=1 / 32, max_prompt_tokens=384))
    bs, reqs = t.block_tokens, t.requests
    p = {i: builder.prompt(reqs[i], i, bs) for i in (10, 12, 13, 14)}
    assert all(len(p[i]) == reqs[i].prompt_tokens for i in p)
    assert reqs[10].block_ids == reqs[13].block_ids and p[10] == p[13]  # same ids, same prompt
    shared = 1 + 5 * bs  # BOS + blocks 708..712
    assert p[10][:shared] == p[12][:shared] == p[14][:shared]  # 708..712 shared, then 713 / 1469 / 2269
    assert p[10][shared:shared + 4] != p[12][shared:shared + 4]
    assert builder.block("h708", bs) == PromptBuilder(EMBEDDED_MODEL, seed=0).block("h708", bs)  # deterministic
    blocks = {tuple(builder.block(f"h{h}", bs)) for h in range(300)}
    assert len(blocks) == 300  # different ids, different blocks
    assert PromptBuilder(EMBEDDED_MODEL, seed=1).block("h708", bs) != builder.block("h708", bs)


def test_azure_prompts_are_unique_real_text(builder):
    t = load_trace(AZURE, options=TraceOptions(length_scale=1 / 16, max_prompt_tokens=300))
    prompts = [builder.prompt(r, i) for i, r in enumerate(t.requests)]
    assert [len(p) for p in prompts] == [r.prompt_tokens for r in t.requests]
    assert all(p[0] == 1 for p in prompts)  # BOS as the tokenizer adds it
    heads = {tuple(p[1:9]) for p in prompts if len(p) >= 9}
    assert len(heads) == sum(len(p) >= 9 for p in prompts)  # no shared prefix beyond BOS
    longest = max(prompts, key=len)
    assert len(set(longest)) > len(longest) // 4  # not one repeated token
    text = builder.decode(longest[1:])
    vocab = set(re.findall(r"[a-z]+", CORPUS.read_text().lower()))
    words = re.findall(r"[a-z]+", text.lower())
    assert len(words) > 100
    assert sum(w in vocab for w in words) >= 0.95 * len(words), text
    assert all(c in string.printable for c in text)


# --- attainment and goodput ---------------------------------------------------------------

def _rec(ttft, tpot, status="OK") -> RequestRecord:
    return RequestRecord(ttft_s=ttft, tpot_s=tpot, status=status, tokens=1 if tpot is None else 8)


def test_attainment_on_hand_made_records():
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    recs = [_rec(0.1, 0.01), _rec(0.5, 0.05),  # both met (<= is met)
            _rec(0.6, 0.01),  # TTFT missed
            _rec(0.2, 0.08),  # TPOT missed
            _rec(0.3, None),  # one token: no TPOT, meets it
            _rec(None, None, "RESOURCE_EXHAUSTED"), _rec(0.1, 0.01, "TIME_LIMIT"), _rec(0.9, 0.09)]
    a = attainment(recs, slo)
    assert (a.n, a.ok) == (8, 6)
    assert a.both == pytest.approx(3 / 8) and a.ttft == pytest.approx(4 / 8) and a.tpot == pytest.approx(4 / 8)
    assert attainment([], slo).n == 0


def test_goodput_interpolates_between_last_above_and_first_below():
    g = goodput.goodput([(4, 0.5), (1, 1.0), (3, 0.85), (2, 0.95)])  # unsorted on purpose
    assert g.kind == "interpolated" and g.rate == pytest.approx(2.5) and g.monotone
    assert g.bracket == ((2.0, 0.95), (3.0, 0.85)) and g.tested == (1.0, 4.0)
    assert goodput.goodput([(1, 0.9), (2, 0.5)]).rate == pytest.approx(1.0)  # exactly at the target
    assert goodput.goodput([(1, 0.95), (2, 0.7)], target=0.8).rate == pytest.approx(1.6)
    g = goodput.goodput([(1, 1.0), (2, 0.8), (3, 0.92)])  # noisy recovery after the first drop: ignored, flagged
    assert g.rate == pytest.approx(1.5) and not g.monotone


def test_goodput_edge_cases():
    g = goodput.goodput([(1, 1.0), (2, 0.95), (4, 0.91)])
    assert g.kind == "lower_bound" and g.rate == 4.0 and ">=" in g.describe()
    g = goodput.goodput([(1, 0.5), (2, 0.2)])
    assert g.kind == "below_lowest" and g.rate == 0.0 and g.bracket is None and "< 1" in g.describe()
    assert goodput.goodput([(3, 0.95)]).kind == "lower_bound"
    json.dumps(g.to_dict(), allow_nan=False)
    with pytest.raises(ValueError):
        goodput.goodput([])


# --- command line -------------------------------------------------------------------------

def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_rejects_requests_beyond_the_context(tmp_path, capsys):
    args = _args("--router", "127.0.0.1:1", "--trace", str(AZURE), "--length-scale", "1/2", "--max-prompt-tokens",
                 "500", "--out", str(tmp_path))
    assert float(args.length_scale) == 0.5
    assert cli.main(args) == 2 and "context" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args("--router", "x:1", "--length-scale", "-1")


def test_replay_end_to_end(redis_url, tmp_path):
    """12 Azure requests (prompts /16, at most 48 tokens; outputs at most 12) at 8 and 24 req/s."""
    from pdserve.bench.common import LocalCluster

    cluster = LocalCluster(EMBEDDED_MODEL, redis_url)
    try:
        args = _args("--router", cluster.address, "--trace", str(AZURE), "--max-requests", "12",
                     "--length-scale", "1/16", "--output-scale", "1", "--max-prompt-tokens", "48",
                     "--max-output-tokens", "12", "--rates", "8,24", "--warmup", "1", "--time-limit", "60",
                     "--label", "e2e", "--out", str(tmp_path), "--no-progress")
        assert cli.main(args) == 0
    finally:
        cluster.stop()
    result = json.loads((tmp_path / "results.json").read_text())
    expected = [(r.prompt_tokens, r.output_tokens) for r in load_trace(AZURE, options=TraceOptions(
        max_requests=12, length_scale=1 / 16, output_scale=1, max_prompt_tokens=48, max_output_tokens=12)).requests]
    assert [run["rate"] for run in result["runs"]] == [8.0, 24.0]
    for run in result["runs"]:
        recs = run["records"]
        assert [(r["prompt_tokens"], r["output_tokens"]) for r in recs] == expected
        assert all(r["status"] == "OK" for r in recs), [r["error"] for r in recs]
        assert all(r["tokens"] == r["output_tokens"] and r["finish_reason"] == "FINISH_REASON_LENGTH" for r in recs)
        assert all(r["ttft_s"] > 0 and (r["tpot_s"] is None) == (r["tokens"] == 1) for r in recs)
        assert 0 <= run["attainment"]["both"] <= 1 and run["attainment"]["n"] == 12
    assert result["goodput"]["kind"] in ("interpolated", "lower_bound", "below_lowest")
    assert result["trace"]["source"].startswith("Azure") and result["parameters"]["rates"] == "8,24"
    assert not math.isnan(result["runs"][0]["summary"]["ttft_p50_s"])
    for png in ("attainment.png", "latency.png"):
        assert (tmp_path / png).stat().st_size > 10_000

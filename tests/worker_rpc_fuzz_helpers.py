"""Hypothesis strategies of the workers' RPC requests (``proto/worker.proto``: decode ``DecodeRequest``, prefill
``PrefillRequest``), valid and invalid, and the independent oracles naming each request's problems, for
:mod:`tests.test_fuzz_worker_rpcs`."""

from __future__ import annotations

import math
import re
import struct
import unicodedata
import uuid

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from pdserve.cluster.rpc_fields import MAX_ATTEMPT_ID_CHARS
from pdserve.decode_worker.request import MAX_KV_TIMEOUT_S
from pdserve.deploy.config import EMBEDDED_MODEL
from pdserve.model.config import ModelConfig
from pdserve.model.sampling_types import REPETITION_BOUNDS as REP
from pdserve.prefill_worker.server import MAX_KV_ADDRESS_CHARS
from pdserve.proto import worker_pb2

CFG = ModelConfig.from_hf_dir(EMBEDDED_MODEL)
VOCAB, CONTEXT, EOS = CFG.vocab_size, CFG.max_position_embeddings, tuple(CFG.eos_token_ids)
BLOCK = 16  # the workers' block size (WorkerConfig default)


def fuzz(n: int) -> settings:
    """Deterministic hypothesis settings running ``n`` examples."""
    return settings(max_examples=n, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])


# -- strategies ------------------------------------------------------------------------------------
# Built from few, cheap draws (sampled values, integers, token lists derived from a seed): hypothesis's
# cost per case, not the RPC's (about a millisecond), bounds how many cases fit the test file's time budget.

I32 = st.integers(-2**31, 2**31 - 1)
EXTREMES = [0.0, -0.0, 5e-324, 1e-45, 1.2e-38, 1e-9, 0.5, 1.0, 1.0000001, 3.4028234663852886e38, 1e300, -1e300,
            math.inf, -math.inf, math.nan, -1.0]
# any bit pattern (NaNs, infinities, subnormals, -0.0 included) from one integer draw
float32_bits = st.integers(0, 2**32 - 1).map(lambda b: struct.unpack("<f", struct.pack("<I", b))[0])
float64_bits = st.integers(0, 2**64 - 1).map(lambda b: struct.unpack("<d", struct.pack("<Q", b))[0])
floats32 = st.sampled_from(EXTREMES) | float32_bits  # 1e300 becomes inf in a float32 field
timeouts = (st.sampled_from(EXTREMES + [0.002, 0.01, 2.0, 30.0, MAX_KV_TIMEOUT_S, 3600.0000000000005]) | float64_bits
            | st.integers(1, 10**6).map(lambda n: n / 100))
unit = st.integers(1, 2**24).map(lambda n: n / 2**24)  # (0, 1]


def _ids(n: int, seed: int) -> list[int]:
    """``n`` token ids in the vocabulary, spread by ``seed``."""
    return [(seed + i * 2654435761) % VOCAB for i in range(n)]


seeds = st.integers(0, 2**32)
valid_ids = st.builds(_ids, st.integers(1, 40), seeds)
bad_ids = st.builds(lambda ids, bad, at: ids[:at] + [bad] + ids[at:], valid_ids | st.just([]),
                    st.sampled_from([-1, VOCAB, VOCAB + 1, 2**40, -2**63, 2**63 - 1]), st.integers(0, 40))
long_ids = st.builds(_ids, st.integers(CONTEXT - 3, CONTEXT + 3) | st.just(5000), seeds)
any_ids = valid_ids | bad_ids | long_ids | st.just([])
attempt_ids = (st.uuids().map(lambda u: u.hex) | st.text(max_size=6)
               | st.sampled_from(["", "a", "attempt-1-2", "é🙂", "x" * MAX_ATTEMPT_ID_CHARS,
                                  "y" * (MAX_ATTEMPT_ID_CHARS + 1), "z" * 5000, "ok\n", "\x1b[31mred", "rtl\u202e",
                                  "line\u2028", "nul\x00", "\t", " spaced id "]))
stop_lists = st.sampled_from([[], [2], [0, VOCAB - 1], [5, 6, 7], [VOCAB], [-1], [2**40], [-2**63]])


def unique(attempt_id: str) -> str:
    """Make a drawn id unique per call (a worker refuses an id it still holds, and a cancelled call's id is
    released a moment later) without changing its validity: valid ids get a random tail, within the limit."""
    if not attempt_id or len(attempt_id) > MAX_ATTEMPT_ID_CHARS or _unsafe(attempt_id):
        return attempt_id
    return attempt_id[: MAX_ATTEMPT_ID_CHARS - 9] + "-" + uuid.uuid4().hex[:8]


@st.composite
def samplings(draw, valid: bool = False, max_tokens: int | None = None) -> worker_pb2.ResolvedSampling:
    if valid:
        temperature = draw(st.sampled_from([0.0, -0.0, 1e-45, 1.2e-38, 0.7, 1.0, 3.4028234663852886e38])
                           | unit.map(lambda x: 10 * x))
        top_p = draw(st.sampled_from([1.0, 1e-45, 0.9, 0.5]) | unit)
        top_k = draw(st.integers(0, 50) | st.just(2**31 - 1))
        stops = draw(st.sampled_from([[], [2], [0, VOCAB - 1], [5, 6, 7]]))
        mt = max_tokens if max_tokens is not None else draw(st.integers(1, 8))
    else:
        temperature, top_p = draw(floats32), draw(floats32)
        top_k, stops = draw(st.integers(-3, 3) | I32), draw(stop_lists)
        mt = draw(st.integers(-3, 40) | I32 | st.sampled_from([CONTEXT - 1, CONTEXT, CONTEXT + 1]))
    if valid:   # off, or in range (the valid requests must be served, token-exactly where greedy and plain)
        penalties = draw(st.sampled_from([{}, {"presence_penalty": 0.5, "frequency_penalty": -1.0,
                                               "repetition_penalty": 1.25, "logit_bias": {3: 2.0}, "min_tokens": 1}]))
    else:       # anything a peer might send: NaN, infinities, out of range, outside the vocabulary
        penalties = {name: draw(floats32) for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")
                     if draw(st.booleans())}
        token_ids = st.integers(-3, VOCAB + 3) | st.integers(-2**63, 2**63 - 1)
        penalties["logit_bias"] = draw(st.dictionaries(token_ids, floats32, max_size=3))
        penalties["min_tokens"] = draw(st.integers(-3, 45) | I32)
    return worker_pb2.ResolvedSampling(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=mt,
                                       seed=draw(st.sampled_from([0, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1)),
                                       stop_token_ids=stops, ignore_eos=draw(st.booleans()), **penalties)


@st.composite
def decode_requests(draw) -> worker_pb2.DecodeRequest:
    """Decode requests whose fields range over valid and invalid values."""
    return worker_pb2.DecodeRequest(
        request_id=draw(attempt_ids), prompt_token_ids=draw(any_ids), sampling=draw(samplings()),
        kv_timeout_s=draw(timeouts), local_prefill=draw(st.sampled_from([False] * 7 + [True])),
        prior_output_token_ids=draw(st.just([]) | st.builds(_ids, st.integers(1, 6), seeds) | bad_ids))


@st.composite
def valid_decode_requests(draw) -> worker_pb2.DecodeRequest:
    """Decode requests the worker must allocate for (extreme but valid values)."""
    sampling = draw(samplings(valid=True, max_tokens=draw(st.integers(1, 40) | st.just(CONTEXT - 40))))
    stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(EOS))
    prior = [t for t in _ids(draw(st.integers(0, min(4, sampling.max_tokens - 1))), draw(seeds)) if t not in stops]
    prompt = _ids(draw(st.integers(1, min(40, CONTEXT - sampling.max_tokens))), draw(seeds))
    return worker_pb2.DecodeRequest(
        request_id=draw(st.uuids().map(lambda u: u.hex) | st.sampled_from(["r", "é🙂", "x" * 240])),
        prompt_token_ids=prompt, sampling=sampling, prior_output_token_ids=prior,
        kv_timeout_s=draw(st.sampled_from([5e-324, 0.002, 0.01, 1.0, 30.0, MAX_KV_TIMEOUT_S])
                          | st.integers(50, 10**4).map(lambda n: n / 100)))


addresses = (st.sampled_from(["127.0.0.1:1", "localhost:65535", "[::1]:50051", "decode-0.pdserve.svc:7000",
                              "", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:-1", ":80", "h:80x",
                              " 127.0.0.1:5", "a b:5", "::1:5", "tcp://h:5", "nccl://127.0.0.1:5", "h:5\n",
                              "x" * MAX_KV_ADDRESS_CHARS + ":1", "é.example:5", "[::1%eth0]:5", "h/..:5"])
             | st.text(max_size=8)
             | st.builds(lambda host, port: f"{host}:{port}", st.sampled_from(["10.0.0.7", "h", "a-b.c", "[fe80::1]"]),
                         st.integers(-2, 70000)))


def _blocks(need: int, start: int, kind: str) -> list[int]:
    """A destination block table for ``need`` blocks: distinct ids, or one ``kind`` of wrong."""
    ids = [start + 3 * i for i in range(need)]
    if kind == "repeated":
        return ids + ids[:1] if need < 2 else ids[:-1] + ids[:1]
    if kind == "negative":
        return ids[:-1] + [-1 - start]
    return {"short": ids[:-1], "long": ids + [start + 3 * need], "i32max": ids[:-1] + [2**31 - 1]}.get(kind, ids)


@st.composite
def prefill_requests(draw) -> worker_pb2.PrefillRequest:
    """Prefill requests whose fields range over valid and invalid values (block ids often of the right count)."""
    ids = draw(any_ids)
    kind = draw(st.sampled_from(["ok"] * 4 + ["repeated", "negative", "short", "long", "i32max"]))
    return worker_pb2.PrefillRequest(
        request_id=draw(attempt_ids), token_ids=ids, sampling=draw(samplings() | samplings(valid=True)),
        dst_kv_address=draw(addresses), dst_block_ids=_blocks(-(-len(ids) // BLOCK), draw(st.integers(0, 600)), kind),
        first_output_index=draw(st.integers(-2, 10) | I32))


@st.composite
def valid_prefill_pairs(draw) -> tuple[worker_pb2.PrefillRequest, worker_pb2.DecodeRequest]:
    """A prefill request every field of which is valid (extreme but valid sampling, migrated or not), and the
    decode request that allocates its destination (the test fills in dst_block_ids and dst_kv_address)."""
    sampling = draw(samplings(valid=True))
    first = draw(st.integers(0, sampling.max_tokens - 1))
    prompt = _ids(draw(st.integers(1, 40)), draw(seeds))
    stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(EOS))
    prior = [t if t not in stops else 3 + t for t in _ids(first, draw(seeds))]  # 3 + t: never a stop id here
    rid = uuid.uuid4().hex
    prefill = worker_pb2.PrefillRequest(request_id=rid, token_ids=prompt + prior, sampling=sampling,
                                        first_output_index=first)
    decode = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, kv_timeout_s=20,
                                      prior_output_token_ids=prior)
    return prefill, decode


@st.composite
def valid_prefill_requests(draw) -> worker_pb2.PrefillRequest:
    """Prefill requests every field of which is valid, for the in-process checks (no decode worker behind them)."""
    prefill, _ = draw(valid_prefill_pairs())
    prefill.request_id = draw(attempt_ids.filter(lambda rid: not _id_problems(rid)))
    prefill.dst_block_ids[:] = _blocks(-(-len(prefill.token_ids) // BLOCK), draw(st.integers(0, 2**31 - 200)), "ok")
    prefill.dst_kv_address = draw(st.sampled_from(["127.0.0.1:1", "localhost:65535", "[::1]:50051",
                                                   "decode-0.pdserve.svc:7000", "[fe80::1%eth0]:9"]))
    return prefill


# -- independent oracles: the words naming each problem (empty: valid) -------------------------------

def _unsafe(text: str) -> bool:
    return any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp", "Cs") for c in text)


def _id_problems(attempt_id: str) -> set[str]:
    return {"request_id"} if not attempt_id or len(attempt_id) > MAX_ATTEMPT_ID_CHARS or _unsafe(attempt_id) else set()


def _sampling_problems(s: worker_pb2.ResolvedSampling) -> set[str]:
    bad = set()
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        bad.add("temperature")
    if not (math.isfinite(s.top_p) and 0 < s.top_p <= 1):
        bad.add("top_p")
    if s.top_k < 0:
        bad.add("top_k")
    if s.max_tokens < 1:
        bad.add("max_tokens")
    if any(not 0 <= t < VOCAB for t in s.stop_token_ids):
        bad.add("stop_token_ids")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(s, name) <= 2:
            bad.add(name)
    if not (s.repetition_penalty == 0 or REP[0] <= s.repetition_penalty <= REP[1]):   # 0: unset, off
        bad.add("repetition_penalty")
    if any(not 0 <= t < VOCAB or not -100 <= b <= 100 for t, b in s.logit_bias.items()):
        bad.add("logit_bias")
    if s.max_tokens >= 1 and not 0 <= s.min_tokens <= s.max_tokens:
        bad.add("min_tokens")
    return bad


def decode_problems(req: worker_pb2.DecodeRequest) -> set[str]:
    s, prompt, prior = req.sampling, list(req.prompt_token_ids), list(req.prior_output_token_ids)
    bad = _id_problems(req.request_id) | _sampling_problems(s)
    if not prompt or len(prompt) >= CONTEXT or any(not 0 <= t < VOCAB for t in prompt):
        bad.add("prompt_token_ids")
    if s.max_tokens >= 1 and len(prompt) + s.max_tokens > CONTEXT:
        bad.add("context")
    if any(not 0 <= t < VOCAB for t in prior) or (s.max_tokens >= 1 and len(prior) >= s.max_tokens):
        bad.add("prior_output_token_ids")
    if prior and (prior[-1] in s.stop_token_ids or (not s.ignore_eos and prior[-1] in EOS)):
        bad.add("stop token")
    kv = req.kv_timeout_s
    if not (math.isfinite(kv) and 0 < kv <= MAX_KV_TIMEOUT_S) and not (req.local_prefill and kv == 0):
        bad.add("kv_timeout_s")
    return bad


_ADDRESS = re.compile(r"(?:[A-Za-z0-9._-]+|\[[0-9A-Za-z.:%_-]+\]):([0-9]+)")


def prefill_problems(req: worker_pb2.PrefillRequest) -> set[str]:
    s, ids, blocks, first = req.sampling, list(req.token_ids), list(req.dst_block_ids), req.first_output_index
    bad = _id_problems(req.request_id) | _sampling_problems(s)
    if not ids or len(ids) >= CONTEXT or any(not 0 <= t < VOCAB for t in ids):
        bad.add("token_ids")
    if s.max_tokens >= 1:
        if not 0 <= first < s.max_tokens:
            bad.add("first_output_index")
        elif first >= len(ids) or len(ids) - first + s.max_tokens > CONTEXT:
            bad.add("context")
    if len(blocks) != -(-len(ids) // BLOCK):
        bad.add("destination blocks")
    if any(b < 0 for b in blocks) or len(set(blocks)) != len(blocks):
        bad.add("dst_block_ids")
    address = req.dst_kv_address
    m = _ADDRESS.fullmatch(address)
    if len(address) > MAX_KV_ADDRESS_CHARS or not m or not 1 <= int(m.group(1)) <= 65535:
        bad |= {"dst_kv_address", "KV address", "KV transport"}
    return bad

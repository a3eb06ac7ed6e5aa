"""vLLM's ``--max-model-len`` through the cluster: a Mistral checkpoint whose sliding window (48 tokens) is
shorter than its 256-token context is refused at its full context, and served at a context of its window:
token-exact against ``transformers`` (whose window then masks nothing), requests beyond the served context
refused by the router, over gRPC and HTTP, and the KV pools sized for the served context, not the checkpoint's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import grpc
import pytest

from pdserve.cluster.args import context_length
from pdserve.deploy.config import EMBEDDED_MODEL, ClusterConfig
from pdserve.prefill_worker.config import PrefillWorkerConfig
from tests.clusters import Cluster
from tests.conftest import hf_greedy
from tests.family_checkpoints import hf_model, random_prompt, write_checkpoint
from tests.http_helpers import raw

WINDOW, BLOCK, BLOCKS = 48, 5, 16     # 16 blocks of 5 hold 80 tokens: one prompt of the served 48, not of 256


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    return write_checkpoint("mistral", tmp_path_factory.mktemp("window"), seed=3, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def served(windowed, redis_url):
    c = Cluster(windowed, redis_url, block_size=BLOCK, num_blocks=BLOCKS, max_model_len=WINDOW,
                prefill_flags={"max_num_batched_tokens": 8},
                router_flags={"max_model_len": WINDOW, "http_port": 0})
    try:
        yield c
    finally:
        c.stop()


def test_greedy_matches_transformers_up_to_the_served_context(served, windowed):
    """Prompts and outputs that fill the 48-token context exactly, through chunked prefill (8-token chunks)."""
    hf = hf_model(windowed)
    assert hf.config.sliding_window == WINDOW
    for n in (1, 20, 40, 47):
        ids = random_prompt(n, seed=n)
        done = served.complete(ids, max_tokens=WINDOW - n, temperature=0.0)
        assert done.token_ids == hf_greedy(hf, ids, WINDOW - n), f"prompt of {n} tokens"
    served.assert_pools_free()


@pytest.mark.parametrize("prompt,max_tokens", [(40, 9), (48, 1), (1, 48)])
def test_requests_beyond_the_served_context_are_refused(served, prompt, max_tokens):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        served.complete(random_prompt(prompt, seed=1), max_tokens=max_tokens)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"exceeds the model's context of {WINDOW} tokens" in err.value.details(), err.value.details()
    served.assert_pools_free()


def test_http_reports_and_enforces_the_served_context(served):
    status, _, body = raw(served.router.http_address, "/v1/models")
    assert status == 200 and b'"max_model_len":48' in body.replace(b" ", b""), body
    over = {"model": json.loads(body)["data"][0]["id"], "prompt": random_prompt(40, seed=2), "max_tokens": 9}
    status, _, body = raw(served.router.http_address, "/v1/completions", over)
    assert status == 400 and b"context of 48 tokens" in body, body
    status, _, body = raw(served.router.http_address, "/v1/completions", over | {"max_tokens": 8})
    assert status == 200, body


def test_the_full_context_is_refused_for_the_window_and_the_pool(windowed):
    """Without --max-model-len the checkpoint's 256-token context is served: its window is refused at load,
    and the cluster's start-up check says which --max-model-len serves it."""
    cfg = ClusterConfig(model_dir=windowed, max_model_len=0)
    with pytest.raises(ValueError, match=r"sliding_window 48 .*256-token context.*--max-model-len 48 or less"):
        cfg.check_roles()
    for bad, match in ((257, "max_model_len 257 is longer than the checkpoint's context"),
                       (49, "shorter than the 49-token context")):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(cfg, max_model_len=bad).check_roles()
    ok = dataclasses.replace(cfg, max_model_len=WINDOW)
    ok.check_roles()
    assert ok.router_config().max_model_len == WINDOW
    assert {ok.worker_config(role, "w").max_model_len for role in ("prefill", "decode", "both")} == {WINDOW}


def test_the_prefill_pool_is_sized_for_the_served_context():
    """A prefill pool must hold one prompt of the served context: 16 blocks of 5 tokens hold 80, not 512."""
    from pdserve.model.loader import load_model
    from pdserve.prefill_worker.engine import PrefillEngine

    kw = dict(model_dir=EMBEDDED_MODEL, worker_id="p", block_size=BLOCK, num_blocks=BLOCKS, warmup=False)
    for served_len in (0, 81):
        with pytest.raises(ValueError, match=r"cannot hold one prompt .*--max-model-len"):
            PrefillEngine(PrefillWorkerConfig(**kw, max_model_len=served_len),
                          *load_model(EMBEDDED_MODEL, max_model_len=served_len))
    engine = PrefillEngine(PrefillWorkerConfig(**kw, max_model_len=80), *load_model(EMBEDDED_MODEL, max_model_len=80))
    try:
        assert engine.model_cfg.max_model_len == 80
    finally:
        engine.sender.close()


def test_context_lengths_read_as_vllm_reads_them():
    assert [context_length(t) for t in ("4096", "4k", "4K", "25.6k", "1M", "2g")] == [
        4096, 4000, 4096, 25600, 1 << 20, 2 * 10**9]
    for bad in ("-1", "4.5", "1.0001k", "four", "", "4KiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            context_length(bad)

"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``; the completions API's ``echo``) against
``transformers``: computed by the prefill worker over chunked prompts without the prefix cache, and by a
colocated worker's local prefill; sent once, on the first message; echoed over HTTP in OpenAI's shape."""

from __future__ import annotations

import grpc
import openai
import pytest
import torch

from pdserve.deploy import client
from pdserve.proto import pdserve_pb2
from tests.clusters import Cluster, colocated_cluster

pytestmark = pytest.mark.timeout(180)

TOP = 3


@pytest.fixture(scope="module")
def disaggregated(redis_url, model_dir):
    """fp32 workers, the prefill worker in 64-token chunks, and the HTTP API."""
    c = Cluster(model_dir, redis_url, dtype="float32", prefill_flags={"max_num_batched_tokens": 64},
                router_flags={"http_port": 0})
    yield c
    c.stop()


@pytest.fixture(scope="module")
def colocated(redis_url, model_dir):
    c = colocated_cluster(model_dir, redis_url, max_num_batched_tokens=24, dtype="float32")
    yield c
    c.stop()


def prompt_of(n: int, seed: int) -> list[int]:
    return [1] + torch.randint(3, 2048, (n - 1,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(hf_model, prompt: list[int]) -> torch.Tensor:
    """``transformers``' log-softmax at every prompt position ``[len(prompt), vocab]``."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check_against(hf_model, prompt: list[int], got) -> None:
    assert [lp.token_id for lp in got] == prompt
    assert got[0].logprob == 0 and not got[0].top        # nothing comes before the first token
    ref = reference(hf_model, prompt)
    for i in range(1, len(prompt)):
        assert got[i].logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=2e-3), i
        top = ref[i - 1].topk(TOP)
        assert [a.token_id for a in got[i].top] == top.indices.tolist(), i
        assert [a.logprob for a in got[i].top] == pytest.approx(top.values.tolist(), abs=2e-3)
        assert got[i].token and all(a.token is not None for a in got[i].top)


def messages(cluster: Cluster, request: pdserve_pb2.GenerateRequest) -> list[pdserve_pb2.GenerateResponse]:
    async def go(channel):
        return [m async for m in client.stream(channel, request, timeout_s=60)]
    return cluster.run(go)


def test_prompt_logprobs_match_transformers_over_chunks_and_skip_the_prefix_cache(disaggregated, hf_model):
    prompt = prompt_of(150, 0)   # three 64-token chunks
    for attempt in range(2):     # the second would have hit the prefix cache
        msgs = messages(disaggregated, client.make_request(prompt, max_tokens=4, temperature=0,
                                                           prompt_logprobs=TOP))
        check_against(hf_model, prompt, msgs[0].prompt_logprobs)
        assert not any(m.prompt_logprobs for m in msgs[1:])   # once, on the first message
        assert msgs[-1].final.usage.cached_prompt_tokens == 0
    plain = messages(disaggregated, client.make_request(prompt, max_tokens=4, temperature=0))
    assert not plain[0].prompt_logprobs and plain[-1].final.usage.cached_prompt_tokens > 0   # the cache still serves
    assert [t for m in plain for t in m.token_ids] == [t for m in msgs for t in m.token_ids]
    disaggregated.assert_pools_free()


def test_a_colocated_worker_computes_them_in_its_mixed_steps(colocated, hf_model):
    prompt = prompt_of(61, 1)    # three 24-token chunks of the local prefill
    msgs = messages(colocated, client.make_request(prompt, max_tokens=3, temperature=0, prompt_logprobs=TOP))
    check_against(hf_model, prompt, msgs[0].prompt_logprobs)
    assert not any(m.prompt_logprobs for m in msgs[1:])
    colocated.assert_pools_free()


@pytest.mark.parametrize("value", [-1, 21])
def test_out_of_range_is_invalid_argument(disaggregated, value):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        messages(disaggregated, client.make_request("Hi", prompt_logprobs=value))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in info.value.details()


def test_no_more_entries_than_one_message_carries(model_dir):
    """Prompt tokens x (alternatives + 1) at most MAX_PROMPT_LOGPROB_ENTRIES: the router's check, on a context
    long enough to pass it (the embedded model's 512 tokens cannot)."""
    from dataclasses import replace

    from pdserve.model.config import ModelConfig
    from pdserve.model.tokenizer import Tokenizer
    from pdserve.router.validation import MAX_PROMPT_LOGPROB_ENTRIES, validate

    cfg = replace(ModelConfig.from_hf_dir(model_dir), max_position_embeddings=1 << 20, max_model_len=1 << 20)
    tokenizer = Tokenizer(model_dir, 1)
    fits = MAX_PROMPT_LOGPROB_ENTRIES // 21
    assert validate(client.make_request([5] * fits, prompt_logprobs=20), cfg, tokenizer, 16).sampling.prompt_logprobs
    with pytest.raises(ValueError, match="more than the 65536"):
        validate(client.make_request([5] * (fits + 1), prompt_logprobs=20), cfg, tokenizer, 16)
    assert validate(client.make_request([5] * (fits + 1), prompt_logprobs=2), cfg, tokenizer, 16)


def test_a_one_token_prompt_has_its_one_entry(disaggregated, colocated):
    for c in (disaggregated, colocated):
        msgs = messages(c, client.make_request([1], max_tokens=2, temperature=0, prompt_logprobs=2))
        assert [(lp.token_id, lp.logprob, len(lp.top)) for lp in msgs[0].prompt_logprobs] == [(1, 0.0, 0)]


def test_http_echo_gives_the_prompt_and_its_logprobs(disaggregated):
    api = openai.OpenAI(base_url=f"http://{disaggregated.router.http_address}/v1", api_key="unused", max_retries=0)
    prompt = "Once upon a time, there was a little dog named Max."
    grpc_msgs = messages(disaggregated, client.make_request(prompt, max_tokens=1, temperature=0, prompt_logprobs=1))
    expected = grpc_msgs[0].prompt_logprobs
    assert len(expected) > 5
    # lm-evaluation-harness' loglikelihood request: echo, logprobs 1, one token
    got = api.completions.create(model=disaggregated.model.rsplit("/", 1)[-1], prompt=prompt, max_tokens=1,
                                 temperature=0, echo=True, logprobs=1)
    lp = got.choices[0].logprobs
    assert got.choices[0].text.startswith(prompt) and len(got.choices[0].text) > len(prompt)
    assert len(lp.tokens) == len(expected) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(expected)] == pytest.approx([e.logprob for e in expected[1:]], abs=1e-6)
    assert lp.tokens[:len(expected)] == [e.token for e in expected]
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = list(api.completions.create(model=got.model, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                           stream=True))
    assert streamed[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in streamed if c.choices).startswith(prompt)
    no_logprobs = api.completions.create(model=got.model, prompt=prompt, max_tokens=2, temperature=0, echo=True)
    assert no_logprobs.choices[0].text.startswith(prompt) and no_logprobs.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):   # refused by name, not a 500
        api.completions.create(model=got.model, prompt=[-1, 5], max_tokens=2, echo=True, logprobs=1)
    disaggregated.assert_pools_free()


def test_http_vllm_prompt_logprobs_with_ranks(disaggregated, hf_model):
    """vLLM's ``prompt_logprobs`` over HTTP: None for the first token, then each token's logprob and rank (tokens
    at least as likely) with its alternatives ranked 1, 2, 3, against transformers; refused with ``stream`` and
    beside a different ``echo`` ``logprobs``."""
    from pdserve.router.http.reply import Choice, Reply

    api = openai.OpenAI(base_url=f"http://{disaggregated.router.http_address}/v1", api_key="unused", max_retries=0)
    model = disaggregated.model.rsplit("/", 1)[-1]
    prompt = prompt_of(40, seed=5)
    got = api.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                 extra_body={"prompt_logprobs": TOP}).choices[0].model_extra["prompt_logprobs"]
    ref = reference(hf_model, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry = list(got[i].items())
        token, own = entry[0]
        want_rank = int((ref[i - 1] >= ref[i - 1, prompt[i]]).sum())
        assert int(token) == prompt[i] and own["logprob"] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=2e-3)
        assert abs(own["rank"] - want_rank) <= 1 and own["decoded_token"] is not None, (i, own, want_rank)
        assert {int(t) for t, _ in entry} == {prompt[i], *ref[i - 1].topk(TOP).indices.tolist()}
        assert [v["rank"] for _, v in entry[1:]] == sorted(v["rank"] for _, v in entry[1:]) and all(
            1 <= v["rank"] <= TOP for _, v in entry[1:])
    for extra, words in (({"prompt_logprobs": 1, "stream": True}, "stream"),
                         ({"prompt_logprobs": 2, "echo": True, "logprobs": 1}, "must equal")):
        with pytest.raises(openai.BadRequestError, match=words):
            api.completions.create(model=model, prompt=prompt, max_tokens=1, extra_body=extra)
    disaggregated.assert_pools_free()
    # a chat response carries them once, beside its choices, as vLLM's does
    lps = [pdserve_pb2.TokenLogprob(token_id=1),
           pdserve_pb2.TokenLogprob(token_id=7, logprob=-2.0, token="a", rank=3,
                                    top=[pdserve_pb2.TopLogprob(token_id=9, logprob=-0.5, token="b")])]
    body = Reply(True, "m", False, prompt_logprobs=True).response([Choice(0, "hi", prompt_logprobs=lps)])
    assert body["prompt_logprobs"] == [None, {"7": {"logprob": -2.0, "rank": 3, "decoded_token": "a"},
                                              "9": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}]

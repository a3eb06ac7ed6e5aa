"""The OpenAI-compatible HTTP API (router/http/) against live clusters of real processes, through the
official ``openai`` client: completions and chat, streamed or not, greedy output equal to the gRPC
API's; refusals as OpenAI errors (every parameter the router does not implement named in a 400, 404 for
another model, 429 with Retry-After when KV blocks run out, 400 when no KV pool could ever hold the
request); a client that disconnects mid-stream frees its blocks; /v1/models, /health, /metrics. Behind a
token, over TLS and from ``pdserve up``: test_http_deploy.py."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import time

import grpc
import openai
import pytest

from pdserve.deploy import client
from pdserve.model.chat_template import ChatTemplate
from pdserve.proto import pdserve_pb2
from tests.clusters import Cluster
from tests.conftest import CHAT_MODEL as MODEL
from tests.http_helpers import MESSAGES, PROMPTS, raw

pytestmark = pytest.mark.timeout(180)



@pytest.fixture(autouse=True)
def no_env_token(monkeypatch):
    monkeypatch.delenv("PDSERVE_ROUTER_TOKEN", raising=False)


@pytest.fixture
def api(http_cluster):
    """An OpenAI client of the cluster's HTTP API (no retries); the pools are checked free after the test."""
    yield openai.OpenAI(base_url=f"http://{http_cluster.router.http_address}/v1", api_key="unused", max_retries=0)
    http_cluster.assert_pools_free()


def test_models_health_and_metrics(http_cluster, api):
    address = http_cluster.router.http_address
    assert [m.id for m in api.models.list().data] == [MODEL]
    assert api.models.retrieve(MODEL).owned_by == "pdserve"
    status, _, body = raw(address, "/health")
    assert status == 200 and json.loads(body) == {"status": "ok", "workers": {"prefill": 1, "decode": 1, "both": 0}}
    status, headers, _ = raw(address, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    status, _, body = raw(address, "/v1/nothing-here")
    assert status == 404 and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_completions_equal_the_grpc_api_greedy(http_cluster, api):
    for prompt in PROMPTS:
        want = http_cluster.complete(prompt, max_tokens=24, temperature=0)
        got = api.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"return_token_ids": True})
        (choice,) = got.choices
        assert choice.text == want.text and choice.model_extra["token_ids"] == want.token_ids
        assert choice.finish_reason == "length" and got.model == MODEL and got.object == "text_completion"
        assert got.usage.prompt_tokens == want.final.usage.prompt_tokens and got.usage.completion_tokens == 24
        assert got.usage.total_tokens == got.usage.prompt_tokens + 24
        chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"return_token_ids": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
        assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == want.token_ids
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_token_prompts_and_lists_of_prompts(http_cluster, api):
    ids = [1, *range(100, 110)]
    want_ids = http_cluster.complete(ids, max_tokens=12, temperature=0)
    tokens = api.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert tokens.usage.prompt_tokens == 11 and tokens.choices[0].text == want_ids.text
    token_lists = api.completions.create(model=MODEL, prompt=[ids, ids[:5]], max_tokens=12, temperature=0)
    assert [c.index for c in token_lists.choices] == [0, 1] and token_lists.choices[0].text == want_ids.text
    want = [http_cluster.complete(p, max_tokens=12, temperature=0) for p in PROMPTS]
    many = api.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2] and [c.text for c in many.choices] == [w.text for w in want]
    assert many.usage.completion_tokens == 36
    streamed = {}
    for chunk in api.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {i: w.text for i, w in enumerate(want)}


def test_chat_completions_equal_the_grpc_api_greedy(http_cluster, api, chat_model_dir):
    template = ChatTemplate.load(chat_model_dir)
    prompt_ids = template.encode(template.render(MESSAGES))
    want = http_cluster.complete(prompt_ids, max_tokens=20, temperature=0)
    got = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=20, temperature=0)
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(prompt_ids) and got.object == "chat.completion"
    chunks = list(api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
                                              stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    parts = [{"type": "text", "text": "A dog"}, {"type": "text", "text": "and a cat"}]
    joined = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=8,
                                         temperature=0)
    same = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A dog\nand a cat"}],
                                       max_tokens=8, temperature=0)
    assert joined.choices[0].message.content == same.choices[0].message.content


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(http_cluster, api):
    got = api.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, seed=1,
                                      extra_body={"ignore_eos": True, "top_k": -1})
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens + got.usage.completion_tokens == 512  # the model's context


def test_disconnect_mid_stream_frees_every_block(http_cluster, api):
    prompt = "Once upon a time"
    start = time.monotonic()
    whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=490, temperature=0,
                                   extra_body={"ignore_eos": True})
    full_s = time.monotonic() - start
    assert whole.usage.completion_tokens == 490
    for _ in range(3):
        stream = api.completions.create(model=MODEL, prompt=prompt, max_tokens=490, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices[0].text
        stream.close()  # the client goes away after its first chunk
        gone = time.monotonic()
        while any(w.num_router_inflight for w in http_cluster.state().workers):
            assert time.monotonic() - gone < max(0.5, full_s / 2), "the request was not cancelled"
            time.sleep(0.01)
    body = json.dumps({"prompt": prompt, "max_tokens": 490, "temperature": 0, "ignore_eos": True}).encode()
    host, port = http_cluster.router.http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:  # not streamed: gone while the answer is made
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while not any(w.num_router_inflight for w in http_cluster.state().workers):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    gone = time.monotonic()
    while any(w.num_router_inflight for w in http_cluster.state().workers):
        assert time.monotonic() - gone < max(0.5, full_s / 2), "the request was not cancelled"
        time.sleep(0.01)
    http_cluster.assert_pools_free()
    assert api.completions.create(model=MODEL, prompt="Hi", max_tokens=4).usage.completion_tokens == 4


REFUSED = [  # (endpoint, parameter, value): each must be named in a 400
    ("chat", "top_logprobs", 2),  # without `logprobs`: true
    ("chat", "functions", [{"name": "f"}]), ("chat", "function_call", "auto"),
    ("completions", "best_of", 2), ("completions", "suffix", "!"),
    ("completions", "presence", 1), ("chat", "bad_word", ["dog"]), ("completions", "stream_options",
                                                             {"include_usage": True}),
    ("chat", "store", True), ("completions", "service_tier", "flex"),
    ("chat", "reasoning_effort", "low"),    # the embedded model's template does not read it
]


@pytest.mark.parametrize("endpoint, name, value", REFUSED, ids=[f"{e}-{n}-{v}" for e, n, v in REFUSED])
def test_each_unimplemented_parameter_is_named_in_a_400(http_cluster, api, endpoint, name, value):
    body = {"model": MODEL, "max_tokens": 4, name: value}
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            api.chat.completions.create(messages=MESSAGES, extra_body=body, model=MODEL)
        else:
            api.completions.create(prompt="Hi", extra_body=body, model=MODEL)
    assert f"`{name}`" in info.value.message and info.value.body["param"] == name
    assert info.value.body["type"] == "invalid_request_error"


def test_tools_need_a_tool_call_parser_unless_tool_choice_is_none(http_cluster, api):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, max_tokens=2)
    assert "--tool-call-parser" in info.value.message and info.value.body["param"] == "tool_choice"
    got = api.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, tool_choice="none", max_tokens=2,
                                      parallel_tool_calls=False)
    assert got.usage.completion_tokens == 2 and not got.choices[0].message.tool_calls


def test_neutral_values_of_unimplemented_parameters_are_accepted(http_cluster, api):
    got = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, n=1, stop=[], logprobs=False,
                                      presence_penalty=0, frequency_penalty=0.0, logit_bias={},
                                      response_format={"type": "text"}, user="someone")
    assert got.usage.completion_tokens == 3
    # OpenAI fields that change no answer here, as SDKs and agents send them
    got = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, store=False,
                                      metadata={"team": "a"}, service_tier="auto", prompt_cache_key="conv-1",
                                      safety_identifier="u-1", extra_body={"cache_salt": "tenant-1"})
    assert got.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="cache_salt of 257 characters"):
        api.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"cache_salt": "x" * 257})


BAD = [  # the gRPC API's bad inputs, through HTTP: the same message
    ({"prompt": "Hi", "temperature": -0.5}, client.make_request("Hi", temperature=-0.5)),
    ({"prompt": "Hi", "top_p": 0.0}, client.make_request("Hi", top_p=0.0)),
    ({"prompt": "Hi", "max_tokens": 0}, client.make_request("Hi", max_tokens=0)),
    ({"prompt": [1, 2048]}, client.make_request([1, 2048])),
    ({"prompt": ""}, pdserve_pb2.GenerateRequest(text="")),
    ({"prompt": []}, client.make_request([])),
    ({"prompt": [1] * 500, "max_tokens": 13}, client.make_request([1] * 500, max_tokens=13)),
    ({"prompt": "Hi", "top_k": -2}, client.make_request("Hi", top_k=-2)),
    ({"prompt": "Hi", "min_p": 1.5}, client.make_request("Hi", min_p=1.5)),
    ({"prompt": "Hi", "stop_token_ids": [5000]}, client.make_request("Hi", stop_token_ids=(5000,))),
    ({"prompt": "Hi", "presence_penalty": 2.5}, client.make_request("Hi", presence_penalty=2.5)),
    ({"prompt": "Hi", "repetition_penalty": -1}, client.make_request("Hi", repetition_penalty=-1)),
    ({"prompt": "Hi", "logit_bias": {"5000": 1}}, client.make_request("Hi", logit_bias={5000: 1})),
    ({"prompt": "Hi", "max_tokens": 4, "min_tokens": 5}, client.make_request("Hi", max_tokens=4, min_tokens=5)),
]


@pytest.mark.parametrize("body, request_", BAD, ids=[json.dumps(b)[:40] for b, _ in BAD])
def test_bad_input_gets_the_grpc_apis_message(http_cluster, api, body, request_):
    with pytest.raises(grpc.aio.AioRpcError) as grpc_info:
        http_cluster.run(lambda ch: client.complete(ch, request_, timeout_s=30))
    assert grpc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=MODEL, prompt=body["prompt"], extra_body={k: v for k, v in body.items()
                                                                               if k != "prompt"})
    assert info.value.body["message"] == grpc_info.value.details()


def test_malformed_bodies_are_400s_naming_the_field(http_cluster, api):
    address = http_cluster.router.http_address
    for body, words in ((b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"),
                        ({"prompt": "Hi", "max_tokens": "16"}, "`max_tokens`"), ({"prompt": {"a": 1}}, "`prompt`"),
                        ({"messages": []}, "`messages`"), ({"prompt": "Hi", "seed": -1}, "`seed`")):
        path = "/v1/chat/completions" if "messages" in str(body) else "/v1/completions"
        status, _, answer = raw(address, path, body)
        assert status == 400 and words in json.loads(answer)["error"]["message"], answer
    conn = http.client.HTTPConnection(address, timeout=30)  # refused on its declared size, before its body
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", str(4 * 1024 * 1024 + 1))
    conn.endheaders()
    answer = conn.getresponse()
    assert answer.status == 413 and "max_receive_message_bytes" in json.loads(answer.read())["error"]["message"]
    conn.close()


def test_unknown_model_is_404(http_cluster, api):
    for call in (lambda: api.completions.create(model="gpt-4o", prompt="Hi"),
                 lambda: api.chat.completions.create(model="gpt-4o", messages=MESSAGES),
                 lambda: api.models.retrieve("gpt-4o")):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert "gpt-4o" in info.value.message and info.value.body["code"] == "model_not_found"


@pytest.fixture(scope="module")
def small_cluster(redis_url, model_dir):
    """The embedded model (no chat template) with 8 KV blocks of 16 tokens on its decode worker."""
    c = Cluster(model_dir, redis_url, decode_flags={"num_blocks": 8}, router_flags={"http_port": 0})
    yield c
    c.stop()


def test_no_kv_room_is_429_with_retry_after_and_no_template_is_400(small_cluster):
    """7 usable blocks of 16 tokens: a request they can never hold is a 400; one that fits while another
    request holds the pool (its prompt's blocks taken, its prefill worker stopped) is a 429 to retry."""
    from concurrent.futures import ThreadPoolExecutor

    api = openai.OpenAI(base_url=f"http://{small_cluster.router.http_address}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:   # prompt + 200 tokens: no pool holds it, ever
        api.completions.create(model="tinystories-656k", prompt="Once upon a time", max_tokens=200)
    assert info.value.status_code == 400 and "KV pool" in info.value.message
    prefill = small_cluster.worker("p0").proc
    prefill.send_signal(signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        try:        # 90 tokens: 6 blocks held on the decode worker while the prompt waits for its prefill
            holder = pool.submit(api.completions.create, model="tinystories-656k", max_tokens=10,
                                 prompt=[1] + list(range(100, 189)))
            deadline = time.monotonic() + 10
            while not any(w.role == "decode" and w.num_waiting == 1 for w in small_cluster.state().workers):
                assert time.monotonic() < deadline, "the holding request never reached the decode worker"
                time.sleep(0.05)
            with pytest.raises(openai.RateLimitError) as info:   # 20 tokens: 2 blocks, 1 is free
                api.completions.create(model="tinystories-656k", prompt=[1] + list(range(300, 319)), max_tokens=10)
            assert info.value.status_code == 429 and "KV blocks" in info.value.message
            assert int(info.value.response.headers["Retry-After"]) >= 1
            with pytest.raises(openai.RateLimitError):  # streamed: refused before the stream starts
                api.completions.create(model="tinystories-656k", prompt=[1] + list(range(300, 319)), max_tokens=10,
                                       stream=True)
        finally:
            prefill.send_signal(signal.SIGCONT)
        assert holder.result(timeout=60).usage.completion_tokens >= 1
    assert api.completions.create(model="tinystories-656k", prompt="Once", max_tokens=100,
                                  extra_body={"ignore_eos": True}).usage.completion_tokens == 100  # fits: served
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model="tinystories-656k", messages=MESSAGES)
    assert "no chat template" in info.value.message
    small_cluster.assert_pools_free()


def test_priority_needs_the_priority_scheduling_policy(http_cluster, api, model_dir):
    """vLLM's ``priority`` is refused by a router that schedules in arrival order (as vLLM refuses it without
    ``--scheduling-policy priority``); with that policy it reaches the workers with the sampling parameters."""
    from pdserve.model.config import ModelConfig
    from pdserve.model.tokenizer import Tokenizer
    from pdserve.proto.convert import sampling_from_wire, sampling_to_wire
    from pdserve.router.validation import validate

    with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority") as info:
        api.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": 3})
    assert info.value.status_code == 400
    assert api.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                  extra_body={"priority": 0}).usage.completion_tokens == 2
    cfg, tok = ModelConfig.from_hf_dir(model_dir), Tokenizer(model_dir, 1)
    req = client.make_request("Hi", max_tokens=2)
    req.priority = -7
    valid = validate(req, cfg, tok, 16, priority_scheduling=True)
    assert valid.sampling.priority == -7 and sampling_from_wire(sampling_to_wire(valid.sampling)).priority == -7


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(http_cluster, api):
    """vLLM's ``stream_options.continuous_usage_stats``: each chunk's usage counts its choice's tokens so far."""
    for options, has in (({"include_usage": True, "continuous_usage_stats": True}, True),
                         ({"include_usage": True}, False)):
        chunks = list(api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                             stream=True, stream_options=options, extra_body={"ignore_eos": True}))
        last = chunks[-1].usage
        assert last.completion_tokens == 6 and not chunks[-1].choices
        body = [c for c in chunks if c.choices]
        assert all((c.usage is not None) == has for c in body)
        if has:
            counts = [c.usage.completion_tokens for c in body]
            assert counts == sorted(counts) and counts[-1] == 6
            assert {c.usage.prompt_tokens for c in body} == {last.prompt_tokens}
            assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in body)
    http_cluster.assert_pools_free()


def test_completions_add_special_tokens_false_leaves_the_bos_out(http_cluster, api):
    """vLLM's ``add_special_tokens`` on completions: false tokenizes a text prompt without the BOS the router
    adds, as ``/tokenize`` with the same flag counts it (the embedded model adds one)."""
    from tests.http_helpers import raw

    text = "Once upon a time, there was a little dog"
    counts = {}
    for add in (True, False):
        status, _, out = raw(http_cluster.router.http_address, "/tokenize",
                             {"model": MODEL, "prompt": text, "add_special_tokens": add})
        assert status == 200, out
        got = api.completions.create(model=MODEL, prompt=text, max_tokens=2, echo=True,
                                     extra_body={"add_special_tokens": add})
        counts[add] = got.usage.prompt_tokens
        assert counts[add] == json.loads(out)["count"] and got.choices[0].text.startswith(text)
    assert counts[False] == counts[True] - 1

"""Stop strings, log-probabilities and ``n`` sequences against a live cluster of real processes
(1 prefill + 1 decode worker + a router with its HTTP API), through gRPC and the official ``openai``
client: log-probabilities equal ``transformers``' log-softmax (fp32) for the first token (sampled by
the prefill worker) and the later ones (the decode worker), top-N ids equal its topk; stop strings cut
exactly, also across tokens, with held text released (stream == non-stream); ``n=3`` reproducible per
seed, sequence i equal to a single request seeded ``seed + i``, the prompt counted once; pools free."""

from __future__ import annotations

import grpc
import openai
import pytest
import torch

from pdserve.proto import pdserve_pb2, pdserve_pb2_grpc
from tests.clusters import Cluster
from tests.conftest import CHAT_MODEL as MODEL

pytestmark = pytest.mark.timeout(180)

PROMPT = "Once upon a time, there was a little dog"


@pytest.fixture
def cl(http_cluster):
    yield http_cluster
    http_cluster.assert_pools_free()


@pytest.fixture
def api(cl):
    return openai.OpenAI(base_url=f"http://{cl.router.http_address}/v1", api_key="unused", max_retries=0)


def request(prompt=PROMPT, **sampling) -> pdserve_pb2.GenerateRequest:
    stop = sampling.pop("stop", ())
    return pdserve_pb2.GenerateRequest(text=prompt, sampling=pdserve_pb2.SamplingParams(stop=stop, **sampling))


def messages(cl: Cluster, req: pdserve_pb2.GenerateRequest) -> list[pdserve_pb2.GenerateResponse]:
    async def go(channel):
        return [m async for m in pdserve_pb2_grpc.RouterStub(channel).Generate(req, timeout=60)]
    return cl.run(go)


def by_index(msgs) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for m in msgs:
        seq = out.setdefault(m.index, {"text": "", "ids": [], "logprobs": [], "final": None})
        seq["text"] += m.text
        seq["ids"] += list(m.token_ids)
        seq["logprobs"] += list(m.logprobs)
        if m.HasField("final"):
            seq["final"] = m.final
    return out


def hf_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """``[len(output_ids), vocab]``: transformers' log-softmax at each output position."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1:len(prompt_ids) + len(output_ids) - 1]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_transformers_for_prefill_and_decode_tokens(cl, hf_model, temperature):
    from pdserve.model.tokenizer import Tokenizer
    msgs = messages(cl, request(max_tokens=8, temperature=temperature, seed=3, ignore_eos=True, logprobs=5))
    seq = by_index(msgs)[0]
    assert len(seq["logprobs"]) == len(seq["ids"]) == 8
    prompt_ids = Tokenizer(cl.model, 1).encode(PROMPT)
    want = hf_logprobs(hf_model, prompt_ids, seq["ids"])
    for pos, (tok, lp) in enumerate(zip(seq["ids"], seq["logprobs"])):  # pos 0: the prefill worker's token
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(want[pos, tok].item(), abs=1e-4)
        top = want[pos].topk(5)
        assert [a.token_id for a in lp.top] == top.indices.tolist()
        assert [a.logprob for a in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert all(a.token for a in lp.top)
    plain = by_index(messages(cl, request(max_tokens=8, temperature=temperature, seed=3, ignore_eos=True)))[0]
    assert plain["ids"] == seq["ids"] and not plain["logprobs"]  # logprobs change nothing else


def test_logprobs_zero_gives_only_the_sampled_token_and_limits_are_refused(cl):
    seq = by_index(messages(cl, request(max_tokens=3, temperature=0, logprobs=0)))[0]
    assert len(seq["logprobs"]) == len(seq["ids"]) and all(not lp.top for lp in seq["logprobs"])
    for bad in (dict(logprobs=21), dict(n=17), dict(n=0), dict(stop=[""])):
        with pytest.raises(grpc.RpcError) as info:
            messages(cl, request(max_tokens=3, **bad))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_stop_string_across_tokens_cuts_exactly_and_frees_blocks(cl, api):
    full_msgs = messages(cl, request(max_tokens=24, temperature=0, ignore_eos=True))
    full = "".join(m.text for m in full_msgs)
    texts = [m.text for m in full_msgs]
    k = next(i for i in range(2, len(texts) - 1) if len(texts[i]) >= 2 and len(texts[i + 1]) >= 2)
    stop = texts[k][-1] + texts[k + 1][:2]  # spans the boundary of tokens k and k+1
    cut = full.index(stop)
    msgs = messages(cl, request(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop, "never seen"]))
    seq = by_index(msgs)[0]
    assert seq["text"] == full[:cut]
    assert seq["final"].finish_reason == pdserve_pb2.FINISH_REASON_STOP
    assert seq["final"].usage.completion_tokens == len(seq["ids"]) < 24
    # a stop string that never matches: held text is released, the text is whole
    partial = full[-1] + "\u2603"  # its first character shows up, then cannot complete
    seq = by_index(messages(cl, request(max_tokens=24, temperature=0, ignore_eos=True, stop=[partial])))[0]
    assert seq["text"] == full and seq["final"].finish_reason == pdserve_pb2.FINISH_REASON_LENGTH
    # through the HTTP API, streamed and not
    whole = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                   extra_body={"ignore_eos": True})
    assert whole.choices[0].text == full[:cut] and whole.choices[0].finish_reason == "stop"
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                         stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]


def test_stop_reason_and_include_stop_str_in_output(cl, api):
    """What stopped a sequence is reported (vLLM's ``stop_reason``) and left out of its text unless
    ``include_stop_str_in_output``: a stop string, and a stop token that is an ordinary word (not a
    special token, whose text skip_special_tokens would drop anyway)."""
    def run(n, **kw):
        return by_index(messages(cl, request(max_tokens=n, temperature=0, ignore_eos=True, **kw)))[0]

    full = run(24)
    ids = full["ids"]
    j = next(j for j in range(2, 23) if ids[j] not in ids[:j] and run(j + 1)["text"] != run(j)["text"])
    for include, upto in ((False, j), (True, j + 1)):
        seq = run(24, stop_token_ids=[ids[j]], include_stop_str_in_output=include)
        assert seq["ids"] == ids[:j + 1] and seq["final"].finish_reason == pdserve_pb2.FINISH_REASON_STOP
        assert seq["text"] == run(upto)["text"], include
        assert seq["final"].WhichOneof("stop_reason") == "stop_token_id" and seq["final"].stop_token_id == ids[j]
    stop = full["text"][len(run(4)["text"]):][:3]          # a stop string from the fifth token on
    cut = full["text"].index(stop)
    for include, end in ((False, cut), (True, cut + len(stop))):
        seq = run(24, stop=["never seen", stop], include_stop_str_in_output=include)
        assert seq["text"] == full["text"][:end] and seq["final"].stop_string == stop
    assert full["final"].WhichOneof("stop_reason") is None          # ended by length
    # through the HTTP API, whole and streamed
    extra = {"ignore_eos": True, "include_stop_str_in_output": True}
    whole = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                   extra_body=extra).choices[0]
    assert whole.text == full["text"][:cut + len(stop)] and whole.stop_reason == stop
    chunks = list(api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True, "stop_token_ids": [ids[j]]}))
    assert "".join(c.choices[0].text for c in chunks) == run(j)["text"]
    assert chunks[-1].choices[0].stop_reason == ids[j] and chunks[-1].choices[0].finish_reason == "stop"
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True}).choices[0]
    assert chat.finish_reason == "length" and chat.stop_reason is None


def test_min_p_one_keeps_only_the_likeliest_token(cl, api):
    """min_p 1 drops every token less likely than the likeliest: a hot sampled answer is the greedy one, on the
    prefill worker's first token and the decode worker's steps, over gRPC and HTTP (vLLM's ``min_p``)."""
    def ids(**kw):
        return by_index(messages(cl, request(max_tokens=12, ignore_eos=True, **kw)))[0]["ids"]
    greedy = ids(temperature=0)
    assert ids(temperature=1.5, seed=7, min_p=1.0) == greedy != ids(temperature=1.5, seed=7)
    got = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.5, seed=7,
                                 extra_body={"min_p": 1.0, "ignore_eos": True, "return_token_ids": True})
    assert got.choices[0].token_ids == greedy


def test_truncate_prompt_tokens_keeps_the_prompts_tail(cl, api):
    """vLLM's left truncation: a prompt past the 512-token context is served on its last k tokens (the same
    answer as those tokens sent alone), -1 keeps what leaves room for max_tokens; 0 is refused by name."""
    ids = [int(t) for t in torch.randint(3, 2000, (700,), generator=torch.Generator().manual_seed(1))]

    def run(prompt, **kw):
        sampling = pdserve_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, **kw)
        req = pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=sampling)
        return by_index(messages(cl, req))[0]
    for k, kept in ((100, 100), (-1, 512 - 8)):
        got = run(ids, truncate_prompt_tokens=k)
        assert got["final"].usage.prompt_tokens == kept and got["ids"] == run(ids[-kept:])["ids"]
    with pytest.raises(grpc.RpcError, match="truncate_prompt_tokens must be -1 or >= 1"):
        run(ids, truncate_prompt_tokens=0)
    got = api.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                 extra_body={"truncate_prompt_tokens": 100, "ignore_eos": True,
                                             "return_token_ids": True})
    assert got.usage.prompt_tokens == 100 and got.choices[0].token_ids == run(ids[-100:])["ids"]


def test_n_sequences_are_reproducible_and_count_the_prompt_once(cl, api):
    req = request(max_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True)
    first, again = by_index(messages(cl, req)), by_index(messages(cl, req))
    assert sorted(first) == [0, 1, 2] and all(s["final"] is not None for s in first.values())
    assert [first[i]["ids"] for i in range(3)] == [again[i]["ids"] for i in range(3)]
    for i in range(3):  # sequence i is the request seeded seed + i
        single = by_index(messages(cl, request(max_tokens=8, temperature=1.0, seed=7 + i, ignore_eos=True)))[0]
        assert single["ids"] == first[i]["ids"]
    assert len({tuple(s["ids"]) for s in first.values()}) > 1
    got = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3,
                                 extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2]
    assert [c.text for c in got.choices] == [first[i]["text"] for i in range(3)]
    assert got.usage.prompt_tokens == first[0]["final"].usage.prompt_tokens
    assert got.usage.completion_tokens == 24


def test_http_logprobs_shapes_completions_and_chat(cl, api):
    seq = by_index(messages(cl, request(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True)))[0]
    got = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                 extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert lp.tokens == [x.token for x in seq["logprobs"]]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in seq["logprobs"]])
    assert [len(t) for t in lp.top_logprobs] == [len({a.token for a in x.top}) for x in seq["logprobs"]]
    assert lp.text_offset[0] == 0 and len(lp.text_offset) == 5
    streamed = list(api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                           stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A dog"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)
    assert all(c.logprob <= 0 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)


def test_speculative_logprobs_come_from_the_target(redis_url, model_dir, hf_model):
    """Speculative decode worker (n-gram proposals): accepted drafts, resampled and bonus tokens all report the target's
    log-softmax at their position (equal to transformers')."""
    from pdserve.model.tokenizer import Tokenizer
    c = Cluster(model_dir, redis_url, block_size=4,
                decode_flags={"speculative": "ngram", "spec_k": 3, "spec_adaptive": False})  # always draft
    try:
        seq = by_index(messages(c, request(max_tokens=40, temperature=0, ignore_eos=True, logprobs=3)))[0]
        assert seq["final"].speculative.num_accepted_tokens > 0
        want = hf_logprobs(hf_model, Tokenizer(model_dir, 1).encode(PROMPT), seq["ids"])
        for pos, (tok, lp) in enumerate(zip(seq["ids"], seq["logprobs"])):
            assert lp.logprob == pytest.approx(want[pos, tok].item(), abs=1e-4)
            assert [a.token_id for a in lp.top] == want[pos].topk(3).indices.tolist()
        c.assert_pools_free()
    finally:
        c.stop()

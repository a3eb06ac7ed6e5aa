"""vLLM's ``/tokenize`` and ``/detokenize`` on a live cluster's router: a prompt's ids are the ids a completion
of it is served with (BOS as the model adds it, or none without special tokens), a conversation's are the
chat endpoint's, token strings on request, text back from ids; bad bodies are 400s in OpenAI's shape."""

from __future__ import annotations

import json

import openai
import pytest

from pdserve.model.tokenizer import Tokenizer
from tests.conftest import CHAT_MODEL as MODEL
from tests.http_helpers import raw

pytestmark = pytest.mark.timeout(120)
TEXT = "Once upon a time, there was a little dog"
MESSAGES = [{"role": "user", "content": "A dog and a cat"}]


@pytest.fixture
def cl(http_cluster):
    yield http_cluster
    http_cluster.assert_pools_free()


def post(cl, path: str, body) -> tuple[int, dict]:
    status, _, answer = raw(cl.router.http_address, path, body)
    return status, json.loads(answer)


def test_tokenize_gives_the_ids_a_request_is_served_with(cl, chat_model_dir):
    tok = Tokenizer(chat_model_dir, 1)
    status, got = post(cl, "/tokenize", {"model": MODEL, "prompt": TEXT})
    assert status == 200 and got["tokens"] == tok.encode(TEXT) and got["tokens"][0] == 1
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 512 and got["token_strs"] is None
    api = openai.OpenAI(base_url=f"http://{cl.router.http_address}/v1", api_key="unused", max_retries=0)
    assert api.completions.create(model=MODEL, prompt=TEXT, max_tokens=1).usage.prompt_tokens == got["count"]
    status, bare = post(cl, "/tokenize", {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True})
    assert status == 200 and bare["tokens"] == got["tokens"][1:]
    assert len(bare["token_strs"]) == bare["count"] and all(isinstance(s, str) for s in bare["token_strs"])
    status, chat = post(cl, "/tokenize", {"messages": MESSAGES})
    served = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    assert status == 200 and chat["count"] == served
    status, closed = post(cl, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert status == 200 and closed["count"] < chat["count"] and chat["tokens"][:closed["count"]] == closed["tokens"]


def test_detokenize_inverts_tokenize(cl):
    _, ids = post(cl, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    status, got = post(cl, "/detokenize", {"model": MODEL, "tokens": ids["tokens"]})
    assert status == 200 and got == {"prompt": TEXT}


@pytest.mark.parametrize("path, body, words", [
    ("/tokenize", {"prompt": TEXT, "messages": MESSAGES}, "exactly one of"),
    ("/tokenize", {}, "exactly one of"),
    ("/tokenize", {"prompt": "x" * 200_000}, "exceeds the model's context"),
    ("/tokenize", {"prompt": "\ud800"}, "lone UTF-16 surrogate"),
    ("/tokenize", {"prompt": TEXT, "model": "gpt-4o"}, "does not exist"),
    ("/detokenize", {"tokens": [1, 2048]}, "outside the vocabulary"),
    ("/detokenize", {"tokens": [1] * 513}, "exceed the model's context of 512"),
    ("/detokenize", {"tokens": "1 2"}, "`tokens`"),
    ("/detokenize", {"tokens": [1], "extra": 1}, "`extra`"),
])
def test_bad_bodies_are_named(cl, path, body, words):
    status, got = post(cl, path, body)
    assert status in (400, 404, 413) and words in got["error"]["message"], got
    assert "Content-Type" not in got["error"]["message"]        # a body-level rule is not a malformed body
